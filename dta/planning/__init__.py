"""Planning in metadata space: one global prefix tree, packed into fixed budgets
(:mod:`~dta.planning.packing`) or balanced over workers (:mod:`~dta.planning.balance`),
priced by a cost model (:mod:`~dta.planning.cost`). Integers and numpy only."""
from dta.planning.balance import Assignment, balance
from dta.planning.cost import CostModel, features, flops, flops_unpacked, ideal_speedup
from dta.planning.index import PlanningError, TreeIndex, build_tree, first_trainable
from dta.planning.packing import PACKERS, Packing, lower_bound, pack

__all__ = [
    "Assignment", "balance", "CostModel", "features", "flops", "flops_unpacked",
    "ideal_speedup", "PlanningError", "TreeIndex", "build_tree", "first_trainable", "PACKERS",
    "Packing", "lower_bound", "pack",
]

"""Planning in metadata space: one global prefix tree, packed into fixed budgets
(:mod:`~dta.planning.packing`) or balanced over workers (:mod:`~dta.planning.balance`;
per-worker sequence ids: :mod:`~dta.planning.workers`), priced by a cost model
(:mod:`~dta.planning.cost`). Integers and numpy only."""
from dta.planning.balance import Assignment, balance
from dta.planning.cost import CostModel, features, flops, flops_unpacked, ideal_speedup
from dta.planning.index import PlanningError, TreeIndex, build_tree, first_trainable
from dta.planning.packing import PACKERS, Packing, lower_bound, pack
from dta.planning.workers import WorkerPlan, assign_workers, default_cost_model

__all__ = [
    "Assignment", "balance", "CostModel", "features", "flops", "flops_unpacked",
    "ideal_speedup", "PlanningError", "TreeIndex", "build_tree", "first_trainable", "PACKERS",
    "Packing", "lower_bound", "pack", "WorkerPlan", "assign_workers", "default_cost_model",
]

"""Planning in metadata space: one global prefix tree, bin-packed into fixed budgets
(:mod:`~dta.planning.binpack`; not the walker's packs of nodes, ``dta.options.PACKINGS``)
or balanced over workers (:mod:`~dta.planning.balance`;
per-worker sequence ids: :mod:`~dta.planning.workers`), priced by a cost model
(:mod:`~dta.planning.cost`). Integers and numpy only."""
from dta.planning.balance import Assignment, balance
from dta.planning.binpack import PACKERS, BinPacking, bin_pack, lower_bound
from dta.planning.cost import CostModel, features, flops, flops_unpacked, ideal_speedup
from dta.planning.index import PlanningError, TreeIndex, build_tree, first_trainable
from dta.planning.workers import WorkerPlan, assign_workers, default_cost_model

__all__ = [
    "Assignment", "balance", "CostModel", "features", "flops", "flops_unpacked",
    "ideal_speedup", "PlanningError", "TreeIndex", "build_tree", "first_trainable", "PACKERS",
    "BinPacking", "lower_bound", "bin_pack", "WorkerPlan", "assign_workers",
    "default_cost_model",
]

"""Which data-parallel worker trains which sequences: pure metadata (integers).

:func:`assign_workers` balances one batch's prefix tree over ``W`` workers with
:func:`dta.planning.balance.balance` under a :class:`~dta.planning.cost.CostModel` and
returns a :class:`WorkerPlan`: the sequence ids per worker, what each worker pays (its cost,
the unique tokens of its own tree), the imbalance max/mean and the tokens duplicated across
workers. Sequences that share a prefix tend to stay on one worker, so a prefix is forwarded
by as few workers as possible. A runtime sends each worker its ids; nothing here knows about
processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dta.planning.balance import balance
from dta.planning.cost import CostModel
from dta.tree import PrefixTree


@dataclass
class WorkerPlan:
    workers: list[list[int]]  # sequence ids per worker
    costs: list[float]  # planning cost of each worker's tree
    unique_tokens: list[int]  # tokens each worker forwards (its own tree)
    global_unique_tokens: int  # tokens of the whole batch's tree
    method: str = "balance"
    extra: dict = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        """max / mean of the worker costs (1.0: perfect)."""
        mean = float(np.mean(self.costs)) if self.costs else 0.0
        return float(max(self.costs) / mean) if mean > 0 else 1.0

    @property
    def duplicated_tokens(self) -> int:
        """Tokens forwarded by more than one worker (counted once per extra worker)."""
        return int(sum(self.unique_tokens) - self.global_unique_tokens)

    def as_dict(self) -> dict:
        return {"method": self.method, "workers": [len(w) for w in self.workers],
                "costs": [float(c) for c in self.costs],
                "unique_tokens": [int(u) for u in self.unique_tokens],
                "imbalance": self.imbalance, "duplicated_tokens": self.duplicated_tokens}


def default_cost_model(model_config=None) -> CostModel:
    """Analytic FLOPs from a model config when it has the needed fields, else unique tokens."""
    if model_config is not None:
        try:
            return CostModel.from_config(model_config)
        except (TypeError, ValueError, AttributeError, KeyError):
            pass
    return CostModel.tokens_only()


def assign_workers(tree_or_batch, n_workers: int, cost_model: CostModel | None = None
                   ) -> WorkerPlan:
    """Assign the sequences of a batch (or its PrefixTree) to ``n_workers`` workers."""
    if isinstance(n_workers, bool) or int(n_workers) != n_workers or n_workers < 1:
        raise ValueError(f"n_workers must be an integer >= 1, got {n_workers!r}")
    tree = tree_or_batch if isinstance(tree_or_batch, PrefixTree) else PrefixTree(
        tree_or_batch.input_ids)
    cost_model = cost_model or CostModel.tokens_only()
    n_seq = len(tree.sequences)
    if n_workers == 1:
        u = int(tree.stats().unique_tokens)
        return WorkerPlan([list(range(n_seq))], [float(cost_model.cost(tree, np.arange(n_seq)))],
                          [u], u, "single")
    result = balance(tree, int(n_workers), cost_model)
    groups = [[int(i) for i in w] for w in result.workers]
    if sorted(i for g in groups for i in g) != list(range(n_seq)):
        raise RuntimeError("the balancer did not assign every sequence exactly once")
    return WorkerPlan(groups, [float(c) for c in result.worker_cost],
                      [int(t) for t in result.worker_tokens], int(tree.stats().unique_tokens),
                      "dta.planning.balance", {"plan_ms": result.plan_ms})

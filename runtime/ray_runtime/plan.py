"""Which worker trains which sequences: a thin adapter over ``dta.planning``.

:func:`assign_workers` returns an :class:`Assignment` (per-worker sequence ids, their
costs under the planning cost model, the imbalance max/mean and the tokens duplicated
across workers). It uses the library's balancer (``dta.planning.balance.balance``) when it
is importable, and otherwise a simple fallback: split the heaviest subtrees of the prefix tree until
each is below the per-worker share, then place them largest first on the least-loaded
worker (LPT). Either way, sequences that share a prefix tend to stay together, so the
prefix is forwarded by as few workers as possible.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from dta.tree import PrefixTree


@dataclass
class Assignment:
    workers: list[list[int]]  # sequence ids per worker
    costs: list[float]  # planning cost of each worker's tree
    unique_tokens: list[int]  # tokens each worker forwards (its own tree)
    global_unique_tokens: int  # tokens of the whole batch's tree
    method: str = "fallback"
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


def default_cost_model(model_config=None):
    """The planning cost model: analytic FLOPs from a model config, else unique tokens."""
    try:
        from dta.planning.cost import CostModel
    except ImportError:  # the planning package predates cost.py
        return None
    if model_config is not None:
        try:
            return CostModel.from_config(model_config)
        except Exception:
            pass
    return CostModel.tokens_only()


def _costs(tree: PrefixTree, groups, cost_model) -> tuple[list[float], list[int]]:
    try:
        from dta.planning.cost import features
    except ImportError:
        features = None
    costs, uniques = [], []
    for ids in groups:
        if not len(ids):
            costs.append(0.0)
            uniques.append(0)
            continue
        if features is not None:
            u, a = features(tree, ids)
            c = cost_model.cost(tree, ids) if cost_model is not None else float(u)
        else:
            u = PrefixTree([tree.sequences[i] for i in ids]).stats().unique_tokens
            c = float(u)
        costs.append(float(c))
        uniques.append(int(u))
    return costs, uniques


def _library_balancer():
    """The library's balancer if it exists: ``balance(tree, W, cost_model)`` returning an
    object with ``workers`` (ids per worker) and ideally ``worker_cost``/``worker_tokens``."""
    import importlib

    try:  # the module (dta.planning re-exports its function under the same name)
        mod = importlib.import_module("dta.planning.balance")
    except ImportError:
        return None
    for name in ("balance", "balance_workers", "assign"):
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn
    return None


def _as_id_lists(result, n_workers: int) -> list[list[int]]:
    workers = getattr(result, "workers", None) or getattr(result, "bins", None)
    if workers is None and isinstance(result, (list, tuple)):
        workers = result
    if workers is None and isinstance(result, dict):
        workers = result.get("workers")
    if workers is None:
        raise TypeError(f"unrecognized balancer result {type(result).__name__}")
    out = [[int(i) for i in w] for w in workers]
    out += [[] for _ in range(n_workers - len(out))]
    return out


def fallback_assign(tree: PrefixTree, n_workers: int, cost_model=None) -> list[list[int]]:
    """Subtree splitting + LPT (see the module doc)."""
    n_seq = len(tree.sequences)
    if n_workers <= 1:
        return [list(range(n_seq))]

    def item_cost(ids) -> float:
        return _costs(tree, [ids], cost_model)[0][0]

    # An item: (sequence ids, splittable node or -1).
    items = [(tree.through(c), c) for c in tree.children[0]]
    items += [(tree.ending[0], -1)] if len(tree.ending[0]) else []
    total = item_cost(np.arange(n_seq))
    share = total / n_workers
    heap = [(-item_cost(ids), k, ids, u) for k, (ids, u) in enumerate(items)]
    heapq.heapify(heap)
    counter = len(heap)
    done = []
    # Split the heaviest splittable item while it exceeds the share (or there are fewer
    # items than workers), so that every worker can get a piece.
    while heap:
        neg, _, ids, u = heapq.heappop(heap)
        too_big = -neg > share or len(heap) + len(done) + 1 < n_workers
        if u < 0 or not tree.children[u] or not too_big:
            done.append((-neg, ids))
            continue
        parts = [(tree.through(c), c) for c in tree.children[u]]
        if len(tree.ending[u]):
            parts.append((tree.ending[u], -1))
        for pids, pu in parts:
            heapq.heappush(heap, (-item_cost(pids), counter, pids, pu))
            counter += 1
    done.sort(key=lambda x: -x[0])
    load = [(0.0, w) for w in range(n_workers)]
    heapq.heapify(load)
    out = [[] for _ in range(n_workers)]
    for cost, ids in done:
        current, w = heapq.heappop(load)
        out[w].extend(int(i) for i in ids)
        heapq.heappush(load, (current + cost, w))
    return [sorted(w) for w in out]


def assign_workers(tree_or_batch, n_workers: int, cost_model=None, *,
                   method: str = "auto") -> Assignment:
    """Assign the sequences of a batch (or its PrefixTree) to ``n_workers`` workers."""
    if n_workers < 1:
        raise ValueError(f"n_workers must be >= 1, got {n_workers}")
    tree = tree_or_batch if isinstance(tree_or_batch, PrefixTree) else PrefixTree(
        tree_or_batch.input_ids)
    if cost_model is None:
        cost_model = default_cost_model()
    used, result = "fallback", None
    balancer = _library_balancer() if method in ("auto", "library") else None
    if method == "library" and balancer is None:
        raise ValueError("dta.planning.balance is not available")
    if n_workers == 1:
        groups, used = [list(range(len(tree.sequences)))], "single"
    elif balancer is not None:
        result = balancer(tree, n_workers, cost_model)
        groups = _as_id_lists(result, n_workers)
        used = f"dta.planning.balance.{balancer.__name__}"
    else:
        groups = fallback_assign(tree, n_workers, cost_model)
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(len(tree.sequences))):
        raise RuntimeError(f"the planner ({used}) did not assign every sequence exactly once")
    costs = getattr(result, "worker_cost", None) if n_workers > 1 else None
    uniques = getattr(result, "worker_tokens", None) if n_workers > 1 else None
    if costs is None or uniques is None or len(costs) != n_workers:
        costs, uniques = _costs(tree, groups, cost_model)
    extra = {"plan_ms": getattr(result, "plan_ms", None)} if result is not None else {}
    return Assignment(groups, [float(c) for c in costs], [int(u) for u in uniques],
                      int(tree.stats().unique_tokens), used, extra)

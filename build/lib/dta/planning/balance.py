"""Balancing one global prefix tree over W workers.

Each worker trains its sequences as one tree, so a worker pays for the union of its
sequences' root paths; a shared prefix split across workers is paid once per worker
(``duplicated_tokens`` counts that honestly). The goal is the smallest maximum worker cost
under a :class:`~dta.planning.cost.CostModel`.

Algorithm (:func:`balance`):

1. Items are subtrees. Start from the root's children; every item whose standalone cost
   (its subtree plus its root path) exceeds ``alpha`` x the fair share (tree cost / W) is
   split into its children (plus the sequences ending at it). Each child then carries the
   parent's path as a potential duplicate.
2. LPT: items by standalone cost, descending, each to the worker whose load after adding
   it is smallest. The marginal cost on a worker is the item's own subtree plus only the
   part of its root path that the worker does not hold yet -- so siblings of a split
   subtree tend to stay together and duplicate nothing.
3. Refinement, until max/mean <= 1 + TOLERANCE: repeatedly move the item of the most
   loaded worker that lowers the maximum most (saving on the source = own cost + path
   nodes no other item there uses; only the items closest in size to half the gap to the
   least loaded worker are tried). When no move helps, the biggest subtree on that worker
   is split where it stands (its cost does not change) so that a piece can move next.
4. Steps 1-3 run for alpha in (1, 1/2, 1/4), stopping at the first plan within
   TOLERANCE; otherwise the plan with the smallest max cost wins
   (ties: fewer duplicated tokens). Finer splits balance better but duplicate more.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from dta.planning.cost import CostModel
from dta.planning.index import PlanningError, TreeIndex

ALPHAS = (1.0, 0.5, 0.25)
TOLERANCE = 0.002  # stop refining once max <= (1 + TOLERANCE) * mean
CANDIDATES = 12  # items of the most loaded worker tried per refinement round


@dataclass
class Assignment:
    """Result of :func:`balance`: sequence ids per worker and what each worker pays."""

    workers: list[list[int]]
    worker_cost: list[float]
    worker_tokens: list[int]
    imbalance: float  # max / mean worker cost
    duplicated_tokens: int  # Σ worker unique tokens - unique tokens of the whole tree
    plan_ms: float
    cost_unit: str = "token"

    def as_dict(self) -> dict:
        return asdict(self)


def check_workers(workers) -> int:
    if isinstance(workers, bool) or not float(workers).is_integer() or int(workers) < 1:
        raise PlanningError(f"the number of workers must be an integer >= 1, got {workers!r}")
    return int(workers)


class _Plan:
    """Items (anchor node, own cost, sequences) and per-worker node reference counts."""

    def __init__(self, ix: TreeIndex, node_cost: np.ndarray, prefix: np.ndarray, W: int):
        self.ix, self.node_cost, self.prefix, self.W = ix, node_cost, prefix, W
        self.cnt = np.zeros((ix.n_nodes, W), dtype=np.int32)
        self.load = np.zeros(W)
        self.items: list[list] = []  # [anchor, own cost, ids, standalone cost, subtree or -1]
        self.owner: list[int] = []
        self._paths: dict[int, np.ndarray] = {}

    def path(self, a: int) -> np.ndarray:
        p = self._paths.get(a)
        if p is None:
            p = self._paths[a] = np.asarray(self.ix.tree.path(a), dtype=np.int64)
        return p

    def marginal(self, a: int, own: float) -> np.ndarray:
        """Cost of adding an item anchored at a to every worker."""
        p = self.path(a)
        held = (self.cnt[p] > 0).sum(axis=0)  # worker sets are closed upward: a path prefix
        ends = np.concatenate([[0], self.ix.end[p]])
        return own + self.prefix[self.ix.end[a]] - self.prefix[ends[held]]

    def saving(self, a: int, own: float, w: int) -> float:
        """Cost removed from worker w by taking away one item anchored at a."""
        p = self.path(a)
        return own + float(self.node_cost[p[self.cnt[p, w] == 1]].sum())

    def place(self, k: int, w: int, sign: int = 1) -> None:
        a = self.items[k][0]
        self.cnt[self.path(a), w] += sign
        self.owner[k] = w if sign > 0 else -1


def _item(ix: TreeIndex, sub_cost, prefix, u: int, whole: bool) -> list:
    """[anchor, own cost, sequence ids, standalone cost, splittable subtree root or -1] of
    subtree u (``whole``, anchored at its parent) or of the sequences ending exactly at u
    (anchored at u itself, own cost 0: all their tokens are on the path)."""
    if whole:
        return [int(ix.parent[u]), float(sub_cost[u]), ix.through(u),
                float(prefix[ix.start[u]] + sub_cost[u]), u]
    return [u, 0.0, ix.tree.ending[u], float(prefix[ix.end[u]]), -1]


def _split(ix: TreeIndex, sub_cost, prefix, item) -> list:
    u = item[4]
    parts = [_item(ix, sub_cost, prefix, c, True) for c in ix.children[u]]
    if ix.ending_counts[u]:
        parts.append(_item(ix, sub_cost, prefix, u, False))
    return parts


def _items(ix: TreeIndex, sub_cost, prefix, limit: float) -> list:
    """Split subtrees costing more than ``limit`` standalone (see module doc, step 1)."""
    todo = [_item(ix, sub_cost, prefix, c, True) for c in ix.children[0]]
    out = []
    while todo:
        it = todo.pop()
        if it[3] > limit and it[4] >= 0 and ix.children[it[4]]:
            todo.extend(_split(ix, sub_cost, prefix, it))
        else:
            out.append(it)
    out.sort(key=lambda it: -it[3])
    return out


def _solve(ix, node_cost, prefix, sub_cost, W: int, limit: float, rounds: int) -> _Plan:
    plan = _Plan(ix, node_cost, prefix, W)
    plan.items = _items(ix, sub_cost, prefix, limit)
    plan.owner = [-1] * len(plan.items)
    for k, (a, own, *_) in enumerate(plan.items):  # LPT with marginal costs
        after = plan.load + plan.marginal(a, own)
        w = int(np.argmin(after))
        plan.load[w] = after[w]
        plan.place(k, w)
    for _ in range(rounds):  # refinement on the most loaded worker
        h = int(np.argmax(plan.load))
        if plan.load[h] <= (1 + TOLERANCE) * plan.load.mean():
            break
        mine = [k for k, o in enumerate(plan.owner) if o == h]
        target = (plan.load[h] - plan.load.min()) / 2  # the ideal amount to move
        mine.sort(key=lambda k: abs(plan.items[k][3] - target))
        best = (plan.load[h] * (1 - 1e-9), None, None, 0.0, 0.0)
        for k in mine[:CANDIDATES]:
            a, own = plan.items[k][:2]
            new_h = plan.load[h] - plan.saving(a, own, h)
            new = plan.load + plan.marginal(a, own)
            new[h] = np.inf
            w = int(np.argmin(new))
            if max(new_h, new[w]) < best[0]:
                best = (max(new_h, new[w]), k, w, new_h, new[w])
        if best[1] is not None:
            _, k, w, new_h, new_w = best
            plan.place(k, h, -1)
            plan.place(k, w)
            plan.load[h], plan.load[w] = new_h, new_w
            continue
        # No move helps: split the biggest splittable subtree of h where it stands (h's
        # cost is unchanged) so that the next round can move a piece of it.
        whole = [k for k in mine if plan.items[k][4] >= 0 and ix.children[plan.items[k][4]]]
        if not whole:
            break
        k = max(whole, key=lambda k: plan.items[k][1])
        plan.place(k, h, -1)
        parts = _split(ix, sub_cost, prefix, plan.items[k])
        plan.items[k] = parts[0]
        plan.place(k, h)
        for part in parts[1:]:
            plan.items.append(part)
            plan.owner.append(-1)
            plan.place(len(plan.items) - 1, h)
    return plan


def balance(tree, workers: int, model: CostModel | None = None, *,
            alphas=ALPHAS, rounds: int = 200) -> Assignment:
    """Assign the sequences of ``tree`` to ``workers`` workers minimizing the max cost."""
    t0 = time.perf_counter()
    W = check_workers(workers)
    model = model or CostModel.tokens_only()
    ix = tree if isinstance(tree, TreeIndex) else TreeIndex(tree)
    node_cost = model.node_costs(ix)
    cum = np.concatenate([[0.0], np.cumsum(node_cost)])
    sub_cost = cum[ix.sub_end] - cum[:-1]
    prefix = model.prefix_cost(np.arange(int(ix.end.max()) + 1))  # path of p tokens
    fair = sub_cost[0] / W
    best = None
    for alpha in alphas:
        plan = _solve(ix, node_cost, prefix, sub_cost, W, alpha * fair, rounds)
        groups = [[] for _ in range(W)]
        for item, w in zip(plan.items, plan.owner):
            groups[w].append(item[2])
        seqs = [np.sort(np.concatenate(g)) if g else np.zeros(0, dtype=np.int64) for g in groups]
        cost, tokens = _exact(ix, node_cost, seqs, model)
        key = (max(cost), int(tokens.sum()))
        if best is None or key < best[0]:
            best = (key, seqs, cost, tokens)
        if W == 1 or max(cost) <= (1 + TOLERANCE) * np.mean(cost):
            break  # finer splits would only add duplicated work
    _, seqs, cost, tokens = best
    plan_ms = (time.perf_counter() - t0) * 1e3
    mean = float(np.mean(cost))
    return Assignment([s.tolist() for s in seqs], [float(c) for c in cost],
                      [int(t) for t in tokens], float(max(cost)) / mean if mean > 0 else 1.0,
                      int(tokens.sum()) - ix.unique_tokens, plan_ms, model.unit)


def _exact(ix: TreeIndex, node_cost, seqs, model: CostModel):
    """Exact per-worker cost and unique tokens (union of root paths)."""
    used = [k for k, s in enumerate(seqs) if len(s)]
    cost, tokens = np.zeros(len(seqs)), np.zeros(len(seqs), dtype=np.int64)
    if used:
        b, u = ix.bin_nodes([seqs[k] for k in used])
        cost[used] = np.bincount(b, weights=node_cost[u], minlength=len(used)) + model.fixed
        tokens[used] = np.bincount(b, weights=ix.seg[u], minlength=len(used))
    return cost, tokens

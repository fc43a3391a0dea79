"""Packing a global prefix tree into fixed budgets (bins of ``capacity`` unique tokens).

The items are sequences (leaves of the global tree). A bin's cost is the number of unique
tokens of the union of its sequences' root paths, so a shared prefix is paid once per bin
that uses it: the load of a bin is a monotone submodular (coverage) function of its leaves,
and a leaf's marginal cost -- its insertion delta -- depends on what the bin already holds.

Packers (registry :data:`PACKERS`, name -> function):

``inorder``  Arrival order, one open bin; the next bin opens when a leaf's insertion delta
             does not fit. ART's "original in-order tree" baseline.
``bfd``      ART's best-fit decreasing: groups sorted by their largest standalone leaf cost
             (stable), leaves in group order, each into the open bin left fullest after
             adding its insertion delta. Every leaf scans every open bin, so the work is
             O(leaves x bins x depth) -- quadratic, as in ART (the scan is vectorized).
``dfs``      Ours, locality-aware (see :func:`pack_dfs`): bottom-up over the tree, whole
             subtrees that fit are single items, bins are merged only where their root paths
             meet, then a repair pass closes the emptiest bins by moving their leaves.

:func:`lower_bound` counts, bottom-up, how many bins must touch every node (a node whose
subtree cannot fit in one bin is paid again in each of them).
"""
from __future__ import annotations

import time
from bisect import bisect_left, insort
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from dta.planning.index import PlanningError, TreeIndex
from dta.tree import PrefixTree


@dataclass
class Packing:
    """Result of :func:`pack`. ``bins`` hold sequence ids; ``bin_tokens`` their unique tokens."""

    bins: list[list[int]]
    bin_tokens: list[int]
    lower_bound: int
    method: str
    plan_ms: float
    capacity: int = 0

    @property
    def n_bins(self) -> int:
        return len(self.bins)

    @property
    def gap(self) -> float:
        """Relative excess over the lower bound: bins / lower_bound - 1."""
        return self.n_bins / self.lower_bound - 1.0

    def as_dict(self) -> dict:
        return dict(asdict(self), n_bins=self.n_bins, gap=self.gap)


Packer = Callable[[TreeIndex, int, "np.ndarray | None"], list]


# --------------------------------------------------------------------------- checks --
def check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or not float(capacity).is_integer():
        raise PlanningError(f"capacity must be a positive integer, got {capacity!r}")
    if int(capacity) <= 0:
        raise PlanningError(f"capacity must be positive, got {capacity}")
    return int(capacity)


def check_fits(ix: TreeIndex, capacity: int) -> None:
    """Every sequence must fit in a bin on its own; name the ones that do not."""
    big = np.flatnonzero(ix.lengths > capacity)
    if big.size:
        shown = ", ".join(f"sequence {s} ({ix.lengths[s]} tokens)" for s in big[:10])
        more = f" and {big.size - 10} more" if big.size > 10 else ""
        raise PlanningError(f"{big.size} sequence(s) larger than the capacity of {capacity} "
                            f"tokens: {shown}{more}")


def group_codes(groups, n: int) -> np.ndarray:
    """Group labels -> integer codes in order of first appearance (None: one per sequence)."""
    if groups is None:
        return np.arange(n)
    if len(groups) != n:
        raise PlanningError(f"{len(groups)} group ids for {n} sequences")
    seen: dict = {}
    return np.array([seen.setdefault(g, len(seen)) for g in groups], dtype=np.int64)


# ---------------------------------------------------------------------- lower bound --
def lower_bound(tree, capacity: int) -> int:
    """Bins needed by any packing.

    b(v), a lower bound on the bins touching node v, bottom-up: the bins touching v hold v's
    root path (``end[v]`` tokens) plus the tokens of v's descendants, each descendant w
    counted once per bin touching it, so ``b(v) >= Σ_w seg(w) b(w) / (capacity - end[v])``;
    also ``b(v) >= b(child)`` and ``b(v) >= 1``. The virtual root (path 0) gives the bound,
    which is at least ceil(unique tokens / capacity).
    """
    ix = tree if isinstance(tree, TreeIndex) else TreeIndex(tree)
    capacity = check_capacity(capacity)
    check_fits(ix, capacity)
    m = ix.n_nodes
    below = np.zeros(m, dtype=np.int64)  # Σ seg(w) b(w) over proper descendants
    bmax = np.ones(m, dtype=np.int64)
    b = np.ones(m, dtype=np.int64)
    for level in ix.levels():  # deepest level first
        room = capacity - ix.end[level]
        need = np.where(below[level] > 0, -(-below[level] // np.maximum(room, 1)), 1)
        b[level] = np.maximum(np.maximum(need, bmax[level]), 1)
        lv = level[level > 0]
        np.add.at(below, ix.parent[lv], ix.seg[lv] * b[lv] + below[lv])
        np.maximum.at(bmax, ix.parent[lv], b[lv])
    return int(b[0])


# -------------------------------------------------------------------------- packers --
def pack_inorder(ix: TreeIndex, capacity: int, groups=None) -> list[list[int]]:
    """Greedy in arrival order with one open bin (ART's original in-order packer)."""
    par, end, leaf = ix.parent.tolist(), ix.end.tolist(), ix.leaf.tolist()
    stamp = [-1] * ix.n_nodes  # stamp[u] == b: node u is in bin b (the root always is)
    bins, tokens = [[]], 0
    for s in range(ix.n_seq):
        b, u = len(bins) - 1, leaf[s]
        while u and stamp[u] != b:  # up to the deepest ancestor already in the bin
            u = par[u]
        delta = end[leaf[s]] - end[u]
        if tokens + delta > capacity:
            bins.append([])
            b, tokens, delta = b + 1, 0, end[leaf[s]]
        u = leaf[s]
        while u and stamp[u] != b:
            stamp[u] = b
            u = par[u]
        tokens += delta
        bins[b].append(s)
    return bins


def art_order(ix: TreeIndex, groups=None) -> list[int]:
    """ART's placement order: groups by their largest standalone leaf cost, descending
    (stable: ties keep arrival order), leaves of a group in arrival order."""
    codes = group_codes(groups, ix.n_seq)
    members: dict[int, list[int]] = {}
    for s, g in enumerate(codes.tolist()):
        members.setdefault(g, []).append(s)
    lengths = ix.lengths.tolist()
    ordered = sorted(members.values(), key=lambda g: max(lengths[s] for s in g), reverse=True)
    return [s for g in ordered for s in g]


def pack_bfd(ix: TreeIndex, capacity: int, groups=None) -> list[list[int]]:
    """ART's best-fit decreasing over insertion deltas (``_place_prefix_tree_leaves``).

    For every leaf, the insertion delta into every open bin is computed (a vectorized scan:
    a bin holds whole root paths, so the occupied nodes of a leaf's path are a prefix of it
    and delta = path tokens - tokens of that prefix); the leaf goes into the bin with the
    least room left after adding it (first such bin on ties), or a new bin if none fits.
    """
    occ = np.zeros((ix.n_nodes, 64), dtype=bool)  # occ[u, b]: node u is in bin b
    tokens = np.zeros(64, dtype=np.int64)
    bins: list[list[int]] = []
    for s in art_order(ix, groups):
        path = ix.seq_path(s)
        full = int(ix.end[ix.leaf[s]])
        nb, best, count = len(bins), -1, full
        if nb:
            covered = np.concatenate([[0], ix.end[path]])[occ[path, :nb].sum(axis=0)]
            counts = tokens[:nb] + (full - covered)
            room = np.where(counts <= capacity, capacity - counts, capacity + 1)
            best = int(np.argmin(room))  # the first bin with the least room left
            if room[best] > capacity:
                best = -1
            else:
                count = int(counts[best])
        if best < 0:
            if nb == occ.shape[1]:  # grow the bin columns
                occ = np.concatenate([occ, np.zeros_like(occ)], axis=1)
                tokens = np.concatenate([tokens, np.zeros_like(tokens)])
            best = nb
            bins.append([])
        tokens[best] = count
        occ[path, best] = True
        bins[best].append(s)
    return bins


def _best_fit_additive(items: list, cap: int) -> list:
    """Best-fit decreasing of (load, parts) items with additive loads into bins of ``cap``."""
    items.sort(key=lambda it: -it[0])
    room: list[tuple[int, int]] = []  # sorted (room left, bin)
    bins: list[list] = []
    for load, parts in items:
        i = bisect_left(room, (load, -1))
        if i < len(room):
            left, b = room.pop(i)
            bins[b][0] += load
            bins[b][1].extend(parts)
            insort(room, (left - load, b))
        else:
            bins.append([load, list(parts)])
            insort(room, (cap - load, len(bins) - 1))
    return bins


def pack_dfs(ix: TreeIndex, capacity: int, groups=None, *, repair: bool = True) -> list:
    """Locality-aware packing: hierarchical best-fit over subtrees, then a repair pass.

    1. A node v is *heavy* if its subtree plus its root path exceeds the capacity. Light
       subtrees are never split. Going bottom-up over the heavy nodes (reverse pre-order),
       v's items are its light children (load = subtree tokens), the bins already formed
       for its heavy children, and its own ending sequences (load 0). Under v these loads
       are additive -- two items share exactly v's root path -- so they are combined by
       best-fit decreasing into bins of ``capacity - end[v]``. Bins are thus merged only
       where their root paths meet, and each bin's leaves are a few DFS-contiguous runs.
    2. Repair (:func:`_close_bins`): while above the lower bound, try to empty the least
       loaded bins by moving their leaves, one at a time in DFS order, to the bin where
       their insertion delta is smallest (then best fit); undo the moves if one does not fit.
    """
    end, seg, sub = ix.end, ix.seg, ix.sub_tokens
    heavy = (ix.start + sub > capacity).tolist()
    if not heavy[0]:
        return [list(range(ix.n_seq))]
    formed: dict[int, list] = {}
    for v in np.flatnonzero(heavy)[::-1].tolist():
        items = []
        for c in ix.children[v]:
            if heavy[c]:
                items.extend(formed.pop(c))
            else:
                items.append((int(sub[c]), [c]))
        if len(ix.tree.ending[v]):
            items.append((0, [-v - 1]))  # -v-1: the sequences ending at v
        formed[v] = [(int(seg[v]) + load, parts)
                     for load, parts in _best_fit_additive(items, capacity - int(end[v]))]
    bins = []
    for _, parts in formed[0]:
        ids = [ix.tree.ending[-p - 1] if p < 0 else ix.through(p) for p in parts]
        bins.append(np.concatenate(ids).tolist())
    if repair and len(bins) > 1:
        bins = _close_bins(ix, capacity, bins, lower_bound(ix, capacity))
    return bins


def _close_bins(ix: TreeIndex, capacity: int, bins: list, target: int,
                max_attempts: int = 32) -> list:
    """Try to empty the least loaded bins (see :func:`pack_dfs`, step 2)."""
    nb = len(bins)
    occ = np.zeros((ix.n_nodes, nb), dtype=bool)
    which, nodes = ix.bin_nodes(bins)
    occ[nodes, which] = True
    tokens = np.bincount(which, weights=ix.seg[nodes], minlength=nb).astype(np.int64)
    alive = np.ones(nb, dtype=bool)
    attempts = 0
    for b in np.argsort(tokens, kind="stable").tolist():
        if alive.sum() <= target or attempts >= max_attempts:
            break
        attempts += 1
        alive[b] = False
        log = []
        for s in bins[b]:
            path = ix.seq_path(s)
            full = int(ix.end[ix.leaf[s]])
            covered = np.concatenate([[0], ix.end[path]])[occ[path].sum(axis=0)]
            delta = full - covered
            count = tokens + delta
            ok = alive & (count <= capacity)
            if not ok.any():
                break
            key = np.where(ok, delta * (capacity + 1) + (capacity - count), np.iinfo(np.int64).max)
            t = int(np.argmin(key))
            new = path[~occ[path, t]]
            occ[new, t] = True
            tokens[t] += delta[t]
            log.append((s, t, new, int(delta[t])))
        if len(log) == len(bins[b]):
            for s, t, _, _ in log:
                bins[t].append(s)
            bins[b] = []
            continue
        for s, t, new, d in reversed(log):  # undo
            occ[new, t] = False
            tokens[t] -= d
        alive[b] = True
    return [sorted(ids) for ids in bins if ids]


PACKERS: dict[str, Packer] = {
    "inorder": pack_inorder,
    "bfd": pack_bfd,
    "dfs": pack_dfs,
}


# ---------------------------------------------------------------------------- entry --
def pack(tree: PrefixTree | TreeIndex, capacity: int, method: str = "dfs",
         groups: Sequence | None = None) -> Packing:
    """Pack the sequences of ``tree`` into bins of at most ``capacity`` unique tokens.

    groups: optional group label per sequence (used by ``bfd``'s ordering, as in ART).
    ``plan_ms`` covers everything after the tree was built: index, packing, bound, check.
    """
    t0 = time.perf_counter()
    capacity = check_capacity(capacity)
    if method not in PACKERS:
        raise PlanningError(f"unknown packing method {method!r}; choose from {sorted(PACKERS)}")
    ix = tree if isinstance(tree, TreeIndex) else TreeIndex(tree)
    check_fits(ix, capacity)
    bins = [list(map(int, b)) for b in PACKERS[method](ix, capacity, groups)]
    bins = [sorted(b) for b in bins]
    bin_tokens = ix.bin_tokens(bins).tolist()
    lb = lower_bound(ix, capacity)
    plan_ms = (time.perf_counter() - t0) * 1e3
    placed = np.sort(np.concatenate([np.asarray(b, dtype=np.int64) for b in bins]))
    if not np.array_equal(placed, np.arange(ix.n_seq)) or max(bin_tokens) > capacity:
        raise AssertionError(f"packer {method!r} produced an invalid packing")
    return Packing(bins, bin_tokens, lb, method, plan_ms, capacity)

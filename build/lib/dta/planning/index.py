"""Derived arrays over a :class:`~dta.tree.PrefixTree` that every planner needs.

Everything here is integer metadata (numpy), computed once per tree in O(nodes + Σ depth):

* ``seg[u]``: tokens of node u; ``end[u]``: tokens on the root path *through* u (node
  positions are tree positions, so the path cost of u is simply ``end[u]``, and the tokens
  strictly above u are ``start[u]``).
* ``sub_end[u]``: node ids are in pre-order, so u's subtree is the id range
  ``[u, sub_end[u])``; ``sub_tokens[u]`` is the token count of that range.
* ``leaf[s]``: the node where sequence s ends; ``paths``: the root path of every node that
  ends a sequence (CSR, root side first), used for insertion deltas.

A set of sequences costs the union of their root paths. Because a bin's node set is closed
upward (it holds whole root paths), the marginal cost of adding sequence s to a bin is
``end[leaf[s]] - end[a]`` with a the deepest ancestor of the leaf already in the bin.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dta.tree import PrefixTree


class PlanningError(ValueError):
    """Bad planning input (empty batch, bad capacity or worker count, oversize sequence)."""


class TreeIndex:
    """Read-only planner view of a PrefixTree (see the module docstring)."""

    def __init__(self, tree: PrefixTree):
        if not isinstance(tree, PrefixTree):
            raise PlanningError(f"expected a PrefixTree, got {type(tree).__name__}")
        self.tree = tree
        self.n_seq = len(tree.sequences)
        self.n_nodes = len(tree)
        if self.n_seq == 0:
            raise PlanningError("empty batch: no sequences to plan")
        self.parent = tree.parent
        self.start = tree.start
        self.end = tree.end
        self.seg = tree.end - tree.start
        self.lengths = tree.lengths
        self.children = tree.children
        self.depth, self.sub_end = _depth_and_subtree_end(tree.parent)
        self.cum_seg = np.concatenate([[0], np.cumsum(self.seg)])
        self.sub_tokens = self.cum_seg[self.sub_end] - self.cum_seg[:-1]
        counts = np.fromiter(map(len, tree.ending), dtype=np.int64, count=self.n_nodes)
        self.ending_counts = counts
        self.leaf = np.empty(self.n_seq, dtype=np.int64)
        self.leaf[np.concatenate(tree.ending)] = np.repeat(np.arange(self.n_nodes), counts)
        self.unique_tokens = int(self.seg.sum())
        self._paths = None

    # ----------------------------------------------------------------------- paths --
    def _build_paths(self) -> None:
        """CSR root paths (root side first, node 0 excluded) of every node ending a sequence."""
        nodes = np.flatnonzero(self.ending_counts)
        d = self.depth[nodes]
        ptr = np.concatenate([[0], np.cumsum(d)])
        flat = np.empty(int(ptr[-1]), dtype=np.int64)
        pos, cur = ptr[1:] - 1, nodes.copy()
        active = np.flatnonzero(cur > 0)
        while active.size:  # one vector step per tree level, leaf side first
            flat[pos[active]] = cur[active]
            pos[active] -= 1
            cur[active] = self.parent[cur[active]]
            active = active[cur[active] > 0]
        slot = np.full(self.n_nodes, -1, dtype=np.int64)
        slot[nodes] = np.arange(len(nodes))
        self._paths = (slot, ptr, flat)

    def path(self, u: int) -> np.ndarray:
        """Root path of a node that ends a sequence (root side first)."""
        if self._paths is None:
            self._build_paths()
        slot, ptr, flat = self._paths
        k = slot[u]
        if k < 0:
            return np.asarray(self.tree.path(int(u)), dtype=np.int64)
        return flat[ptr[k]:ptr[k + 1]]

    def seq_path(self, s: int) -> np.ndarray:
        return self.path(int(self.leaf[s]))

    # ------------------------------------------------------------------------ sets --
    def through(self, u: int) -> np.ndarray:
        """Sequences ending in u's subtree."""
        return self.tree.through(u)

    def _path_entries(self, seq_ids) -> tuple[np.ndarray, np.ndarray]:
        """(owner, node): the root-path nodes of every sequence, owner = its index in seq_ids."""
        if self._paths is None:
            self._build_paths()
        slot, ptr, flat = self._paths
        k = slot[self.leaf[np.asarray(seq_ids, dtype=np.int64)]]
        lens = ptr[k + 1] - ptr[k]
        first = np.cumsum(lens) - lens
        idx = np.repeat(ptr[k] - first, lens) + np.arange(int(lens.sum()))
        return np.repeat(np.arange(len(k)), lens), flat[idx]

    def union_mask(self, seq_ids) -> np.ndarray:
        """Boolean node mask of the union of the root paths of ``seq_ids``."""
        mask = np.zeros(self.n_nodes, dtype=bool)
        mask[self._path_entries(np.unique(np.asarray(seq_ids, dtype=np.int64)))[1]] = True
        return mask

    def bin_nodes(self, bins) -> tuple[np.ndarray, np.ndarray]:
        """Distinct (bin, node) pairs of the unions of root paths of several sequence sets."""
        ids = np.concatenate([np.asarray(b, dtype=np.int64) for b in bins])
        which = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
        owner, node = self._path_entries(ids)
        key = np.unique(which[owner] * self.n_nodes + node)
        return key // self.n_nodes, key % self.n_nodes

    def bin_tokens(self, bins) -> np.ndarray:
        """Unique tokens of each sequence set in ``bins`` (one vectorized pass)."""
        if not bins:
            return np.zeros(0, dtype=np.int64)
        b, u = self.bin_nodes(bins)
        return np.bincount(b, weights=self.seg[u], minlength=len(bins)).astype(np.int64)

    def union_tokens(self, seq_ids) -> int:
        """Unique tokens of the union of the root paths of ``seq_ids``."""
        if len(seq_ids) == 0:
            return 0
        return int(self.seg[self.union_mask(seq_ids)].sum())

    def levels(self) -> list[np.ndarray]:
        """Node ids grouped by depth, deepest level first (for bottom-up vector passes)."""
        by_depth = np.argsort(-self.depth, kind="stable")
        return np.split(by_depth, np.flatnonzero(np.diff(self.depth[by_depth])) + 1)


def _depth_and_subtree_end(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Node depths (root 0) by pointer jumping (log(depth) vector passes), and pre-order
    subtree ends ``u + size(u)`` from subtree sizes summed level by level, deepest first."""
    m = len(parent)
    depth = np.ones(m, dtype=np.int64)
    depth[0] = 0
    up = parent.copy()
    up[0] = 0
    while True:
        live = np.flatnonzero(up)
        if not live.size:
            break
        depth[live] += depth[up[live]]
        up[live] = up[up[live]]
    size = np.ones(m, dtype=np.int64)
    by_depth = np.argsort(-depth, kind="stable")
    cuts = np.flatnonzero(np.diff(depth[by_depth])) + 1
    for level in np.split(by_depth, cuts):
        if depth[level[0]] > 0:
            np.add.at(size, parent[level], size[level])
    return depth, np.arange(m) + size


def first_trainable(loss_mask) -> int | None:
    """Index of the first token with loss-mask 1 (None if no token is trainable)."""
    m = np.flatnonzero(np.asarray(loss_mask).reshape(-1) != 0)
    return int(m[0]) if len(m) else None


def build_tree(sequences: Sequence, loss_masks: Sequence | None = None, *,
               art_sharing: bool = False, min_shared: int = 1) -> PrefixTree:
    """The global prefix tree of a batch, optionally with ART's sharing rule.

    art_sharing: stop sharing before the first trainable token, and also duplicate the token
        just before it (each branch keeps its own copy of the last prompt token, so that the
        query predicting its first trainable token is private): ``shared_until = f - 1``
        with f the first index whose loss mask is 1.
    """
    if sequences is None or len(sequences) == 0:
        raise PlanningError("empty batch: no sequences to plan")
    shared_until = None
    if art_sharing:
        if loss_masks is None:
            raise PlanningError("art_sharing needs loss masks (which tokens are trainable)")
        if len(loss_masks) != len(sequences):
            raise PlanningError(f"{len(loss_masks)} loss masks for {len(sequences)} sequences")
        shared_until = []
        for seq, mask in zip(sequences, loss_masks):
            f = first_trainable(mask)
            shared_until.append(len(seq) if f is None else max(f - 1, 0))
    return PrefixTree(sequences, min_shared=min_shared, shared_until=shared_until)

"""The prefix tree: a radix tree of token segments, in metadata only (integers, no tensors).

Every root-to-node path spells a prefix shared by the sequences that pass through the node;
a node's tokens sit at tree positions ``start .. end-1`` (their depth on the original
sequence, which is what RoPE sees). Node 0 is a virtual, empty root, so a batch of
unrelated trees is one forest under it.

Construction is near-linear in the number of tokens: sequences are sorted (byte order of
big-endian token ids equals lexicographic order), the longest common prefix (LCP) of each
adjacent pair is found with one vectorized comparison, and the tree is built from the sorted
order and the LCPs with a stack, as a suffix tree is built from a suffix array. The
sequences below a node are then a contiguous range ``order[lo:hi]`` of the sorted order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


def unpad(input_ids, attention_mask) -> list[np.ndarray]:
    """Right-padded ``[B, S]`` ids + 0/1 mask -> list of 1-D arrays; rejects left padding
    or holes in the mask, naming the row."""
    ids = np.asarray(input_ids.cpu() if hasattr(input_ids, "cpu") else input_ids)
    mask = np.asarray(attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape} must both be [B, S]")
    out = []
    for i, (row, m) in enumerate(zip(ids, mask)):
        n = int(m.sum())
        if not np.all(m[:n] == 1) or np.any(m[n:] != 0):
            raise ValueError(f"sequence {i}: attention_mask is not right-padded 1...1 0...0")
        out.append(row[:n].astype(np.int64))
    return out


@dataclass(frozen=True)
class Segment:
    """One node of the tree, as a user sees it."""

    id: int
    parent: int  # -1 for the root
    start: int  # tree position of the first token (= depth on every sequence through it)
    end: int  # one past the last position
    sequences: np.ndarray  # ids of the sequences passing through this node
    ending: np.ndarray  # ids of the sequences whose last token is this node's last
    children: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TreeStats:
    sequences: int
    nodes: int  # excluding the virtual root
    total_tokens: int  # sum of sequence lengths (what unpacked training forwards)
    unique_tokens: int  # sum of node lengths (what a tree forwards once)
    sharing_ratio: float  # total / unique
    depth: int  # max number of nodes on a root-to-leaf path
    max_length: int  # longest sequence

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _lcp(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    m = min(limit, len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def _sort_exact(sequences: list[np.ndarray], cap: np.ndarray) -> np.ndarray:
    """Sequence ids by the big-endian bytes of their shareable part (stable: ties by id)."""
    keys = [s[:c].astype(">u8").tobytes() for s, c in zip(sequences, cap)]
    return np.array(sorted(range(len(sequences)), key=keys.__getitem__), dtype=np.int64)


def _sort_order(sequences: list[np.ndarray], cap: np.ndarray) -> np.ndarray:
    """The order of :func:`_sort_exact`, with 4-byte keys when every token is in [0, 2^32).

    Building the keys is most of the cost of a build (every token is copied once), so the
    keys are written once, straight into a bytearray, at half the width. For such values the
    big-endian 4-byte order equals the 8-byte order, so the result is identical.
    """
    fits = bool(np.all(cap >= 0)) and all(
        c == 0 or (s[:c].min() >= 0 and s[:c].max() <= 0xFFFFFFFF) for s, c in zip(sequences, cap))
    if not fits:
        return _sort_exact(sequences, cap)
    keys = []
    for s, c in zip(sequences, cap.tolist()):
        key = bytearray(4 * c)
        np.frombuffer(key, dtype=">u4")[:] = s[:c]
        keys.append(key)
    return np.array(sorted(range(len(sequences)), key=keys.__getitem__), dtype=np.int64)


class PrefixTree:
    """Radix tree over ``sequences`` (a list of 1-D integer arrays).

    Arrays indexed by node id (node 0 is the root, ids are in depth-first pre-order, children
    in lexicographic order): ``parent``, ``start``, ``end``, ``lo``, ``hi`` (the sequences
    through node u are ``order[lo[u]:hi[u]]``), ``first_child``/``next_sibling``.
    """

    def __init__(self, sequences: Sequence[np.ndarray], *, min_shared: int = 1,
                 shared_until: Sequence[int] | None = None):
        """Build the tree.

        min_shared: a shared segment shorter than this many tokens is not shared: it is
            copied into each child instead (the root's children are never merged away).
        shared_until: per sequence, the number of leading tokens that may be shared; tokens
            from that position on are private to the sequence (ART's accounting, where the
            token before the first trainable one is duplicated per branch).
        """
        self.sequences = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        n = len(self.sequences)
        if n == 0:
            raise ValueError("PrefixTree: the batch has no sequences")
        for i, s in enumerate(self.sequences):
            if len(s) == 0:
                raise ValueError(f"PrefixTree: sequence {i} is empty")
        lengths = np.array([len(s) for s in self.sequences], dtype=np.int64)
        cap = lengths.copy() if shared_until is None else np.minimum(
            np.asarray(shared_until, dtype=np.int64), lengths)
        if len(cap) != n:
            raise ValueError(f"PrefixTree: shared_until has {len(cap)} entries for {n} sequences")
        self.lengths = lengths

        # Sort by the shareable part only; then the LCP of any two sequences is the minimum
        # of the adjacent LCPs between them, which the stack construction relies on.
        order = _sort_order(self.sequences, cap)
        lcp = np.zeros(n, dtype=np.int64)
        seqs, capl, ids = self.sequences, cap.tolist(), order.tolist()
        for k in range(1, n):
            a, b = ids[k - 1], ids[k]
            lcp[k] = _lcp(seqs[a], seqs[b], min(capl[a], capl[b]))
        self.order = order
        self._build(lcp)
        if min_shared > 1:
            self._unshare_short(min_shared)

    # ----------------------------------------------------------------------------- build --
    def _build(self, lcp: np.ndarray) -> None:
        # Lists indexed by creation id; children lists stay in sorted (lexicographic) order
        # because a split replaces the most recent child of the stack top by the new node.
        # (Plain Python lists and ints throughout: this loop runs once per node.)
        end, parent, children, ending = [0], [-1], [[]], [[]]
        lengths = self.lengths.tolist()
        stack = [0]
        for seq_id, shared in zip(self.order.tolist(), lcp.tolist()):
            length = lengths[seq_id]
            last = -1
            while end[stack[-1]] > shared:
                last = stack.pop()
            top = stack[-1]
            if end[top] < shared:  # split: a new internal node takes `last` under it
                node = len(end)
                children[top][-1] = node  # `last` was top's most recent child
                end.append(shared)
                parent.append(top)
                children.append([last])
                ending.append([])
                parent[last] = node
                stack.append(node)
                top = node
            if length == shared:  # duplicate, or a strict prefix of the previous sequence
                ending[top].append(seq_id)
            else:
                node = len(end)
                children[top].append(node)
                end.append(length)
                parent.append(top)
                children.append([])
                ending.append([seq_id])
                stack.append(node)
        start = [0] + [end[p] for p in parent[1:]]
        self._finish(start, end, parent, children, ending)

    def _finish(self, start, end, parent, children, ending) -> None:
        """Renumber nodes in depth-first pre-order; derive lo/hi from the sorted order."""
        pre, todo = [], [0]
        while todo:
            u = todo.pop()
            pre.append(u)
            todo.extend(reversed(children[u]))
        new_id = [-1] * len(end)
        for i, u in enumerate(pre):
            new_id[u] = i
        par = [new_id[parent[u]] if parent[u] >= 0 else -1 for u in pre]
        self.parent = np.array(par, dtype=np.int64)
        self.start = np.array([start[u] for u in pre], dtype=np.int64)
        self.end = np.array([end[u] for u in pre], dtype=np.int64)
        self.children = [[new_id[c] for c in children[u]] for u in pre]
        ends = [sorted(ending[u]) for u in pre]
        self.ending = [np.array(e, dtype=np.int64) for e in ends]
        # Sequences through u = those ending in u's subtree: a contiguous range of `order`.
        n, m = len(self.order), len(pre)
        rank = [0] * n
        for r, seq_id in enumerate(self.order.tolist()):
            rank[seq_id] = r
        lo, hi = [n] * m, [0] * m
        for u in range(m - 1, 0, -1):  # reverse pre-order: children before parents
            if ends[u]:
                r = [rank[seq_id] for seq_id in ends[u]]
                lo[u] = min(lo[u], min(r))
                hi[u] = max(hi[u], max(r) + 1)
            p = par[u]
            lo[p] = min(lo[p], lo[u])
            hi[p] = max(hi[p], hi[u])
        lo[0], hi[0] = 0, n
        self.lo = np.array(lo, dtype=np.int64)
        self.hi = np.array(hi, dtype=np.int64)

    def _unshare_short(self, min_shared: int) -> None:
        """Copy every shared segment shorter than `min_shared` into its children."""
        start, end = list(self.start), list(self.end)
        parent, children = list(self.parent), [list(c) for c in self.children]
        ending = [list(e) for e in self.ending]
        for u in range(len(start) - 1, 0, -1):  # bottom-up, so merged children stay valid
            if not children[u] or end[u] - start[u] >= min_shared:
                continue
            p = parent[u]
            moved = children[u]
            if ending[u]:  # sequences ending here get a leaf of their own with u's tokens
                leaf = len(start)
                start.append(start[u]); end.append(end[u]); parent.append(p)
                children.append([]); ending.append(ending[u])
                moved = [leaf] + moved
            for c in moved:
                start[c], parent[c] = start[u], p
            i = children[p].index(u)
            children[p][i:i + 1] = moved
            children[u], ending[u] = [], []
        self._finish(start, end, parent, children, ending)

    # ------------------------------------------------------------------------- queries --
    @classmethod
    def from_sequences(cls, sequences, **kw) -> "PrefixTree":
        return cls(sequences, **kw)

    @classmethod
    def from_padded(cls, input_ids, attention_mask, **kw) -> "PrefixTree":
        """From right-padded ``[B, S]`` ids and a 0/1 attention mask (numpy or torch)."""
        return cls(unpad(input_ids, attention_mask), **kw)

    def __len__(self) -> int:
        return len(self.parent)

    def length(self, u: int) -> int:
        return int(self.end[u] - self.start[u])

    def through(self, u: int) -> np.ndarray:
        """Ids of the sequences passing through node u."""
        return self.order[self.lo[u]:self.hi[u]]

    def tokens(self, u: int) -> np.ndarray:
        return self.sequences[self.order[self.lo[u]]][self.start[u]:self.end[u]]

    def segment(self, u: int) -> Segment:
        return Segment(u, int(self.parent[u]), int(self.start[u]), int(self.end[u]),
                       self.through(u), self.ending[u], tuple(self.children[u]))

    def path(self, u: int) -> list[int]:
        """Node ids from the root's child down to u."""
        out = []
        while u > 0:
            out.append(u)
            u = int(self.parent[u])
        return out[::-1]

    def leaf_of(self) -> np.ndarray:
        """For each sequence, the node its last token is in."""
        out = np.empty(len(self.sequences), dtype=np.int64)
        for u, ends in enumerate(self.ending):
            out[ends] = u
        return out

    def dfs(self) -> Iterator[tuple[str, int]]:
        """Yield ('push', u) in pre-order and ('pop', u) in post-order, root excluded."""
        stack = [(c, False) for c in reversed(self.children[0])]
        while stack:
            u, done = stack.pop()
            if done:
                yield "pop", u
                continue
            yield "push", u
            stack.append((u, True))
            stack.extend((c, False) for c in reversed(self.children[u]))

    def depth(self) -> int:
        d = np.zeros(len(self), dtype=np.int64)
        for u in range(1, len(self)):  # pre-order: parents before children
            d[u] = d[self.parent[u]] + 1
        return int(d.max())

    def stats(self, lengths: Sequence[int] | None = None) -> TreeStats:
        """The tree's figures; ``lengths``: those of each sequence's first ``lengths[i]``
        tokens as this tree holds them (a front door that appends a token to each sequence
        for the walk counts its own tokens: totals and unique tokens exact; nodes and depth
        count the nodes holding any of them)."""
        if lengths is None:
            total = int(self.lengths.sum())
            unique = int((self.end - self.start).sum())
            return TreeStats(len(self.sequences), len(self) - 1, total, unique,
                             total / unique, self.depth(), int(self.lengths.max()))
        counted = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if len(counted) != len(self.sequences) or np.any(counted < 1) or np.any(
                counted > self.lengths):
            raise ValueError(f"PrefixTree.stats: lengths must give 1..len(sequence) tokens for "
                             f"each of the {len(self.sequences)} sequences")
        reach = np.zeros(len(self), dtype=np.int64)  # per node: the furthest counted position
        for u, ends in enumerate(self.ending):
            if len(ends):
                reach[u] = counted[ends].max()
        for u in range(len(self) - 1, 0, -1):  # children before parents
            reach[self.parent[u]] = max(reach[self.parent[u]], reach[u])
        held = np.clip(np.minimum(self.end, reach) - self.start, 0, None)
        held[0] = 0
        depth = np.zeros(len(self), dtype=np.int64)
        for u in range(1, len(self)):  # pre-order: parents before children
            depth[u] = depth[self.parent[u]] + (held[u] > 0)
        total, unique = int(counted.sum()), int(held.sum())
        return TreeStats(len(self.sequences), int((held > 0).sum()), total, unique,
                         total / unique, int(depth.max()), int(counted.max()))


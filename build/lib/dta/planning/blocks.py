"""Blocks: a tree node longer than ``block_tokens`` is cut into a chain of pieces (metadata).

The walk's memory is bounded by one root-to-leaf path only if no single call is longer than
the budget allows: under the *recompute* policy the largest call, not the path, sets the
peak. :func:`cut_blocks` therefore rewrites the tree before the pack planner sees it: a node
of n > B tokens becomes ceil(n / B) pieces of near-equal length (none longer than B), each
piece the only child of the previous one. The last piece keeps the node's children and the
sequences that end in it; every piece is passed by the same sequences as the node. Nothing
else changes, so the walk needs no branch for blocks:

- a piece is a node whose parent is the previous piece: it is forwarded at its true tree
  positions attending to the path's cached K/V -- the earlier pieces included -- so
  positions, sliding windows (enforced by the mask on true positions) and the path's K/V are
  those of the whole node; a recurrent (Gated DeltaNet) layer continues from the previous
  piece's final states, as a child continues from its parent's;
- the objective's terms of a piece are its rows' (:meth:`dta.objective.Objective.terms`:
  row q predicts the token at q + 1): an inner piece's last row predicts the next piece's
  first token, shared by every sequence through the node; the fork row (each child's first
  token) stays the last row of the node, now the last piece's;
- the walk pushes the pieces as a chain: under *recompute* each keeps only its detached K/V
  (and recurrent states) after its forward and is re-forwarded alone at its pop, so one
  piece's graph is alive at a time; under *retain* the pieces on the path keep their graphs,
  as whole nodes do.

The pack planner runs on the cut tree with its cap at most ``block_tokens``, so no pack (a
call) is longer than a block either. Integers and numpy only. ``block_tokens`` is a walk
setting: its default and validation are :class:`dta.options.WalkOptions`'.
"""
from __future__ import annotations

import numpy as np

from dta.tree import PrefixTree


def piece_counts(tree: PrefixTree, block_tokens: int | None) -> np.ndarray:
    """Pieces per node (1 for the root and for every node of at most ``block_tokens``)."""
    lengths = (tree.end - tree.start).astype(np.int64)
    if not block_tokens:
        return np.ones(len(tree), dtype=np.int64)
    return np.maximum(1, -(-lengths // int(block_tokens)))


def cut_blocks(tree: PrefixTree, block_tokens: int | None) -> tuple[PrefixTree, np.ndarray]:
    """(the cut tree, ``origin``): ``origin[v]`` is the node of ``tree`` piece ``v`` belongs
    to. No node longer than ``block_tokens``: ``tree`` itself and the identity.
    ``block_tokens``: a walk setting (validated by :class:`dta.options.WalkOptions`); None: no
    cut."""
    counts = piece_counts(tree, block_tokens)
    m = len(tree)
    if int(counts.sum()) == m:
        return tree, np.arange(m, dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # new id of each node's first piece
    last = first + counts - 1
    origin = np.repeat(np.arange(m, dtype=np.int64), counts)
    k = np.arange(len(origin)) - first[origin]  # index of each piece inside its node
    n, c = (tree.end - tree.start)[origin], counts[origin]
    # near-equal pieces: piece k of a node of n tokens in c pieces starts at floor(k n / c)
    start = tree.start[origin] + (k * n) // c
    end = tree.start[origin] + ((k + 1) * n) // c
    parent = np.where(k > 0, np.arange(len(origin)) - 1, last[np.maximum(tree.parent[origin], 0)])
    parent[0] = -1
    empty = np.zeros(0, dtype=np.int64)
    is_last = k == c - 1
    cut = PrefixTree.__new__(PrefixTree)
    cut.sequences, cut.lengths, cut.order = tree.sequences, tree.lengths, tree.order
    cut.parent, cut.start, cut.end = parent.astype(np.int64), start.astype(np.int64), end.astype(np.int64)
    cut.lo, cut.hi = tree.lo[origin], tree.hi[origin]
    cut.children = [[int(first[ch]) for ch in tree.children[u]] if last_piece else [v + 1]
                    for v, (u, last_piece) in enumerate(zip(origin.tolist(), is_last.tolist()))]
    cut.ending = [tree.ending[u] if last_piece else empty
                  for u, last_piece in zip(origin.tolist(), is_last.tolist())]
    return cut, origin

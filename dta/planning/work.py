"""What one step walks, per data-parallel group: the decoder calls of its tree at a block.

The time model (:mod:`dta.planning.timing`) prices a candidate layout on the batch it will
train. :class:`Workload` balances the batch's prefix tree over ``D`` data-parallel groups
exactly as the runtime does (:func:`dta.planning.workers.assign_workers` under the config's
FLOP model) and describes each group's walk as :class:`Calls`: the pieces a block cuts its
nodes into (``dta.planning.blocks``: a node of n tokens becomes ceil(n / B) near-equal
pieces) and the attention context Σ (tree position + 1) over its tokens, which no cut
changes. A piece is one decoder call; the pack planner may join small nodes into one call,
so the count is an upper bound (on the long trajectories this models, every node is longer
than a block and the count is exact). Integers and numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dta.planning.cost import CostModel, node_attention
from dta.planning.index import TreeIndex
from dta.planning.workers import assign_workers
from dta.tree import PrefixTree


@dataclass(frozen=True)
class Calls:
    """One group's decoder calls: ``counts[i]`` pieces of ``lengths[i]`` tokens, and the
    attention context of its tokens (Σ over them of tree position + 1)."""

    lengths: np.ndarray
    counts: np.ndarray
    context: int

    @property
    def tokens(self) -> int:
        return int(np.dot(self.lengths, self.counts))

    @property
    def calls(self) -> int:
        return int(self.counts.sum())

    def rows(self, ranks: int) -> int:
        """Σ over calls of ceil(length / ranks): the rows the most loaded of ``ranks`` ranks
        takes when each call's rows are split evenly (rank r: [r T // C, (r + 1) T // C))."""
        return int(np.dot(-(-self.lengths // int(ranks)), self.counts))

    def own_pairs(self) -> int:
        """Σ over calls of T (T + 1) / 2: the causal pairs inside each call."""
        return int(np.dot(self.lengths * (self.lengths + 1) // 2, self.counts))


def cut(seg: np.ndarray, block: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, counts) of the pieces ``dta.planning.blocks.cut_blocks`` cuts nodes of
    ``seg`` tokens into: k = ceil(n / B) pieces, n mod k of them one token longer."""
    seg = np.asarray(seg, dtype=np.int64)
    seg = seg[seg > 0]
    if not block:
        return seg, np.ones(len(seg), dtype=np.int64)
    k = -(-seg // int(block))
    q, r = seg // k, seg % k
    return np.concatenate([q + 1, q]), np.concatenate([r, k - r])


class Workload:
    """A batch's tree, balanced over data-parallel groups on demand (cached per group count)."""

    def __init__(self, tree: PrefixTree, cost: CostModel):
        self.tree, self.cost = tree, cost
        self.index = TreeIndex(tree)
        self.sequence_tokens = int(np.sum(self.index.lengths))  # what the step trains
        self._attention = node_attention(self.index)
        self._groups: dict[int, list[np.ndarray]] = {}

    def groups(self, data_parallel: int) -> list[np.ndarray]:
        """Node masks of the groups' trees (the union of their sequences' root paths)."""
        D = int(data_parallel)
        if D not in self._groups:
            plan = assign_workers(self.tree, D, self.cost)
            self._groups[D] = [self.index.union_mask(ids) for ids in plan.workers if len(ids)]
        return self._groups[D]

    def calls(self, data_parallel: int, block: int | None) -> list[Calls]:
        """Each non-idle group's :class:`Calls` at ``block`` (None: nodes uncut)."""
        out = []
        for mask in self.groups(data_parallel):
            lengths, counts = cut(self.index.seg[mask], block)
            out.append(Calls(lengths, counts, int(self._attention[mask].sum())))
        return out

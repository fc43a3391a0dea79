"""What one step walks, per data-parallel group: its tree's decoder calls at a block.

The time model (:mod:`dta.planning.timing`) prices a candidate layout on the batch it will
train. :class:`Workload` balances the batch's prefix tree over ``D`` data-parallel groups as
the runtime does (:func:`dta.planning.workers.assign_workers` under the config's FLOP model),
builds each group's own tree (what its ranks walk: ``PrefixTree`` of its sequences) and plans
its calls as the walker does (``dta.walk.Walker.plan``: the tree cut into blocks,
``dta.planning.blocks``, then packed, ``dta.planning.packs``, under the walk's packing, pack
cap and pack cost, the cap by memory policy when none is given). :class:`Calls` holds the
calls' lengths and the attention context Σ (tree position + 1) of the group's tokens (the
tree's: a masked pack's kernel also computes the pairs its mask drops, not counted). The
packs are planned as for a model that takes a tree mask. Integers and numpy only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dta.planning.blocks import cut_blocks
from dta.planning.cost import CostModel
from dta.planning.packs import PackCost, default_cap, plan_packs
from dta.planning.workers import assign_workers
from dta.tree import PrefixTree


@dataclass(frozen=True)
class Calls:
    """One group's decoder calls (their token counts) and its tokens' attention context
    (Σ over them of tree position + 1)."""

    lengths: np.ndarray
    context: int

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def calls(self) -> int:
        return len(self.lengths)

    def rows(self, ranks: int) -> int:
        """Σ over calls of ceil(T / ranks): the rows the most loaded of ``ranks`` ranks
        takes when each call's rows are split evenly (rank r: [r T // C, (r + 1) T // C))."""
        return int(np.sum(-(-self.lengths // int(ranks))))

    def own_pairs(self) -> int:
        """Σ over calls of T (T + 1) / 2: the causal pairs inside each call."""
        return int(np.sum(self.lengths * (self.lengths + 1) // 2))


class Workload:
    """A batch's tree, balanced over data-parallel groups and planned into calls on demand
    (cached). ``walk``: the run's :class:`dta.options.WalkOptions` (its packing, pack_tokens,
    pack_cost and min_shared are read; its policy and block are the candidate's)."""

    def __init__(self, tree: PrefixTree, config, walk):
        missing = [f for f in ("packing", "pack_tokens", "pack_cost", "min_shared")
                   if not hasattr(walk, f)]
        if missing:
            raise ValueError(f"the time model needs the run's walk options "
                             f"(dta.options.WalkOptions), got {type(walk).__name__}")
        self.tree, self.walk = tree, walk
        self.cost = CostModel.from_config(config)
        self.pack_cost = walk.pack_cost or PackCost.from_config(config)
        self.sequence_tokens = int(np.sum(tree.lengths))  # what the step trains
        self._groups: dict[int, list[PrefixTree]] = {}
        self._calls: dict[tuple, list[Calls]] = {}

    def groups(self, data_parallel: int) -> list[PrefixTree]:
        """The non-idle groups' own trees."""
        D = int(data_parallel)
        if D not in self._groups:
            plan = assign_workers(self.tree, D, self.cost)
            self._groups[D] = [PrefixTree([self.tree.sequences[i] for i in ids],
                                          min_shared=self.walk.min_shared)
                               for ids in plan.workers if len(ids)]
        return self._groups[D]

    def calls(self, data_parallel: int, block: int | None, policy: str) -> list[Calls]:
        """Each non-idle group's :class:`Calls` at ``block`` (None: nodes uncut)."""
        key = (int(data_parallel), block or None, policy)
        if key not in self._calls:
            self._calls[key] = [self._plan(g, block, policy) for g in self.groups(key[0])]
        return self._calls[key]

    def _plan(self, tree: PrefixTree, block: int | None, policy: str) -> Calls:
        cut, _ = cut_blocks(tree, block)  # as dta.walk.Walker.plan, at the candidate's block
        pack = self.walk.pack_tokens
        cap = min(pack, block or pack) if pack else min(default_cap(tree, policy),
                                                       block or default_cap(tree, policy))
        plan = plan_packs(cut, self.walk.packing, cap=cap, cost=self.pack_cost)
        start, end = tree.start.astype(np.int64), tree.end.astype(np.int64)
        context = int(np.sum((end * (end + 1) - start * (start + 1)) // 2))
        return Calls(np.asarray([p.tokens for p in plan.packs], dtype=np.int64), context)

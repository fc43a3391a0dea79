"""Expert parallelism's part of a sharding mode: the per-rank expert slices.

With ``train.expert_parallel = E`` (``dta.model.expert_parallel``) rank r holds slice
``r mod E`` of every MoE layer's experts. Each slice's gradient on a rank is the share its
served rows gave; the ranks holding the same slice -- the *expert replicas*
(``ProcessGroups.expert_replicas``, W / E ranks) -- sum it. The dense parameters keep their
mode's rule (a SUM over the world). The global norm counts every expert once: the dense
norm² (the same on every rank) plus the expert-parallel group's sum of its slices' norm².
Whole tensors (a state dict, an export) gather a slice over the group (dim 0).

The slices are one part of a mode (:mod:`.parts`, ``expert=True``: the mode sums their
norm² over the expert-parallel group once): ``replicate`` all-reduces their gradients over
the replicas (:meth:`ExpertPart.reduce`); the sharded modes hold them as flat shards over
the replicas (ZeRO-1 of the slices -- fp32 master pieces and optimizer state split over the
W / E ranks holding the same experts, one reduce-scatter per step); fsdp leaves them out of
its units.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["ExpertPart"]


class ExpertPart:
    def __init__(self, ep, groups):
        self.ep = ep
        self.replicas = groups.expert_replicas if groups is not None else None
        self.replica_count = dist.get_world_size(self.replicas) if self.replicas is not None \
            else 1

    @classmethod
    def of(cls, model, groups) -> "ExpertPart | None":
        from dta.model.expert_parallel import expert_parallel_of

        ep = expert_parallel_of(model)
        return None if ep is None else cls(ep, groups)

    def holds(self, p) -> bool:
        """Whether ``p`` (a model parameter) is an expert slice."""
        return self.ep.is_expert(p)

    def split(self, named: list) -> tuple[list, list]:
        """``(dense, expert slices)`` of ``(name, parameter)`` pairs, in their order."""
        return ([(n, p) for n, p in named if not self.holds(p)],
                [(n, p) for n, p in named if self.holds(p)])

    def reduce(self, grads: list, like: list) -> list:
        """The slices' gradients (``like``: the slices) summed over the expert replicas."""
        from runtime.sharding.common import allreduce_gradients

        if self.replica_count > 1:
            return allreduce_gradients(grads, like, group=self.replicas)
        return grads

    def group_sum(self, value: float, device) -> float:
        """``value`` summed over the expert-parallel group (one collective)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=self.ep.group)
        return float(t[0])

    # ------------------------------------------------ the logical view (checkpoints) --
    def whole_shape(self, p) -> tuple:
        """The whole ``[n, ...]`` shape of the slice ``p``."""
        return (self.ep.slice_of(p)[2], *p.shape[1:])

    def held_box(self, name: str, p, stepped):
        """A replica's slice as its box of the whole tensor (rows ``first..stop`` of dim 0)."""
        from runtime.checkpoints.logical import Held

        first = self.ep.slice_of(p)[0]
        return Held(name, self.whole_shape(p), stepped, offsets=(first,) + (0,) * (p.dim() - 1))

    def held_flat(self, flat) -> list:
        """The slices' flat shards (:meth:`flat`) as flat ranges of the whole tensors: a
        slice is rows ``first..stop`` of dim 0, so its element k is the whole tensor's
        ``first x row + k``."""
        from runtime.checkpoints.logical import Held

        out = []
        for h in flat.held():
            p = flat.params[flat.names.index(h.name)]
            row = math.prod(p.shape[1:])
            out.append(Held(h.name, self.whole_shape(p), h.stepped,
                            start=self.ep.slice_of(p)[0] * row + h.start))
        return out

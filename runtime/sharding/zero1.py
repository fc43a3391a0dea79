"""``zero1``: ZeRO-1 under the walk.

Every rank holds the compute-dtype parameters (gathered once per step, after the update,
and kept for the whole walk) and accumulates its gradients locally in them, over all the
walk's forward/backward calls. After the walk: one reduce-scatter of the gradients (in the
master dtype, fp32 for 16-bit compute), the global norm from the shards, and AdamW on this
rank's slice of fp32 master weights (optimizer state sharded too); then one all-gather of the
updated slices into the compute parameters. The collectives per step do not depend on the
batch's tree (see :mod:`runtime.sharding.flat`).

Expert parallelism (:mod:`runtime.sharding.experts`): the expert slices are flat shards of
their own over the expert replicas (the ranks holding the same slices), the global norm
counting each expert once.
"""
from __future__ import annotations

import math

import torch

from runtime.sharding.base import ShardingMode, register
from runtime.sharding.common import optimizer_bytes
from runtime.sharding.experts import ExpertPart
from runtime.sharding.flat import FlatShards


@register("zero1")
class Zero1(ShardingMode):
    holds_experts = True

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, groups=None,
                 **_):
        self.model, self.group = model, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.experts = ExpertPart.of(model, groups)  # None without expert parallelism
        self.expert_shards = None  # the expert slices' flat shards, over their replicas
        if self.experts is not None:
            named, slices = self.experts.split(named)
            self.expert_shards = self.experts.flat(slices, compute_dtype)
        # frozen weights (a LoRA model's base): no master, no shard, held in the compute dtype
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        with torch.no_grad():
            for p in self.frozen:
                if compute_dtype is not None and p.is_floating_point():
                    p.data = p.data.to(compute_dtype)
        # masters from the parameters as built (fp32), then the compute copy is cast
        self.shards = FlatShards(named, group=group, compute_dtype=compute_dtype)
        self.shards.gather_parameters()  # the compute copy (cast) from the masters
        self.flats = [f for f in (self.shards, self.expert_shards) if f is not None]
        for flat in self.flats[1:]:
            flat.gather_parameters()
        self.optimizer = make_optimizer([mp for f in self.flats for mp in f.master_params])
        self._grad_bytes = 0

    def zero_grad(self) -> None:
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
            flat.zero_master_grads()

    def reduce_gradients(self) -> None:
        self._grad_bytes = sum(f.bytes()["compute_grads"] for f in self.flats)
        for flat in self.flats:
            flat.reduce_gradients()
        self._grad_bytes = max(self._grad_bytes, sum(f.bytes()["grad_shard"] for f in self.flats))

    def _experts_squared(self, value) -> float:
        """The expert slices' Σ² over their replicas, summed over the expert group."""
        if self.expert_shards is None:
            return 0.0
        return self.experts.group_sum(value, self.expert_shards.device)

    def grad_norm(self) -> float:
        experts = self.expert_shards.grad_norm_squared() if self.expert_shards else 0.0
        return math.sqrt(self.shards.grad_norm_squared() + self._experts_squared(experts))

    def scale_gradients(self, coef: float) -> None:
        for flat in self.flats:
            flat.scale_gradients(coef)

    def apply_update(self) -> None:
        self.optimizer.step()
        for flat in self.flats:
            flat.zero_master_grads()
            flat.gather_parameters()

    def discard_gradients(self) -> None:
        for flat in self.flats:
            flat.zero_master_grads()

    def state_bytes(self) -> dict:
        b = [f.bytes() for f in self.flats]
        frozen = sum(p.numel() * p.element_size() for p in self.frozen)
        return {"params": sum(x["compute_params"] + x["master"] for x in b) + frozen,
                "grads": self._grad_bytes, "optimizer": optimizer_bytes(self.optimizer)}

    @torch.no_grad()
    def param_norm(self) -> float:
        local = self.shards.master.double().pow(2).sum()
        dense = float(self.shards._all_reduce(local))
        if self.expert_shards is None:
            return math.sqrt(dense)
        e = self.expert_shards._all_reduce(self.expert_shards.master.double().pow(2).sum())
        return math.sqrt(dense + self._experts_squared(float(e)))

    @torch.no_grad()
    def full_state(self) -> dict:
        """The model's state dict (compute dtype; the masters gathered into it; expert
        slices gathered over their group: a collective)."""
        if self.experts is not None:
            return self.experts.full_state(self.model)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def held(self) -> list:
        return self.shards.held() + (
            self.experts.held_flat(self.expert_shards) if self.expert_shards else [])

    def logical_loaded(self) -> None:
        for flat in self.flats:
            flat.gather_parameters()

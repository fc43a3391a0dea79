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

HSDP (``train.shard_size`` = S < W, :mod:`.hsdp`): the slices are cut over the S ranks of the
shard group (reduce-scatter, norm and all-gather inside it) and the reduced slices summed
over the replica group once per step. Offload (``train.offload=optimizer``,
:mod:`.offload`): the master slice and the optimizer state live in host memory and AdamW
steps there.
"""
from __future__ import annotations

import math

import torch

from runtime.sharding.base import Sharding, register
from runtime.sharding.common import optimizer_bytes
from runtime.sharding.experts import ExpertPart
from runtime.sharding.flat import FlatShards
from runtime.sharding.hsdp import dense_part, sum_step_over_replicas


@register("zero1")
class Zero1(Sharding):
    holds_experts = True

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, layout=None,
                 groups=None, **_):
        self.model, self.group = model, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.experts = ExpertPart.of(model, groups)  # None without expert parallelism
        slices = []  # the expert slices: flat shards of their own, over their replicas
        if self.experts is not None:
            named, slices = self.experts.split(named)
        # frozen weights (a LoRA model's base): no master, no shard, held in the compute dtype
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        with torch.no_grad():
            for p in self.frozen:
                if compute_dtype is not None and p.is_floating_point():
                    p.data = p.data.to(compute_dtype)
        offload = layout is not None and layout.offload == "optimizer"
        # the parts (hsdp.Part): the dense parameters over the shard group
        self.parts = [dense_part(named, group=group, groups=groups)] + (
            [self.experts.part(slices)] if slices else [])
        # masters from the parameters as built (fp32), then the compute copy is cast
        self.flats = [FlatShards(list(part.named), group=part.shard,
                                 compute_dtype=compute_dtype, offload=offload)
                      for part in self.parts]
        for flat in self.flats:
            flat.gather_parameters()  # the compute copy (cast) from the masters
        self.expert_shards = self.flats[1] if len(self.flats) > 1 else None
        self.optimizer = make_optimizer([mp for f in self.flats for mp in f.master_params])
        self._grad_bytes = 0

    @property
    def shards(self) -> FlatShards:
        """The dense part's flat shards (its checkpoint view is ``zero1``)."""
        return self.flats[0]

    def zero_grad(self) -> None:
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
            flat.zero_master_grads()

    def reduce_gradients(self) -> None:
        held = sum(f.bytes()["compute_grads"] for f in self.flats)
        for flat in self.flats:  # within each part's shard group
            flat.reduce_gradients()
        for part, flat in zip(self.parts, self.flats):  # HSDP: once per step, across
            if part.replicas is not None:
                sum_step_over_replicas(part.replicas, [flat])
        self._grad_bytes = max(held, sum(f.bytes()["grad_shard"] for f in self.flats))

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
        for flat in self.flats:
            flat.step_gradients()
        self.optimizer.step()
        for flat in self.flats:
            flat.zero_master_grads()
            flat.gather_parameters()

    def discard_gradients(self) -> None:
        for flat in self.flats:
            flat.zero_master_grads()

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        for flat in self.flats:
            flat.load_masters(state)

    def masters_loaded(self) -> None:
        for flat in self.flats:
            flat.gather_parameters()

    def state_bytes(self) -> dict:
        bs = [f.bytes() for f in self.flats]
        frozen = sum(p.numel() * p.element_size() for p in self.frozen)
        optimizer = optimizer_bytes(self.optimizer)
        offload = self.shards.offload
        return {"params": sum(b["compute_params"] + b["master"] for b in bs) + frozen,
                "grads": self._grad_bytes, "optimizer": 0 if offload else optimizer,
                "host": sum(b["host"] for b in bs) + (optimizer if offload else 0)}

    @torch.no_grad()
    def param_norm(self) -> float:
        def squared(flat):  # over the flat's group (HSDP's replicas hold the same)
            return float(flat._all_reduce(flat.master.double().pow(2).sum().to(flat.device)))

        experts = squared(self.expert_shards) if self.expert_shards is not None else 0.0
        return math.sqrt(squared(self.shards) + self._experts_squared(experts))

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
        self.masters_loaded()

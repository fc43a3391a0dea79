"""``zero1``: ZeRO-1 under the walk.

Every rank holds the compute-dtype parameters (gathered once per step, after the update,
and kept for the whole walk) and accumulates its gradients locally in them, over all the
walk's forward/backward calls. After the walk: one reduce-scatter of the gradients (in the
master dtype, fp32 for 16-bit compute), the global norm from the shards, and AdamW on this
rank's slice of fp32 master weights (optimizer state sharded too); then one all-gather of the
updated slices into the compute parameters. The collectives per step do not depend on the
batch's tree (see :mod:`runtime.sharding.flat`).
"""
from __future__ import annotations

import math

import torch

from runtime.sharding.base import ShardingMode, register
from runtime.sharding.common import optimizer_bytes
from runtime.sharding.flat import FlatShards


@register("zero1")
class Zero1(ShardingMode):
    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, **_):
        self.model, self.group = model, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # frozen weights (a LoRA model's base): no master, no shard, held in the compute dtype
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        with torch.no_grad():
            for p in self.frozen:
                if compute_dtype is not None and p.is_floating_point():
                    p.data = p.data.to(compute_dtype)
        # masters from the parameters as built (fp32), then the compute copy is cast
        self.shards = FlatShards(named, group=group, compute_dtype=compute_dtype)
        self.shards.gather_parameters()  # the compute copy (cast) from the masters
        self.optimizer = make_optimizer(self.shards.master_params)
        self._grad_bytes = 0

    def zero_grad(self) -> None:
        for p in self.shards.params:
            p.grad = None
        self.shards.zero_master_grads()

    def reduce_gradients(self) -> None:
        self._grad_bytes = self.shards.bytes()["compute_grads"]
        self.shards.reduce_gradients()
        self._grad_bytes = max(self._grad_bytes, self.shards.bytes()["grad_shard"])

    def grad_norm(self) -> float:
        return math.sqrt(self.shards.grad_norm_squared())

    def scale_gradients(self, coef: float) -> None:
        self.shards.scale_gradients(coef)

    def apply_update(self) -> None:
        self.optimizer.step()
        self.shards.zero_master_grads()
        self.shards.gather_parameters()

    def discard_gradients(self) -> None:
        self.shards.zero_master_grads()

    def state_bytes(self) -> dict:
        b = self.shards.bytes()
        frozen = sum(p.numel() * p.element_size() for p in self.frozen)
        return {"params": b["compute_params"] + b["master"] + frozen, "grads": self._grad_bytes,
                "optimizer": optimizer_bytes(self.optimizer)}

    @torch.no_grad()
    def param_norm(self) -> float:
        local = self.shards.master.double().pow(2).sum()
        return math.sqrt(float(self.shards._all_reduce(local)))

    @torch.no_grad()
    def full_state(self) -> dict:
        """The model's state dict (compute dtype; the masters gathered into it)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_masters(self, state: dict) -> None:
        """The flat master slice from whole tensors."""
        self.shards.load_masters(state)

    def sharded_state(self) -> dict:
        """What :func:`runtime.dcp.save_sharded` writes (and loads into, in place)."""
        from torch.distributed.device_mesh import init_device_mesh

        from runtime.sharding.state import FlatShardsState
        if not hasattr(self, "_mesh"):
            self._mesh = init_device_mesh(self.shards.device.type, (self.shards.world,))
        return {"zero1": FlatShardsState(self.shards, self.optimizer, self._mesh)}

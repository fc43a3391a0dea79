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

import torch

from runtime.sharding.base import Sharding, register
from runtime.sharding.hsdp import dense_part
from runtime.sharding.parts import FlatPart, expert_flat_parts, offloaded, split_experts


def flat_parts(model, *, group, groups, compute_dtype, offload) -> tuple[list, object]:
    """zero1's parts: the dense parameters as flat shards over the shard group (HSDP: summed
    over the replicas once per step) and the expert slices as flat shards over their
    replicas; and the model's ``ExpertPart`` (None without expert parallelism)."""
    experts, named, slices = split_experts(
        model, groups, [(n, p) for n, p in model.named_parameters() if p.requires_grad])
    dense = dense_part(named, group=group, groups=groups)
    flat = dict(compute_dtype=compute_dtype, offload=offload)
    parts = [FlatPart(dense.named, group=dense.shard, replicas=dense.replicas, **flat)]
    parts += expert_flat_parts(experts, slices, **flat)
    return parts, experts


def cast_frozen(model, compute_dtype) -> list:
    """Frozen weights (a LoRA model's base): no master, no shard, held in the compute dtype."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    with torch.no_grad():
        for p in frozen:
            if compute_dtype is not None and p.is_floating_point():
                p.data = p.data.to(compute_dtype)
    return frozen


@register("zero1")
class Zero1(Sharding):
    holds_experts = True

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, layout=None,
                 groups=None, **_):
        self.model, self.group = model, group
        self.frozen = cast_frozen(model, compute_dtype)
        # masters from the parameters as built (fp32), then the compute copy is cast
        self.parts, self.experts = flat_parts(
            model, group=group, groups=groups, compute_dtype=compute_dtype,
            offload=offloaded(layout))
        for part in self.parts:
            part.masters_loaded()  # the compute copy (cast) from the masters
        self.optimizer = make_optimizer([s for part in self.parts for s in part.stepped])
        self.device = self.shards.device

    @property
    def flats(self) -> list:
        return [part.flat for part in self.parts]

    @property
    def shards(self):
        """The dense part's flat shards."""
        return self.parts[0].flat

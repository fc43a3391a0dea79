"""``zero2``: ZeRO-2 under the walk -- the parameters resident, the gradients sharded per call.

FSDP2 (:mod:`.fsdp`'s units, its vocabulary and expert parts unchanged) told to keep what it
gathers (``reshard_after_forward=False``, ``set_reshard_after_backward(False)``, PyTorch PR
#124319): the first call of a walk all-gathers every layer once in the compute dtype and the
gathered layers stay for the whole walk (every later call, forward or backward, gathers
nothing); each backward call reduce-scatters its gradients at once into the fp32 gradient
shard (FSDP2's sharded ``.grad``, the sum of the calls), so no rank ever holds more than one
call's layer gradients whole. After the walk the lockstep's end frees the gathered copy
(:meth:`release_gathered`); the update steps the fp32 shards (masters and optimizer state
split over the shard group) and the next walk gathers the updated weights once.

Per rank about 2 P + 16 P / S bytes (bf16 compute: the compute copy, then fp32 master,
gradient shard and AdamW's two states over the S ranks of the shard group), between zero1
(4 P + 16 P / S: its gradients accumulate whole) and fsdp (a layer gathered per call). The
reduce-scatters are per backward call, so the ranks' calls are matched (the lockstep,
``matched_calls``) as fsdp's; HSDP sums the shards across the replicas once per step and
offload steps host copies, as fsdp does.
"""
from __future__ import annotations

from runtime.sharding.base import register
from runtime.sharding.fsdp import FSDP


@register("zero2")
class Zero2(FSDP):
    resident = True

    def forward_steps(self, inner: dict) -> list:
        """A forward's collectives without a forward: the gathers (no-ops once the walk's
        first call gathered every unit; they stay gathered) and the model's own ``inner``
        steps; nothing is freed."""
        steps = [self.decoder.unshard]
        for i, layer in enumerate(self.decoder.layers):
            steps += [layer.unshard, *inner.get(i, ())]
        return steps

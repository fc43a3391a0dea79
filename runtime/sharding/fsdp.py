"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) under the walk.

Layout, applied to the model from outside before the walk:

- every decoder layer is one FSDP unit, the decoder (final norm) the root unit; parameters
  are sharded (fp32, ``Shard(0)`` DTensors), all-gathered per call in the compute dtype and
  freed after the call (``reshard_after_forward``), re-gathered for the backward, and the
  gradients are reduce-scattered per backward in fp32 (``MixedPrecisionPolicy``) and summed
  into the sharded ``.grad`` (divide factor 1: each rank's gradient is already its share of
  the global mean). This is ZeRO-3: no rank ever holds all of the layers' parameters.
- the vocabulary-sized weights (input embedding, LM head) are *not* FSDP's: the walker's
  head accumulates their gradients by hand (``addmm_`` into ``W.grad``, ``index_add_`` into
  the embedding's), outside any module call FSDP could hook. They are flat shards
  (:mod:`.flat`): fp32 master slice and optimizer state per rank, the compute copy gathered
  once per step, their gradients reduce-scattered once per step.
- the ranks walk different trees, so their calls are kept matched by the engine core's
  lockstep (``runtime.engine.lockstep``: dummy one-token calls where a rank has nothing to
  do; ``matched_calls``). Under the walker's retain policy a pack's backward runs long after
  its forward (at its pop): the lockstep's retain protocol matches those backwards, and the
  layout asks the walker for one LM-head flush per pack, so that one backward covers one
  decoder call; :meth:`FSDP.forward_steps` is a forward's gathers without a forward.

Expert parallelism (:mod:`runtime.sharding.experts`): the expert slices are not FSDP's (each
rank holds its own experts whole, their calls exchanged by ``dta.model.expert_parallel``,
their gradients accumulated by the owner's served backward): flat shards over the expert
replicas, like the vocabulary weights over the world; the layers' units ignore them.

The in-backward reduce-scatter sums over the whole world (every rank's gradient is its share,
a context-parallel rank's its part of its group's). The step: the global norm (sharded
grads + vocab shards), the engine's clip, AdamW on the local shards, regather the vocab
weights.

HSDP (``train.shard_size`` = S < W, :mod:`.hsdp`): FSDP2 runs on the shard group's mesh (the
"shard" dimension of HSDP's (replicate, shard) mesh): the per-call all-gathers and
reduce-scatters stay inside the S ranks, and the sharded gradients (layers and vocabulary)
are summed over the replica group **once per step**, in :meth:`FSDP.reduce_gradients`, not
per backward as FSDP2's own HSDP would (the walk makes many backward calls per step). The
engine core matches the ranks' calls within the shard group where every context- and
expert-parallel group lies inside one (``ParallelLayout.lockstep_in_shard``), else over the
world. The expert slices' flat shards are cut over their replicas, not the shard group.

Node residency (``train.node_resident``, S < W: ZeRO++'s hpZ, :mod:`.node_resident`): the
layer shards over the node in the compute dtype, their fp32 masters, AdamW state and
cross-node gradient sum sharded across the replicas (one reduce-scatter and one all-gather
across the nodes per step, whatever the calls); the vocabulary's flat shards over the world.

Prefetch (``train.prefetch=true``, :mod:`.prefetch`): the next layer's all-gather issued
before the current layer computes -- in every forward, and in the backward where the walker's
policy puts it right after its call (recompute) -- by FSDP2's explicit prefetch lists, the
same on every rank (the lockstep matches them as without prefetch).

Offload (``train.offload=optimizer``, :mod:`.offload`): the device keeps the layers' shards
in the compute dtype only (what each call gathers from) and their gradients summed over the
walk's calls in an fp32 gradient shard (:mod:`.layers`); the optimizer steps fp32 host masters
of the layer shards (DTensors with host local tensors, the same placements) and of the
vocabulary slice, with its state on the host. ``train.offload=gradients`` also sums the
calls' layer gradients on the host (:mod:`.layers`), so the device keeps no fp32 state of
the layers.
"""
from __future__ import annotations

import torch.distributed as dist

import runtime.sharding.prefetch as prefetch
from runtime.sharding.base import Sharding, master_dtype_for, register
from runtime.sharding.common import tensor_bytes
from runtime.sharding.hsdp import dense_part, shard_mesh
from runtime.sharding.layers import LayerPart, compact_shards
from runtime.sharding.node_resident import node_resident_layers
from runtime.sharding.offload import host_copy
from runtime.sharding.parts import (
    FlatPart,
    expert_flat_parts,
    offloaded,
    split_experts,
    sums_on_host,
)


@register("fsdp")
class FSDP(Sharding):
    holds_frozen = False  # every weight is trained (its vocabulary shards need gradients)
    matched_calls = True  # every decoder call gathers: the ranks' calls are kept matched
    holds_experts = True
    resident = False  # zero2: the gathered layers kept for the whole walk (runtime.sharding.zero2)

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None,
                 policy: str = "recompute", layout=None, groups=None, **_):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if policy not in ("retain", "recompute"):
            raise ValueError(f"{self.name}: unknown walker policy {policy!r} (retain | "
                             "recompute)")
        self.model, self.policy = model, policy
        device = next(model.parameters()).device
        built = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or built
        if built != master_dtype_for(self.compute_dtype):
            raise ValueError(f"{self.name}: build the model in "
                             f"{master_dtype_for(self.compute_dtype)} (got {built})")
        dense = dense_part([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                           group=group, groups=groups)
        self.group = dense.shard  # the collectives of the sharded state stay inside it
        self.mesh = shard_mesh(dense, device.type)
        offload = offloaded(layout)
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=built)
        decoder = model.get_decoder()
        vocab = self.vocab_params()
        flat = dict(compute_dtype=self.compute_dtype, offload=offload)
        node = layout is not None and layout.node_resident  # hpZ (runtime.sharding.node_resident)
        # node-resident: the vocabulary's flat shards over the world, not replicated per node
        self.vocab_part = FlatPart(vocab, group=groups.world if node else self.group,
                                   replicas=None if node else dense.replicas, **flat)
        # the expert slices (None: no expert parallelism): flat shards over their replicas,
        # not FSDP's
        self.experts, _, slices = split_experts(model, groups, model.named_parameters())
        expert_parts = expert_flat_parts(self.experts, slices, **flat)
        expert_ids = {id(p) for _, p in slices}
        in_decoder = {id(p) for p in decoder.parameters()}
        self.units = []
        for layer in decoder.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp,
                        reshard_after_forward=not self.resident,
                        ignored_params={p for p in layer.parameters() if id(p) in expert_ids}
                        or None)
            self.units.append(layer)
        fully_shard(decoder, mesh=self.mesh, mp_policy=mp,
                    # None: FSDP2's root default (kept gathered after a forward)
                    reshard_after_forward=False if self.resident else None, ignored_params={p for _, p in vocab if id(p) in in_decoder})
        self.units.append(decoder)
        # SUM: the ranks' shares add up (FSDP would average)
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            unit.set_reshard_after_backward(not self.resident)
        # FSDP2's default backward prefetch stays off (it follows the rank's own pending
        # graphs, which differ between ranks); train.prefetch sets explicit, rank-independent
        # lists instead (runtime.sharding.prefetch)
        self.prefetch = bool(layout is not None and layout.prefetch)
        if self.prefetch and self.resident:
            raise ValueError(f"{self.name}: prefetch is fsdp's (this mode gathers each layer "
                             "once per walk)")
        prefetch.configure(self.units[:-1], decoder, policy, self.prefetch)
        vocab_ids = {id(p) for _, p in vocab}
        layers = [(n, p) for n, p in model.named_parameters() if p.requires_grad
                  and id(p) not in vocab_ids and id(p) not in expert_ids]
        summed = built_shards = None
        on_host = sums_on_host(layout)  # offload gradients: the calls' sums on the host
        if node:
            self.layer_part = node_resident_layers(
                layers, units=self.units, compute_dtype=self.compute_dtype, shard=self.group,
                replicas=dense.replicas, world=groups.world, device=device, offload=offload,
                model=model, on_host=on_host)
        elif offload:  # the device keeps compute-dtype shards only (runtime.sharding.layers)
            built_shards = [host_copy(p.to_local()) for _, p in layers]  # the fp32 masters
            summed = compact_shards(self.units, self.compute_dtype,
                                    dist.get_world_size(self.group))
            names = {n for n, _ in layers}
            layers = [(n, p) for n, p in model.named_parameters() if n in names]
        if not node:
            self.layer_part = LayerPart(layers, group=self.group, replicas=dense.replicas,
                                        device=device, offload=offload, summed=summed,
                                        masters=built_shards, on_host=on_host)
        del built_shards
        self.parts = [self.layer_part, self.vocab_part, *expert_parts]
        for part in self.parts[1:]:
            part.masters_loaded()
        self.expert_ids = expert_ids
        self.decoder = decoder
        self.optimizer = make_optimizer([s for part in self.parts for s in part.stepped])
        self._peak_unsharded = 0
        for layer in decoder.layers:
            layer.register_forward_pre_hook(self._sample)
        self.device = device

    # the parts' pieces, by their former names (tests and tools read them)
    names = property(lambda self: self.layer_part.names)
    sharded = property(lambda self: self.layer_part.sharded)
    stepped = property(lambda self: self.layer_part.stepped)
    vocab = property(lambda self: self.vocab_part.flat)
    flats = property(lambda self: [p.flat for p in self.parts[1:]])

    def forward_steps(self, inner: dict) -> list:
        """A forward's collectives without a forward: the root unit gathered (FSDP keeps it
        gathered after a forward), then each layer gathered, its ``inner`` steps, freed."""
        if self.prefetch:  # the next layer's gather before this one's own steps
            return prefetch.forward_steps(self.decoder, self.units[:-1], inner)
        steps = [self.decoder.unshard]
        for i, layer in enumerate(self.decoder.layers):
            steps += [layer.unshard, *inner.get(i, ()), layer.reshard]
        return steps

    def release_gathered(self) -> None:
        """Reshard every unit (the lockstep's end of a walk). FSDP2 keeps the root unit
        gathered after a forward until a backward ends: after a walk whose last call was a
        forward without gradient (a forward-only walk; under HSDP, a shard group that
        trained nothing while the other replicas did), the update or a load would change
        the shards under a stale gathered copy that the next forward would use."""
        for unit in self.units:
            unit.reshard()
        if self.prefetch:
            prefetch.check_consumed(self.units, [f"layer {i}" for i in range(len(self.units) - 1)]
                                    + ["the decoder's root"])

    # ------------------------------------------------------------------ memory --
    def _sample(self, module, args):
        """Bytes of layer parameters currently gathered (after FSDP's pre-forward)."""
        live = sum(tensor_bytes(p) for layer in self.decoder.layers
                   for p in layer.parameters() if not hasattr(p, "to_local")
                   and id(p) not in self.expert_ids)  # the root's final norm: not sampled
        if self.prefetch:  # the next layer's gather, issued (its compute-dtype bytes)
            size = self.compute_dtype.itemsize
            live += sum(p.numel() * size for layer in self.decoder.layers
                        if prefetch.pending(layer) for p in layer.parameters()
                        if hasattr(p, "to_local") and id(p) not in self.expert_ids)
        self._peak_unsharded = max(self._peak_unsharded, live)

    def state_bytes(self) -> dict:
        out = super().state_bytes()
        return {**out, "params": out["params"] + self._peak_unsharded}

    def zero_grad(self) -> None:
        super().zero_grad()
        self._peak_unsharded = 0

    def stepped_param(self, p):
        """What the optimizer steps for the layer shard ``p`` (itself, or its host copy)."""
        return self.stepped[next(i for i, q in enumerate(self.sharded) if q is p)]

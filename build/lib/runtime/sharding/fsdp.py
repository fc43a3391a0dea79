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

Offload (``train.offload=optimizer``, :mod:`.offload`): the layers' fp32 shards stay on the
device (each call gathers from them; FSDP accumulates the per-call gradients in them); the
optimizer steps host copies of them (DTensors with host local tensors, the same placements)
and of the vocabulary slice, with its state on the host.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.sharding.base import Sharding, master_dtype_for, register
from runtime.sharding.common import optimizer_bytes, tensor_bytes
from runtime.sharding.experts import ExpertPart
from runtime.sharding.flat import FlatShards
from runtime.sharding.hsdp import dense_part, shard_mesh, sum_step_over_replicas
from runtime.sharding.offload import host_copy, host_empty, synchronize, to_device, to_host


def _vocab_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    ids = {id(model.get_input_embeddings().weight): None,
           id(model.get_output_embeddings().weight): None}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids and p.requires_grad]


@register("fsdp")
class FSDP(Sharding):
    holds_frozen = False  # every weight is trained (its vocabulary shards need gradients)
    matched_calls = True  # every decoder call gathers: the ranks' calls are kept matched
    holds_experts = True

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None,
                 policy: str = "recompute", layout=None, groups=None, **_):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if policy not in ("retain", "recompute"):
            raise ValueError(f"fsdp: unknown walker policy {policy!r} (retain | recompute)")
        self.model, self.policy = model, policy
        device = next(model.parameters()).device
        built = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or built
        if built != master_dtype_for(self.compute_dtype):
            raise ValueError(f"fsdp: build the model in {master_dtype_for(self.compute_dtype)} "
                             f"(got {built})")
        self.part = dense_part([(n, p) for n, p in model.named_parameters() if p.requires_grad],
                               group=group, groups=groups)
        self.group = self.part.shard  # the collectives of the sharded state stay inside it
        self.world = dist.get_world_size(self.group)
        self.mesh = shard_mesh(self.part, device.type)
        self.offload = layout is not None and layout.offload == "optimizer"
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=built)
        decoder = model.get_decoder()
        vocab = _vocab_params(model)
        self.vocab = FlatShards(vocab, group=self.group, compute_dtype=self.compute_dtype,
                                offload=self.offload)
        self.experts = ExpertPart.of(model, groups)  # None without expert parallelism
        slices = self.experts.split(list(model.named_parameters()))[1] if self.experts else []
        trained = [(n, p) for n, p in slices if p.requires_grad]
        self.expert_shards = None
        if trained:  # over the expert replicas (their part), not FSDP's
            epart = self.experts.part(trained)
            self.expert_shards = FlatShards(list(epart.named), group=epart.shard,
                                            compute_dtype=self.compute_dtype,
                                            offload=self.offload)
        expert_ids = {id(p) for _, p in slices}
        in_decoder = {id(p) for p in decoder.parameters()}
        self.units = []
        for layer in decoder.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, reshard_after_forward=True,
                        ignored_params={p for p in layer.parameters() if id(p) in expert_ids}
                        or None)
            self.units.append(layer)
        fully_shard(decoder, mesh=self.mesh, mp_policy=mp,
                    ignored_params={p for _, p in vocab if id(p) in in_decoder})
        self.units.append(decoder)
        # SUM: the ranks' shares add up (FSDP would average)
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        # No backward prefetch (each unit "prefetches" itself, a no-op): whether FSDP's
        # prefetch all-gathers depends on which of the rank's own graphs are pending, which
        # differs between the ranks and would unmatch their collectives.
        for unit in self.units:
            unit.set_modules_to_backward_prefetch([unit])
        self.flats = [f for f in (self.vocab, self.expert_shards) if f is not None]
        for flat in self.flats:
            flat.gather_parameters()
        vocab_ids = {id(p) for _, p in vocab}
        layers = [(n, p) for n, p in model.named_parameters() if p.requires_grad
                  and id(p) not in vocab_ids and id(p) not in expert_ids]
        self.names = [n for n, _ in layers]
        self.sharded = [p for _, p in layers]
        self.expert_ids = expert_ids
        self.decoder = decoder
        # what the optimizer steps for each layer shard: the shard itself, or its host copy
        self.stepped = [_host_master(p) for p in self.sharded] if self.offload else \
            list(self.sharded)
        self.host_grads = [host_empty(p.to_local().shape, p.dtype) for p in self.sharded] \
            if self.offload else []
        self.optimizer = make_optimizer(self.stepped + [mp for f in self.flats
                                                        for mp in f.master_params])
        self._peak_unsharded = 0
        self._grad_bytes = 0
        for layer in decoder.layers:
            layer.register_forward_pre_hook(self._sample)
        self.device = device

    def forward_steps(self, inner: dict) -> list:
        """A forward's collectives without a forward: the root unit gathered (FSDP keeps it
        gathered after a forward), then each layer gathered, its ``inner`` steps, freed."""
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

    # ------------------------------------------------------------------ memory --
    def _sample(self, module, args):
        """Bytes of layer parameters currently gathered (after FSDP's pre-forward)."""
        live = sum(tensor_bytes(p) for layer in self.decoder.layers
                   for p in layer.parameters() if not hasattr(p, "to_local")
                   and id(p) not in self.expert_ids)
        self._peak_unsharded = max(self._peak_unsharded, live)

    def state_bytes(self) -> dict:
        b = [f.bytes() for f in self.flats]
        shards = sum(tensor_bytes(p) for p in self.sharded)
        flat = sum(x["compute_params"] + x["master"] for x in b)
        optimizer = optimizer_bytes(self.optimizer)
        host = sum(x["host"] for x in b) + (
            optimizer + sum(tensor_bytes(h) for h in self.stepped) +
            sum(tensor_bytes(g) for g in self.host_grads) if self.offload else 0)
        return {"params": shards + flat + self._peak_unsharded, "grads": self._grad_bytes,
                "optimizer": 0 if self.offload else optimizer, "host": host}

    # -------------------------------------------------------------------- step --
    def zero_grad(self) -> None:
        self.discard_gradients()
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
        self._peak_unsharded = 0

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        vb = sum(f.bytes()["compute_grads"] for f in self.flats)
        for flat in self.flats:
            flat.reduce_gradients()
        if self.part.replicas is not None:  # HSDP: the step's one sum across the replicas
            local = [None if p.grad is None else p.grad.to_local() for p in self.sharded]
            summed = sum_step_over_replicas(self.part.replicas, [self.vocab], local,
                                            [p.to_local() for p in self.sharded])
            for p, had, g in zip(self.sharded, local, summed):
                if had is None and g is not None:  # only the other replicas had one
                    p.grad = _like(p, g)
        sharded_grads = sum(tensor_bytes(p.grad) for p in self.sharded)
        self._grad_bytes = sharded_grads + vb

    def grad_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.sharded:
            if p.grad is not None:
                local += p.grad.to_local().double().pow(2).sum()
        dist.all_reduce(local, group=self.group)
        return math.sqrt(float(local) + self.vocab.grad_norm_squared() + self._experts_squared(
            self.expert_shards.grad_norm_squared() if self.expert_shards else 0.0))

    def _experts_squared(self, value) -> float:
        """The expert slices' Σ² over their replicas, summed over the expert group."""
        if self.expert_shards is None:
            return 0.0
        return self.experts.group_sum(value, self.device)

    def scale_gradients(self, coef: float) -> None:
        for p in self.sharded:
            if p.grad is not None:
                p.grad.mul_(coef)
        for flat in self.flats:
            flat.scale_gradients(coef)

    @torch.no_grad()
    def apply_update(self) -> None:
        if self.offload:  # the layer shards' gradients to their host copies
            for p, buf in zip(self.sharded, self.host_grads):
                if p.grad is not None:
                    to_host(buf, p.grad.to_local())
            synchronize(self.device)
            for p, h, buf in zip(self.sharded, self.stepped, self.host_grads):
                h.grad = None if p.grad is None else _like(h, buf)
        for flat in self.flats:
            flat.step_gradients()
        self.optimizer.step()
        self.discard_gradients()
        self.masters_loaded()

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.sharded:
            p.grad = None
        for flat in self.flats:
            flat.zero_master_grads()

    # ------------------------------------------------------------ the masters --
    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """The flat shards' master slices from ``state``; offloaded, the host copies from
        the layer shards (which were set from ``state``)."""
        for flat in self.flats:
            flat.load_masters(state)
        for p, h in zip(self.sharded, self.stepped):
            if h is not p:
                h.to_local().copy_(p.to_local())

    @torch.no_grad()
    def masters_loaded(self) -> None:
        """The layer shards from their host copies (offloaded), the flat shards regathered."""
        for p, h in zip(self.sharded, self.stepped):
            if h is not p:
                to_device(p.to_local(), h.to_local())
        for flat in self.flats:
            flat.gather_parameters()

    def held(self) -> list:
        """The layers' DTensor shards (one box each; offloaded: their host copies), the
        vocabulary's flat pieces and the expert slices' flat ranges."""
        from runtime.sharding.logical import held_dtensor

        return [held_dtensor(n, h) for n, h in zip(self.names, self.stepped)] + \
            self.vocab.held() + (
            self.experts.held_flat(self.expert_shards) if self.expert_shards else [])

    def logical_loaded(self) -> None:
        self.masters_loaded()

    def stepped_param(self, p):
        """What the optimizer steps for the layer shard ``p`` (itself, or its host copy)."""
        return self.stepped[next(i for i, q in enumerate(self.sharded) if q is p)]

    # --------------------------------------------------------------- reporting --
    @torch.no_grad()
    def param_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for h in self.stepped:
            local += h.to_local().double().pow(2).sum().to(self.device)
        local += self.vocab.master.double().pow(2).sum().to(self.device)
        dist.all_reduce(local, group=self.group)
        if self.expert_shards is None:
            return math.sqrt(float(local))
        e = self.expert_shards._all_reduce(
            self.expert_shards.master.double().pow(2).sum().to(self.device))
        return math.sqrt(float(local) + self._experts_squared(float(e)))

    @torch.no_grad()
    def full_state(self) -> dict:
        """The whole model's parameters (a collective: call it on every rank)."""
        out = {}
        ep = self.experts.ep if self.experts is not None else None
        for name, p in self.model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else \
                ep.full_tensor(p) if ep is not None and ep.is_expert(p) else p
            out[name] = t.detach().cpu().clone()
        for name, b in self.model.named_buffers():
            out[name] = b.detach().cpu().clone()
        return {k: out[k] for k in self.model.state_dict() if k in out}

def _like(p, local: torch.Tensor):
    """A DTensor of ``p``'s mesh, placements and shape with ``local`` as this rank's part."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _host_master(p) -> torch.nn.Parameter:
    """A host copy of the layer shard ``p`` (a DTensor of the same mesh and placements)."""
    return torch.nn.Parameter(_like(p, host_copy(p.to_local())))

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
- the ranks walk different trees, so their calls are kept matched by
  :mod:`.lockstep` (dummy one-token calls where a rank has nothing to do). Under the
  walker's retain policy a pack's backward runs long after its forward (at its pop): the
  lockstep's retain protocol matches those backwards, and :meth:`FSDP.walk_needs` asks
  the walker for one LM-head flush per pack, so that one backward covers one decoder call.

The in-backward reduce-scatter sums over the whole world (every rank's gradient is its share,
a context-parallel rank's its part of its group's). The step: the global norm (sharded
grads + vocab shards), the engine's clip, AdamW on the local shards, regather the vocab
weights.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.sharding.base import ShardingMode, master_dtype_for, register
from runtime.sharding.common import optimizer_bytes, tensor_bytes
from runtime.sharding.flat import FlatShards
from runtime.sharding.lockstep import Lockstep, LockstepDecoder


def _vocab_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    ids = {id(model.get_input_embeddings().weight): None,
           id(model.get_output_embeddings().weight): None}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids and p.requires_grad]


@register("fsdp")
class FSDP(ShardingMode):
    holds_frozen = False  # every weight is trained (its vocabulary shards need gradients)

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None,
                 policy: str = "recompute"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if policy not in ("retain", "recompute"):
            raise ValueError(f"fsdp: unknown walker policy {policy!r} (retain | recompute)")
        self.model, self.group, self.policy = model, group, policy
        self.world = dist.get_world_size(group)
        device = next(model.parameters()).device
        built = next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or built
        if built != master_dtype_for(self.compute_dtype):
            raise ValueError(f"fsdp: build the model in {master_dtype_for(self.compute_dtype)} "
                             f"(got {built})")
        self.mesh = init_device_mesh(device.type, (self.world,))
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=built)
        decoder = model.get_decoder()
        vocab = _vocab_params(model)
        self.vocab = FlatShards(vocab, group=group, compute_dtype=self.compute_dtype)
        in_decoder = {id(p) for p in decoder.parameters()}
        self.units = []
        for layer in decoder.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, reshard_after_forward=True)
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
        self.vocab.gather_parameters()
        vocab_ids = {id(p) for _, p in vocab}
        self.sharded = [p for p in model.parameters() if p.requires_grad
                        and id(p) not in vocab_ids]
        self.sync = Lockstep(decoder, group, kept_graphs=policy == "retain",
                             units=[decoder, *decoder.layers])
        wrapper = LockstepDecoder(decoder, self.sync)
        model.get_decoder = lambda: wrapper  # what the walker calls; the model is unchanged
        self.optimizer = make_optimizer(self.sharded + self.vocab.master_params)
        self._peak_unsharded = 0
        self._grad_bytes = 0
        for layer in decoder.layers:
            layer.register_forward_pre_hook(self._sample)
        self.device = device

    @classmethod
    def walk_needs(cls, policy: str) -> dict:
        """Under retain one backward must cover one decoder call: the LM head flushed per
        pack (:mod:`.lockstep`)."""
        return {"head_rows": 0} if policy == "retain" else {}

    # ------------------------------------------------------------------ memory --
    def _sample(self, module, args):
        """Bytes of layer parameters currently gathered (after FSDP's pre-forward)."""
        live = sum(tensor_bytes(p) for layer in self.model.get_decoder().inner.layers
                   for p in layer.parameters() if not hasattr(p, "to_local"))
        self._peak_unsharded = max(self._peak_unsharded, live)

    def state_bytes(self) -> dict:
        b = self.vocab.bytes()
        shards = sum(tensor_bytes(p) for p in self.sharded)
        return {"params": shards + b["compute_params"] + b["master"] + self._peak_unsharded,
                "grads": self._grad_bytes, "optimizer": optimizer_bytes(self.optimizer)}

    # -------------------------------------------------------------------- step --
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.vocab.params:
            p.grad = None
        self.vocab.zero_master_grads()
        self._peak_unsharded = 0
        self.sync.begin()

    def reduce_gradients(self) -> None:
        self.sync.end()  # follow the peers' remaining calls; FSDP's reduce-scatters are done
        vb = self.vocab.bytes()["compute_grads"]
        self.vocab.reduce_gradients()
        sharded_grads = sum(tensor_bytes(p.grad) for p in self.sharded)
        self._grad_bytes = sharded_grads + vb

    def grad_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.sharded:
            if p.grad is not None:
                local += p.grad.to_local().double().pow(2).sum()
        dist.all_reduce(local, group=self.group)
        return math.sqrt(float(local) + self.vocab.grad_norm_squared())

    def scale_gradients(self, coef: float) -> None:
        for p in self.sharded:
            if p.grad is not None:
                p.grad.mul_(coef)
        self.vocab.scale_gradients(coef)

    def apply_update(self) -> None:
        self.optimizer.step()
        self.discard_gradients()
        self.vocab.gather_parameters()

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.vocab.zero_master_grads()

    def load_masters(self, state: dict) -> None:
        """The vocabulary's flat master slice from whole tensors (the layers' DTensor
        shards are their own masters)."""
        self.vocab.load_masters(state)

    def sharded_state(self) -> dict:
        """What :func:`runtime.dcp.save_sharded` writes (and loads into, in place)."""
        from runtime.sharding.state import DTensorParamsState, FlatShardsState

        vocab_ids = {id(p) for p in self.vocab.params}
        named = [(n, p) for n, p in self.model.named_parameters()
                 if p.requires_grad and id(p) not in vocab_ids]
        return {"fsdp": DTensorParamsState(named, self.optimizer),
                "vocab": FlatShardsState(self.vocab, self.optimizer, self.mesh)}

    # --------------------------------------------------------------- reporting --
    @torch.no_grad()
    def param_norm(self) -> float:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.sharded:
            local += p.to_local().double().pow(2).sum()
        local += self.vocab.master.double().pow(2).sum()
        dist.all_reduce(local, group=self.group)
        return math.sqrt(float(local))

    @torch.no_grad()
    def full_state(self) -> dict:
        """The whole model's parameters (a collective: call it on every rank)."""
        out = {}
        for name, p in self.model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = t.detach().cpu().clone()
        for name, b in self.model.named_buffers():
            out[name] = b.detach().cpu().clone()
        return {k: out[k] for k in self.model.state_dict() if k in out}

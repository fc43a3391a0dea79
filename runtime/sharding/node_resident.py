"""fsdp's node-resident gathers (``train.node_resident``, ZeRO++'s hpZ): the layers' part.

Under HSDP (``train.shard_size`` = S < W, the node) plain fsdp already gathers and
reduce-scatters inside the node per call; what still crosses the nodes is the step's sum of
the fp32 layer shards over the replicas and every rank keeping the fp32 masters and AdamW's
state of its whole node shard (1/S of the layers, replicated W/S times). Node residency
shards those too, across the replicas, so that nothing the node needs per call lives outside
it and nothing per call leaves it:

- the device keeps the node's **secondary partition**: FSDP2's ``Shard(0)`` layer shards
  over the node in the compute dtype (:func:`~runtime.sharding.layers.compact_shards`),
  what every call of the walk all-gathers from -- inside the node;
- each backward call reduce-scatters inside the node into the node shard's **fp32 gradient
  sum** (compact_shards' accumulator: the calls summed in fp32);
- at the step, once: the node shard's fp32 gradient **reduce-scattered across the
  replicas** (:class:`NodeFlat`: flat shards over the replica group whose "parameters" are
  this rank's node shards) -- each rank keeps 1/R of its node shard, 1/W of the layers --;
  the global norm and the clip on those slices; AdamW on this rank's **fp32 master slice**
  (masters and optimizer state over all W ranks; ``train.offload=optimizer``: on the host,
  as :mod:`.flat`'s); the updated slices **all-gathered across the replicas** back into the
  node's compute-dtype shards, which the next step's calls gather from.

Bytes across the nodes per step are therefore a property of the model, not of the walk: one
reduce-scatter (master dtype) and one all-gather (compute dtype) of the node shard over the
replicas, and the vocabulary's flat shards (over the world here, :mod:`.fsdp`) -- whatever
the number of calls (``experiments/bench_hsdp.py`` counts them). This is what
``dta.planning.state`` / ``dta.planning.timing`` price for ``node_resident``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.sharding.common import tensor_bytes
from runtime.sharding.flat import FlatShards
from runtime.sharding.layers import LayerPart, _like, _rows, sum_on_host
from runtime.sharding.offload import host_empty

__all__ = ["NodeFlat", "NodeResidentPart"]


class NodeFlat(FlatShards):
    """Flat shards over ``group`` (the replicas) of this rank's node shards (``named``: the
    fp32 local tensors of FSDP2's shards as built, whose values start the masters). The
    gradients it reduces are handed in (:attr:`grads`: the node shards' fp32 sums), and its
    gather writes the compute dtype into :attr:`params`, re-pointed at FSDP2's
    compute-dtype local shards by the part (:meth:`NodeResidentPart.targets`)."""

    grads: list

    def __init__(self, named, *, group, compute_dtype, offload):
        super().__init__(named, group=group, compute_dtype=compute_dtype, offload=offload)
        self.grads = [None] * len(self.params)

    def gradients(self) -> list:
        return list(self.grads)

    def release_gradients(self) -> None:
        self.grads = [None] * len(self.params)


class NodeResidentPart(LayerPart):
    """The layers under node residency (module doc). ``named``: ``(name, FSDP2 shard)``
    in the compute dtype (after compact_shards); ``summed``: the units' fp32 gradient
    accumulators; ``flat``: the :class:`NodeFlat` built on the fp32 shards before they were
    cast; ``world``: the group the norms are summed over (every rank holds a disjoint slice)."""

    def __init__(self, named, *, flat: NodeFlat, summed, group, world, device,
                 on_host: bool = False):
        super().__init__(named, group=group, replicas=None, device=device, offload=False,
                         summed=summed)
        self.flat, self.world = flat, world
        self.offload = flat.offload
        # offload gradients: the node shard's calls summed on the host (its flat reduction
        # takes them up bucket by bucket), beside the W-slice's host gradient buffer
        self.host_sums = [host_empty(p.to_local().shape, flat.master_dtype)
                          for p in self.sharded] if on_host else []
        if on_host:
            sum_on_host(summed, self.sharded, self.host_sums)
        self.stepped = flat.master_params
        self._peak = 0
        self.targets()

    def targets(self) -> None:
        """Point the flat shards' parameters at FSDP2's local compute-dtype shards (where
        its gathers read; FSDP2 re-registers them when their dtype changes)."""
        self.flat.params = [p.to_local() for p in self.sharded]

    # ------------------------------------------------------------------ the step --
    def reduce(self) -> None:
        """The node shards' fp32 sums reduce-scattered across the replicas (once a step)."""
        grads = self._grads()
        node = 0 if self.host_sums else sum(tensor_bytes(g) for g in grads)
        self.flat.grads = list(grads)
        self.flat.reduce_gradients()
        for acc in self.summed:
            acc.buf = None
        self.local = None
        self._peak = node + tensor_bytes(self.flat.grad_shard)

    def held_gradients(self) -> int:
        return self._peak

    def gradients(self) -> list:
        """The reduced fp32 gradients as DTensors of the node mesh (None: no gradient): the
        slices all-gathered across the replicas (a collective; tools and tests read it)."""
        from dta.model.collectives import all_gather_single

        f = self.flat
        mine = torch.zeros(f.chunk, dtype=f.master_dtype, device=self.device)
        mine[: f.hi - f.lo].copy_(f.grad_shard)
        full = torch.empty(f.chunk * f.world, dtype=f.master_dtype, device=self.device)
        if f.world > 1:
            all_gather_single(full, mine, group=f.group)
        else:
            full = mine
        has = f.has_gradient()
        return [_like(p, full[a:a + n].view(p.to_local().shape).clone()) if has[i] else None
                for i, (p, a, n) in enumerate(zip(self.sharded, f.offsets, f.numels))]

    def _world_sum(self, value: torch.Tensor) -> float:
        dist.all_reduce(value, group=self.world)
        return float(value)

    def grad_squared(self) -> float:
        return self._world_sum(self.flat.grad_shard.double().pow(2).sum().to(self.device))

    @torch.no_grad()
    def param_squared(self) -> float:
        return self._world_sum(self.flat.master.double().pow(2).sum().to(self.device))

    def scale(self, coef: float) -> None:
        self.flat.scale_gradients(coef)

    def to_optimizer(self) -> None:
        self.flat.step_gradients()

    def discard(self) -> None:
        for p in self.sharded:
            p.grad = None
        for acc in self.summed:
            acc.buf = None
        self.local = None
        self.flat.release_gradients()
        self.flat.zero_master_grads()

    # ------------------------------------------------------------ the masters --
    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """This rank's master slice from whole tensors: its node shard's rows of each."""
        self.targets()
        local = {}
        for n, p in zip(self.names, self.sharded):
            if n in state:
                first, stop = _rows(p)
                row = math.prod(p.shape[1:])
                local[n] = state[n].detach().reshape(-1)[first * row:stop * row]
        self.flat.load_masters(local)

    @torch.no_grad()
    def masters_loaded(self) -> None:
        """The node's compute-dtype shards all-gathered across the replicas from the masters."""
        self.targets()
        self.flat.gather_parameters()

    # ----------------------------------------------------------------- reporting --
    def held(self) -> list:
        """The master slices as flat ranges of the whole parameters: the node shard holds
        rows ``first..stop`` of dim 0, so its element k is the whole tensor's
        ``first x row + k``."""
        from runtime.checkpoints.logical import Held

        by_name = dict(zip(self.names, self.sharded))
        out = []
        for h in self.flat.held():
            p = by_name[h.name]
            row = math.prod(p.shape[1:])
            out.append(Held(h.name, tuple(p.shape), h.stepped, start=_rows(p)[0] * row + h.start))
        return out

    def bytes(self) -> dict:
        b = self.flat.bytes()
        return {"params": sum(tensor_bytes(p.to_local()) for p in self.sharded) + b["master"],
                "host": b["host"] + sum(tensor_bytes(t) for t in self.host_sums)}


def node_resident_layers(layers, *, units, compute_dtype, shard, replicas, world, device,
                         offload, model, on_host: bool = False):
    """fsdp's layers part under node residency: the :class:`NodeFlat` on the fp32 shards as
    built, then the shards cast to the compute dtype with their fp32 gradient sums
    (:func:`~runtime.sharding.layers.compact_shards`)."""
    from runtime.sharding.layers import compact_shards

    flat = NodeFlat([(n, p.to_local()) for n, p in layers], group=replicas,
                    compute_dtype=compute_dtype, offload=offload)
    summed = compact_shards(units, compute_dtype, dist.get_world_size(shard))
    names = {n for n, _ in layers}
    layers = [(n, p) for n, p in model.named_parameters() if n in names]
    return NodeResidentPart(layers, flat=flat, summed=summed, group=shard, world=world,
                            device=device, on_host=on_host)

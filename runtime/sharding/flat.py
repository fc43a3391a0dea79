"""Flat shards: a list of parameters laid end to end, each rank owning one contiguous slice.

The ``N`` elements of the parameters (in a fixed order) are cut into ``W`` chunks of
``S = ceil(N / W)`` (the last one shorter, as ``torch.chunk`` and a ``Shard(0)`` DTensor
cut them). Rank ``r`` owns ``[r S, min((r + 1) S, N))`` and keeps, for its slice only:

- the master weights (``master_dtype``, fp32 for 16-bit compute) as one flat buffer, and one
  ``nn.Parameter`` *view* of it per parameter piece, which is what the optimizer steps —
  so AdamW (per-element arithmetic) updates each piece exactly as it would update the
  whole parameter, and a parameter without a gradient on every rank is skipped as torch
  skips it;
- the reduced gradient of the slice, in the reduction dtype (= master dtype).

A step's communication (:meth:`FlatShards.reduce_gradients`, ``grad_norm_squared``,
``gather_parameters``) is a fixed set of collectives,
whatever the walk did: an all-reduce of which parameters have a gradient, a reduce-scatter
of the gradients, an all-reduce of the squared norm, and an all-gather of the updated
weights back into the compute-dtype parameters.

HSDP (:mod:`.hsdp`): ``group`` is the shard group (W above is its size); the mode sums the
reduced slice and the presence counts over the replica group once per step
(:func:`runtime.sharding.hsdp.sum_over_replicas`) before the norm. Offload
(:mod:`.offload`): the master slice (and the optimizer state the optimizer creates like it)
lives in host memory; the reduced slice stays on the device for the norm and the clip and
is copied to a host gradient buffer before the step (:meth:`FlatShards.step_gradients`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dta.model.collectives import all_gather_single, reduce_scatter_single
from runtime.sharding.base import master_dtype_for
from runtime.sharding.offload import host_copy, host_empty, synchronize, to_device, to_host

BUCKET_ELEMS = 1 << 24  # elements per rank in one reduce-scatter bucket


@dataclass(frozen=True)
class Piece:
    index: int  # which parameter
    start: int  # first element of the parameter (flattened) in this slice
    stop: int
    offset: int  # where it lies in this rank's slice


class FlatShards:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], *, group=None,
                 compute_dtype: torch.dtype | None = None, offload: bool = False):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        if not self.params:
            raise ValueError("FlatShards needs at least one parameter")
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        built = self.params[0].dtype
        if any(p.dtype != built for p in self.params):
            raise ValueError("FlatShards needs parameters of one dtype")
        self.compute_dtype = compute_dtype or built
        self.device = self.params[0].device
        # masters: from the parameters as given (build them in fp32 for 16-bit compute)
        self.master_dtype = master_dtype_for(self.compute_dtype)
        if built != self.master_dtype:
            raise ValueError(f"the parameters must be built in the master dtype "
                             f"{self.master_dtype} (got {built}); they are cast to "
                             f"{self.compute_dtype} afterwards")
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        self.chunk = math.ceil(self.total / self.world)
        self.lo = min(self.rank * self.chunk, self.total)
        self.hi = min(self.lo + self.chunk, self.total)
        self.pieces: list[Piece] = []
        for i, (a, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(a, self.lo), min(a + n, self.hi)
            if lo < hi:
                self.pieces.append(Piece(i, lo - a, hi - a, lo - self.lo))
        master = torch.empty(self.hi - self.lo, dtype=self.master_dtype, device=self.device)
        with torch.no_grad():
            for pc in self.pieces:
                src = self.params[pc.index].detach().reshape(-1)[pc.start:pc.stop]
                master[pc.offset:pc.offset + pc.stop - pc.start].copy_(src)
        self.offload = bool(offload)
        # offload: the master slice and its gradient in host memory (the step runs there)
        self.master = host_copy(master) if self.offload else master
        self.host_grad = host_empty(self.master.shape, self.master_dtype) if self.offload \
            else None
        del master
        # The optimizer's parameters: views of the master buffer, one per piece.
        self.master_params = [torch.nn.Parameter(self._piece(self.master, pc))
                              for pc in self.pieces]
        self.grad_shard: torch.Tensor | None = None  # the reduced slice (on the device)
        self.presence: torch.Tensor | None = None  # per parameter: ranks that had a gradient

    def _piece(self, flat: torch.Tensor, pc: Piece) -> torch.Tensor:
        return flat[pc.offset:pc.offset + pc.stop - pc.start]

    # -------------------------------------------------------------- collectives --
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def gradients(self) -> list:
        """The gradients to reduce, by parameter (None: none): the parameters' ``.grad``
        (a subclass may keep them elsewhere: :mod:`.node_resident`)."""
        return [p.grad for p in self.params]

    def release_gradients(self) -> None:
        """After the reduction: drop :meth:`gradients`."""
        for p in self.params:
            p.grad = None

    def _copy_flat(self, dst: torch.Tensor, lo: int, hi: int, grads: list) -> None:
        """dst[:] = the gradients' flat elements [lo, hi) (zeros past N or without grad)."""
        dst.zero_()
        for g, a, n in zip(grads, self.offsets, self.numels):
            s, e = max(a, lo), min(a + n, hi)
            if s < e and g is not None:
                dst[s - lo:e - lo].copy_(g.reshape(-1)[s - a:e - a])

    def reduce_gradients(self, bucket_elems: int = BUCKET_ELEMS) -> None:
        """Reduce-scatter the compute parameters' ``.grad`` into this rank's slice (SUM over
        the shard group, in the master dtype); frees the full gradients. Bucket j carries
        elements [r S + j b, r S + (j + 1) b) of every rank r: the number of reduce-scatters
        is ceil(S / b), a property of the model, never of the walk. Sets ``grad_shard`` (on
        the device) and ``presence`` (per parameter, how many ranks of the group had a
        gradient; HSDP adds the other replicas' before :meth:`step_gradients`)."""
        grads = self.gradients()
        present = torch.tensor([g is not None for g in grads],
                               dtype=self.master_dtype, device=self.device)
        self._all_reduce(present)
        S, W = self.chunk, self.world
        b = max(1, min(int(bucket_elems), S))
        shard = torch.empty(S, dtype=self.master_dtype, device=self.device)
        buf = torch.empty(W, b, dtype=self.master_dtype, device=self.device)
        for j in range(0, S, b):
            width = min(b, S - j)
            send = buf[:, :width]
            for r in range(W):
                self._copy_flat(send[r], r * S + j, r * S + j + width, grads)
            if W > 1:
                reduce_scatter_single(shard[j:j + width], send.contiguous().view(-1),
                                           op=dist.ReduceOp.SUM, group=self.group)
            else:
                shard[j:j + width].copy_(send[0])
        del buf, grads
        self.release_gradients()
        self.grad_shard = shard[: self.hi - self.lo]
        self.presence = present

    def has_gradient(self) -> list[bool]:
        """Which parameters had a gradient on some rank (after the reduction)."""
        return [bool(x > 0) for x in self.presence.tolist()]

    def step_gradients(self) -> None:
        """Hand the reduced (clipped) slice to the optimizer's pieces: views of it, or --
        offloaded -- of its host copy (one device -> host copy, synchronized). A parameter
        without a gradient on every rank gets none (the optimizer skips it, as torch's)."""
        grad = self.grad_shard
        if self.offload:
            to_host(self.host_grad, grad)
            synchronize(grad.device)
            grad = self.host_grad
        has = self.has_gradient()
        for mp, pc in zip(self.master_params, self.pieces):
            mp.grad = self._piece(grad, pc) if has[pc.index] else None

    def grad_norm_squared(self) -> float:
        """Σ g² over the reduced slice, summed over the shard group (a float on every rank;
        the replicas hold the same slices). Parameters without a gradient are zeros there."""
        local = self.grad_shard.double().pow(2).sum()
        return float(self._all_reduce(local))

    def scale_gradients(self, coef: float) -> None:
        self.grad_shard.mul_(coef)

    def zero_master_grads(self) -> None:
        for mp in self.master_params:
            mp.grad = None
        self.grad_shard = None
        self.presence = None

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather the master slices into the compute-dtype parameters."""
        full = torch.empty(self.chunk * self.world, dtype=self.compute_dtype, device=self.device)
        mine = torch.zeros(self.chunk, dtype=self.compute_dtype, device=self.device)
        to_device(mine[: self.hi - self.lo], self.master)
        if self.world > 1:
            all_gather_single(full, mine, group=self.group)
        else:
            full = mine
        for p, a, n in zip(self.params, self.offsets, self.numels):
            if p.dtype != self.compute_dtype:  # the first gather casts the built params
                p.data = torch.empty_like(p, dtype=self.compute_dtype)
            p.data.copy_(full[a:a + n].view_as(p))

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """This rank's master slice from whole tensors (``state`` by parameter name; those
        absent: from the compute parameters); the compute copy is not regathered."""
        for pc in self.pieces:
            name = self.names[pc.index]
            src = state[name] if name in state else self.params[pc.index]
            src = src.detach().reshape(-1)[pc.start:pc.stop]
            self._piece(self.master, pc).copy_(src.to(device=self.master.device,
                                                      dtype=self.master.dtype))

    # --------------------------------------------------------------- reporting --
    def bytes(self) -> dict:
        """Bytes this rank holds: full compute params and grads, master slice (on the
        device; 0 when offloaded), its reduced grad (device), and ``host``: the offloaded
        master slice and its gradient buffer."""
        compute = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params
                    if p.grad is not None)
        master = self.master.numel() * self.master.element_size()
        gshard = 0 if self.grad_shard is None else \
            self.grad_shard.numel() * self.grad_shard.element_size()
        host = 2 * master if self.offload else 0
        return {"compute_params": compute, "compute_grads": grads,
                "master": 0 if self.offload else master, "grad_shard": gshard, "host": host}

    def held(self) -> list:
        """This rank's pieces for the logical view (:mod:`.logical`): per piece, the flat
        range of its parameter and the master view the optimizer steps."""
        from runtime.checkpoints.logical import Held

        return [Held(self.names[pc.index], tuple(self.params[pc.index].shape), mp,
                     start=pc.start) for mp, pc in zip(self.master_params, self.pieces)]

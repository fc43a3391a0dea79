"""The decoder layers as FSDP2 shards: fsdp's and zero2's :class:`LayerPart` (:mod:`.parts`).

Kept two ways:

- **fp32 shards** (the default): FSDP2's ``Shard(0)`` DTensors in the master dtype are the
  masters -- what the optimizer steps -- and where FSDP2 sums the walk's per-call gradients
  (FSDP2 accumulates a parameter's gradient in the parameter's dtype);
- **compute-dtype shards** (``train.offload=optimizer``: :func:`compact_shards`): the
  device keeps only the compute dtype's shards (what each call gathers from; half of the fp32
  shards' bytes under bf16), the fp32 masters and the optimizer state live on the host, and
  the gradients are summed over the walk's calls in an **fp32 gradient shard on the device**:
  each unit's reduce-scatter output (fp32, FSDP2's ``reduce_dtype``) is added to it by
  FSDP2's all-reduce hook (``set_all_reduce_hook``) before FSDP2 casts it to the shard's
  dtype, and the 16-bit gradient FSDP2 then makes is dropped (a post-accumulate-grad hook),
  so no call's gradient is ever summed in 16 bits. The step copies the fp32 shard to the
  host, steps the fp32 masters there and copies them back, cast, into the shards;
- **compute-dtype shards, the gradient sum on the host** (``train.offload=gradients``): as
  above, but each call's reduce-scatter output is copied device -> host and added there,
  into the host gradient buffers the optimizer reads (:meth:`_Summed.sum_into`): the device
  keeps no fp32 state of the layers. The same additions in the same order as on the device,
  so the same values; the copy and the add wait for the call (not overlapped: the planner
  prices them so, ``dta.planning.timing``).

Either way the part is reduced per call by FSDP2 and summed over HSDP's replicas once per
step by the mode.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.sharding.common import tensor_bytes
from runtime.sharding.offload import HOST, grads_to_host, host_copy, host_empty, to_device
from runtime.sharding.parts import Part

__all__ = ["LayerPart", "compact_shards", "sum_on_host"]


class _Summed:
    """One FSDP2 unit's fp32 gradient shard: the sum of its reduce-scatter outputs (FSDP2's
    flat layout: per parameter, in the unit's order, its padded ``Shard(0)`` chunk --
    ``ceil(rows / S)`` rows -- of which the first ``to_local().numel()`` elements are this
    rank's shard)."""

    def __init__(self, params: list, ranks: int):
        self.params = params
        self.spans, at = [], 0
        for p in params:
            self.spans.append((at, p.to_local().shape))
            at += math.ceil(p.shape[0] / ranks) * math.prod(p.shape[1:])
        self.total, self.buf = at, None
        self.into: list | None = None  # host buffers, one per parameter (sum_into)

    def sum_into(self, buffers: list) -> None:
        """Sum on the host, into ``buffers`` (one per parameter, its local shard's shape and
        the master dtype): each call's output is copied there and added (module doc)."""
        if [tuple(b.shape) for b in buffers] != [tuple(shape) for _, shape in self.spans]:
            raise ValueError("the host gradient buffers do not match the unit's shards")
        self.into = list(buffers)

    def __call__(self, out: torch.Tensor) -> None:
        if out.numel() != self.total:
            raise RuntimeError(f"an FSDP2 unit reduced {out.numel()} elements, its fp32 "
                               f"gradient shard expects {self.total} (FSDP2's layout changed)")
        if self.into is not None:  # one device -> host copy, then the adds on the host
            got, first = out.detach().to(HOST), self.buf is None
            for (a, shape), dst in zip(self.spans, self.into):
                piece = got[a:a + math.prod(shape)].view(shape)
                if first:
                    dst.copy_(piece)
                else:
                    dst.add_(piece)
            self.buf = True  # summed this step (the sums are self.into)
        elif self.buf is None:
            self.buf = out.detach().clone()
        else:
            self.buf += out

    def grads(self) -> list:
        if self.buf is None:
            return [None] * len(self.params)
        if self.into is not None:
            return list(self.into)
        return [self.buf[a:a + math.prod(shape)].view(shape) for a, shape in self.spans]


def sum_on_host(summed: list, sharded: list, buffers: list) -> None:
    """Point each unit of ``summed`` at the host ``buffers`` (one per parameter of
    ``sharded``, in its order) to sum its calls into (:meth:`_Summed.sum_into`)."""
    at = {id(p): i for i, p in enumerate(sharded)}
    for acc in summed:
        acc.sum_into([buffers[at[id(p)]] for p in acc.params])


def _drop_grad(p) -> None:
    p.grad = None


def compact_shards(units: list, compute_dtype: torch.dtype, ranks: int) -> list:
    """Cast the FSDP2 units' shards to ``compute_dtype`` and sum their gradients in fp32 (the
    module doc); returns one :class:`_Summed` per unit (in ``units``' order)."""
    from torch.distributed.tensor import DTensor

    def cast(t):
        return t.to(compute_dtype) if isinstance(t, DTensor) and t.is_floating_point() else t

    units[-1]._apply(cast)  # the root: every unit (FSDP2 re-registers the shards)
    owned, summed = set(), []
    for unit in units:  # the layers first: a unit's own shards are those no layer took
        own = [p for p in unit.parameters() if isinstance(p, DTensor) and id(p) not in owned]
        owned |= {id(p) for p in own}
        acc = _Summed(own, ranks)
        unit.set_reduce_scatter_unused_params(True, recurse=False)  # a fixed flat layout
        unit.set_all_reduce_hook(acc)
        for p in own:
            p.register_post_accumulate_grad_hook(_drop_grad)
        summed.append(acc)
    return summed


class LayerPart(Part):
    """The layers' FSDP2 shards (module doc). ``named``: ``(name, shard)``; ``summed``: the
    units' fp32 gradient shards (:func:`compact_shards`) when the shards are in the compute
    dtype, else None; ``masters``: host copies of the fp32 shards as built (their local
    tensors; default: from the shards), what the host masters start from; ``on_host``
    (offload gradients; needs ``summed``): the units sum into the host gradient buffers."""

    def __init__(self, named, *, group, replicas, device, offload, summed=None, masters=None,
                 on_host: bool = False):
        self.names = [n for n, _ in named]
        self.sharded = [p for _, p in named]
        self.group, self.replicas, self.device = group, replicas, device
        self.offload, self.summed = bool(offload), summed
        if self.offload and masters is None:
            masters = [host_copy(p.to_local()) for p in self.sharded]
        self.stepped = [torch.nn.Parameter(_like(p, m)) for p, m in zip(self.sharded, masters)] \
            if self.offload else list(self.sharded)
        self.host_grads = [host_empty(m.shape, m.dtype) for m in masters] \
            if self.offload else []
        order = {id(p): i for i, p in enumerate(self.sharded)}
        self._order = None if summed is None else [
            order[id(p)] for acc in summed for p in acc.params]
        self.on_host = bool(on_host)
        if self.on_host:
            if summed is None or not self.offload:
                raise ValueError("the layers' gradient sum goes on the host only with "
                                 "offloaded compute-dtype shards")
            sum_on_host(summed, self.sharded, self.host_grads)
        self.local: list | None = None  # compute-dtype shards: the fp32 gradients this step

    def _grads(self) -> list:
        """This rank's fp32 gradient shards, by parameter (None: no gradient)."""
        if self.summed is None:
            return [None if p.grad is None else p.grad.to_local() for p in self.sharded]
        if self.local is None:
            flat = [g for acc in self.summed for g in acc.grads()]
            self.local = [None] * len(self.sharded)
            for i, g in zip(self._order, flat):
                self.local[i] = g
        return self.local

    def gradients(self) -> list:
        """The reduced fp32 gradients as DTensors of the shards' mesh (None: no gradient),
        by parameter: what tools and tests read, either way the shards are kept."""
        return [None if g is None else _like(p, g) for p, g in zip(self.sharded, self._grads())]

    def zero_grad(self) -> None:
        self.discard()

    def replica_terms(self):
        return [], list(self._grads()), [p.to_local() for p in self.sharded]

    def replica_summed(self, grads: list) -> None:
        if self.on_host:  # summed in place; one only the other replicas had: into its buffer
            self.local = [g if g is None or g is b else b.copy_(g)
                          for g, b in zip(grads, self.host_grads)]
            return
        if self.summed is not None:
            self.local = list(grads)
            return
        for p, g in zip(self.sharded, grads):
            if p.grad is None and g is not None:  # only the other replicas had one
                p.grad = _like(p, g)

    def held_gradients(self) -> int:
        """Device bytes of its gradients (on the host: none; :meth:`bytes` counts them)."""
        return 0 if self.on_host else sum(tensor_bytes(g) for g in self._grads())

    def grad_squared(self) -> float:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in self._grads():
            if g is not None:
                local += g.double().pow(2).sum().to(self.device)
        dist.all_reduce(local, group=self.group)
        return float(local)

    @torch.no_grad()
    def param_squared(self) -> float:
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for h in self.stepped:
            local += h.to_local().double().pow(2).sum().to(self.device)
        dist.all_reduce(local, group=self.group)
        return float(local)

    def scale(self, coef: float) -> None:
        for g in self._grads():
            if g is not None:
                g.mul_(coef)

    @torch.no_grad()
    def to_optimizer(self) -> None:
        if not self.offload:
            return
        # the fp32 gradient shards to the host (on_host: they are there, in host_grads)
        grads = self._grads() if self.on_host else \
            grads_to_host(self._grads(), self.host_grads, self.device)
        for h, g in zip(self.stepped, grads):
            h.grad = None if g is None else _like(h, g)

    def discard(self) -> None:
        for p, h in zip(self.sharded, self.stepped):
            p.grad = None
            h.grad = None
        for acc in self.summed or ():
            acc.buf = None
        self.local = None

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """Offloaded: the host masters from the layer shards (set from ``state``; in the
        compute dtype: from ``state`` itself, where it holds the parameter)."""
        for n, p, h in zip(self.names, self.sharded, self.stepped):
            if h is p:
                continue
            if self.summed is not None and n in state:
                rows = _rows(p)
                h.to_local().copy_(state[n].detach()[rows[0]:rows[1]].to(h.dtype))
            else:
                h.to_local().copy_(p.to_local())

    @torch.no_grad()
    def masters_loaded(self) -> None:
        for p, h in zip(self.sharded, self.stepped):
            if h is not p:
                to_device(p.to_local(), h.to_local())

    def held(self) -> list:
        from runtime.checkpoints.logical import held_dtensor

        return [held_dtensor(n, h) for n, h in zip(self.names, self.stepped)]

    def bytes(self) -> dict:
        host = sum(tensor_bytes(h) for h in self.stepped) + sum(
            tensor_bytes(g) for g in self.host_grads) if self.offload else 0
        return {"params": sum(tensor_bytes(p) for p in self.sharded), "host": host}


def _rows(p) -> tuple[int, int]:
    """The rows of the whole parameter this rank's ``Shard(0)`` piece holds."""
    first = p.__create_chunk_list__()[0].offsets[0]
    return first, first + p.to_local().shape[0]


def _like(p, local: torch.Tensor):
    """A DTensor of ``p``'s mesh, placements and shape with ``local`` as this rank's part."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())

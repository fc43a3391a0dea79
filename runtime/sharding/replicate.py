"""``replicate``: every rank holds the whole model, its gradients and the optimizer state;
the gradients are all-reduced (SUM, flat buckets) and every replica steps alike.

Master weights (a mode fact, as zero1 / fsdp keep theirs): a model built in a wider dtype
than the compute dtype (:meth:`Replicate.storage_dtype` with ``masters``, e.g. fp32 under
bf16 compute, AReaL's ``optimizer_dtype``) keeps those weights as masters: the model holds
their cast, the gradients are reduced, clipped and stepped in the masters' dtype, and after
the step the model's ``.grad`` holds the clipped gradients cast back (as FSDP2's parameters
hold theirs). Without ``masters`` the model is built in the compute dtype and stepped as it is.

Expert parallelism (``dta.model.expert_parallel``): each rank holds its slice of every MoE
layer's experts; their gradients are summed over the ranks holding the same slice (the
expert replicas), the dense ones over the world, and the global norm counts each expert
once (:class:`~runtime.sharding.experts.ExpertPart`).

Offload (``train.offload=optimizer``, :mod:`.offload`): the masters -- or, without masters,
host copies of the trained weights in the compute dtype -- and the optimizer state live in
host memory; the gradients are reduced, their norm taken and clipped on the device, copied to
the host, stepped there, and the updated weights copied back into the model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.sharding.base import Sharding, register
from runtime.sharding.common import allreduce_gradients, tensor_bytes
from runtime.sharding.offload import grads_to_host, host_copy, host_empty, to_device
from runtime.sharding.parts import Part, offloaded, split_experts


class ReplicaPart(Part):
    """Parameters every rank of ``group`` holds whole (:mod:`.parts`): their gradients
    all-reduced over it (``experts``: the expert slices, over their replicas). ``masters``:
    keep copies in the built dtype (the model is then cast by the mode); ``offload``: what
    the optimizer steps (the masters, else copies in ``compute_dtype``) on the host."""

    def __init__(self, named, *, group=None, masters=False, offload=False, compute_dtype=None,
                 experts=None):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.group, self.offload = group, bool(offload)
        self.experts, self.expert = experts, experts is not None
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.masters = [torch.nn.Parameter(host_copy(p) if self.offload else p.detach().clone())
                        for p in self.params] if masters else None
        self.host = [torch.nn.Parameter(host_copy(p, compute_dtype)) for p in self.params] \
            if self.offload and not masters else None
        self.stepped = self.masters if masters else self.host if self.host is not None \
            else self.params
        self.host_grads = [host_empty(s.shape, s.dtype) for s in self.stepped] \
            if self.offload else []
        self.reduced: list | None = None  # the reduced gradients, on the device
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for s in self.stepped:
            s.grad = None
        self.reduced = None

    def reduce(self) -> None:
        grads = [p.grad for p in self.params]
        if self.masters is not None:  # reduced in the masters' dtype (fp32 under bf16)
            grads = [None if g is None else g.detach().to(m.dtype)
                     for g, m in zip(grads, self.masters)]
            for p in self.params:
                p.grad = None
        self.grad_bytes = sum(tensor_bytes(g) for g in grads)
        if self.expert:  # over the ranks holding the same slices
            grads = self.experts.reduce(grads, self.params)
        elif self.world > 1 and grads:
            grads = allreduce_gradients(grads, self.params, group=self.group)
        self.reduced = grads
        if self.masters is None:
            for p, g in zip(self.params, grads):
                p.grad = g
        elif not self.offload:
            for m, g in zip(self.masters, grads):
                m.grad = g

    def _grads(self) -> list[torch.Tensor]:
        return [g for g in self.reduced or [] if g is not None]

    def grad_squared(self) -> float:
        return float(sum(g.double().pow(2).sum() for g in self._grads()))

    @torch.no_grad()
    def param_squared(self) -> float:
        return float(sum(s.double().pow(2).sum() for s in self.stepped))

    def scale(self, coef: float) -> None:
        for g in self._grads():
            g.mul_(coef)

    @torch.no_grad()
    def to_optimizer(self) -> None:
        if not self.offload:
            return
        for s, g in zip(self.stepped, grads_to_host(self.reduced, self.host_grads, self.device)):
            s.grad = g

    @torch.no_grad()
    def after_step(self) -> None:
        """The weights from what was stepped; the gradients stay readable (the model holds
        the clipped ones, cast, where masters are kept)."""
        self.masters_loaded()
        if self.masters is not None:
            for g, p in zip(self.reduced, self.params):
                p.grad = None if g is None else g.to(p.dtype)

    def discard(self) -> None:
        self.zero_grad()

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        if self.stepped is self.params:
            return
        for s, name, p in zip(self.stepped, self.names, self.params):
            s.copy_(state[name] if name in state else p)

    @torch.no_grad()
    def masters_loaded(self) -> None:
        if self.stepped is self.params:
            return
        for s, p in zip(self.stepped, self.params):
            to_device(p, s)

    def held(self) -> list:
        """Every parameter whole, as one box at the origin (what it steps); an expert slice
        is its box of the whole tensor."""
        from runtime.checkpoints.logical import Held

        if self.expert:
            return [self.experts.held_box(n, p, s)
                    for n, p, s in zip(self.names, self.params, self.stepped)]
        return [Held(n, tuple(p.shape), s, offsets=(0,) * p.dim())
                for n, p, s in zip(self.names, self.params, self.stepped)]

    def bytes(self) -> dict:
        model = sum(tensor_bytes(p) for p in self.params)
        kept = 0 if self.stepped is self.params else sum(tensor_bytes(s) for s in self.stepped)
        if self.offload:
            return {"params": model, "host": kept + sum(tensor_bytes(g)
                                                        for g in self.host_grads)}
        return {"params": model + kept, "host": 0}


@register("replicate")
class Replicate(Sharding):
    sharded = False
    holds_experts = True

    @classmethod
    def storage_dtype(cls, compute: torch.dtype, masters: torch.dtype | None = None):
        """The compute dtype, or the masters' dtype where masters are asked for."""
        return compute if masters is None else masters

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, groups=None,
                 layout=None, **_):
        self.model, self.group = model, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.experts, dense, slices = split_experts(model, groups, named)  # experts: or None
        built = next(model.parameters()).dtype
        kw = dict(masters=compute_dtype is not None and built != compute_dtype,
                  offload=offloaded(layout),
                  compute_dtype=compute_dtype)
        self.parts = [ReplicaPart(dense, group=group, **kw)] + (
            [ReplicaPart(slices, group=self.experts.replicas, experts=self.experts, **kw)]
            if slices else [])
        if compute_dtype is not None:  # the parameters only (buffers: the engine core's)
            with torch.no_grad():  # the parameter objects stay (the masters map on them)
                for p in self.model.parameters():
                    if p.is_floating_point() and p.dtype != compute_dtype:
                        p.data = p.data.to(compute_dtype)
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        self.optimizer = make_optimizer(self.stepped)
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def _joined(self, attr: str) -> list | None:
        lists = [getattr(part, attr) for part in self.parts]
        return None if any(x is None for x in lists) else [x for xs in lists for x in xs]

    # the parts' lists joined (dense, then the expert slices): checkpoints and tests read them
    names = property(lambda self: self._joined("names"))
    params = property(lambda self: self._joined("params"))
    stepped = property(lambda self: self._joined("stepped"))
    masters = property(lambda self: self._joined("masters"))
    _reduced = property(lambda self: self._joined("reduced"))

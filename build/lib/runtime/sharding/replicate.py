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
from runtime.sharding.common import allreduce_gradients, optimizer_bytes, tensor_bytes
from runtime.sharding.experts import ExpertPart
from runtime.sharding.offload import host_copy, host_empty, synchronize, to_device, to_host


@register("replicate")
class Replicate(Sharding):
    sharded = False
    holds_experts = True

    @classmethod
    def storage_dtype(cls, compute: torch.dtype, masters: torch.dtype | None = None):
        """The compute dtype, or the masters' dtype where masters are asked for."""
        return compute if masters is None else masters

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, groups=None,
                 layout=None,
                 **_):
        self.model, self.group = model, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.experts = ExpertPart.of(model, groups)  # None without expert parallelism
        self.is_expert = [self.experts is not None and self.experts.holds(p) for p in self.params]
        self.offload = layout is not None and layout.offload == "optimizer"
        built = next(model.parameters()).dtype
        self.masters = None  # fp32 (the built dtype) copies of the trained parameters
        if compute_dtype is not None and built != compute_dtype:
            self.masters = [torch.nn.Parameter(host_copy(p) if self.offload else
                                               p.detach().clone()) for p in self.params]
        if compute_dtype is not None:
            self.model.to(compute_dtype)  # the parameter objects stay (the masters map on them)
        self.host = None  # offloaded without masters: host copies in the compute dtype
        if self.offload and self.masters is None:
            self.host = [torch.nn.Parameter(host_copy(p)) for p in self.params]
        self.host_grads = [host_empty(s.shape, s.dtype) for s in self.stepped] \
            if self.offload else []
        self.optimizer = make_optimizer(self.stepped)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._reduced: list | None = None  # the reduced gradients, on the device
        self._grad_bytes = 0

    @property
    def stepped(self) -> list:
        """What the optimizer steps: the masters where kept, host copies when offloaded,
        else the trained parameters."""
        if self.masters is not None:
            return self.masters
        return self.host if self.host is not None else self.params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for s in self.stepped:
            s.grad = None
        self._reduced = None

    def reduce_gradients(self) -> None:
        grads = [p.grad for p in self.params]
        if self.masters is not None:  # reduced in the masters' dtype (fp32 under bf16)
            grads = [None if g is None else g.detach().to(m.dtype)
                     for g, m in zip(grads, self.masters)]
            for p in self.params:
                p.grad = None
        self._grad_bytes = sum(tensor_bytes(g) for g in grads)
        dense_g, expert_g = self._split(grads)
        dense_p, expert_p = self._split(self.params)
        if self.world > 1 and dense_g:
            dense_g = allreduce_gradients(dense_g, dense_p, group=self.group)
        if expert_g:  # over the ranks holding the same slices
            expert_g = self.experts.reduce(expert_g, expert_p)
        grads = self._join(dense_g, expert_g)
        self._reduced = grads
        if self.masters is None:
            for p, g in zip(self.params, grads):
                p.grad = g
        elif not self.offload:
            for m, g in zip(self.masters, grads):
                m.grad = g

    def _split(self, items: list) -> tuple[list, list]:
        """(dense, expert slices) of a list in the order of ``self.params``."""
        return ([x for x, e in zip(items, self.is_expert) if not e],
                [x for x, e in zip(items, self.is_expert) if e])

    def _join(self, dense: list, experts: list) -> list:
        """Inverse of :meth:`_split`."""
        d, e = iter(dense), iter(experts)
        return [next(e) if x else next(d) for x in self.is_expert]

    def _grads(self) -> list[torch.Tensor]:
        return [g for g in self._reduced or [] if g is not None]

    def grad_norm(self) -> float:
        if self.experts is not None:  # dense² + every expert once (the group's slices)
            dense, experts = self._split(self._reduced or [None] * len(self.params))
            return self.experts.norm([g for g in dense if g is not None],
                                     [g for g in experts if g is not None], device=self.device)
        grads = self._grads()  # as torch.nn.utils.clip_grad_norm_ computes it
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def scale_gradients(self, coef: float) -> None:
        for g in self._grads():
            g.mul_(coef)

    @torch.no_grad()
    def apply_update(self) -> None:
        if self.offload:  # the reduced gradients to the host copies' (one synchronization)
            for g, buf in zip(self._reduced, self.host_grads):
                if g is not None:
                    to_host(buf, g)
            synchronize(self.device)
            for s, g, buf in zip(self.stepped, self._reduced, self.host_grads):
                s.grad = None if g is None else buf
        self.optimizer.step()  # the gradients stay (readable after the step)
        self.masters_loaded()
        if self.masters is not None:  # the model holds the masters' cast, and their grads
            for g, p in zip(self._reduced, self.params):
                p.grad = None if g is None else g.to(p.dtype)

    @torch.no_grad()
    def masters_loaded(self) -> None:
        """The model's weights from what the optimizer steps (the masters, the host copies)."""
        if self.stepped is self.params:
            return
        for s, p in zip(self.stepped, self.params):
            to_device(p, s)

    def discard_gradients(self) -> None:
        self.zero_grad()

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """The masters (or host copies) from whole tensors (``state`` by parameter name;
        those absent: from the model's parameters), after the model's weights were set."""
        if self.stepped is self.params:
            return
        for s, name, p in zip(self.stepped, self.names, self.params):
            s.copy_(state[name] if name in state else p)

    def state_bytes(self) -> dict:
        # every weight held (a LoRA model's frozen base too); grads/optimizer: trained only
        model = sum(tensor_bytes(p) for p in self.model.parameters())
        kept = sum(tensor_bytes(s) for s in self.stepped) if self.stepped is not self.params \
            else 0
        optimizer = optimizer_bytes(self.optimizer)
        if self.offload:
            host = kept + optimizer + sum(tensor_bytes(g) for g in self.host_grads)
            return {"params": model, "grads": self._grad_bytes, "optimizer": 0, "host": host}
        return {"params": model + kept, "grads": self._grad_bytes, "optimizer": optimizer,
                "host": 0}

    @torch.no_grad()
    def param_norm(self) -> float:
        if self.experts is not None:
            return self.experts.norm(*self._split(self.stepped), device=self.device)
        return float(sum(p.double().pow(2).sum() for p in self.stepped) ** 0.5)

    def held(self) -> list:
        """Every rank holds every trained parameter whole: what it steps (the masters where
        kept, the host copies offloaded) as one box at the origin; an expert slice is its box
        of the whole tensor."""
        from runtime.sharding.logical import Held

        out = []
        for n, p, s in zip(self.names, self.params, self.stepped):
            if self.experts is not None and self.experts.holds(p):
                out.append(self.experts.held_box(n, p, s))
            else:
                out.append(Held(n, tuple(p.shape), s, offsets=(0,) * p.dim()))
        return out

    def logical_loaded(self) -> None:
        self.masters_loaded()

    @torch.no_grad()
    def full_state(self) -> dict:
        """The model's state dict (expert slices gathered: a collective where divided)."""
        if self.experts is not None:
            return self.experts.full_state(self.model)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

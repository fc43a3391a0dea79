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
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.sharding.base import ShardingMode, register
from runtime.sharding.common import optimizer_bytes, tensor_bytes
from runtime.sharding.experts import ExpertPart


def allreduce_gradients(params, bucket_elems: int = 1 << 24, group=None) -> None:
    """Sum ``.grad`` over the group; a grad that is None on every rank stays None."""
    device = params[0].device
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                           device=device)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket, size = [], 0

    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or size + g.numel() > bucket_elems):
            flush()
        bucket.append(g)
        size += g.numel()
    flush()
    dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
    for p, g, n in zip(params, grads, present.tolist()):
        p.grad = g if n > 0 else None


@register("replicate")
class Replicate(ShardingMode):
    sharded = False
    holds_experts = True

    @classmethod
    def storage_dtype(cls, compute: torch.dtype, masters: torch.dtype | None = None):
        """The compute dtype, or the masters' dtype where masters are asked for."""
        return compute if masters is None else masters

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, groups=None,
                 **_):
        self.model, self.group = model, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.experts = ExpertPart.of(model, groups)  # None without expert parallelism
        self.is_expert = [self.experts is not None and self.experts.holds(p) for p in self.params]
        built = next(model.parameters()).dtype
        self.masters = None  # fp32 (the built dtype) copies of the trained parameters
        if compute_dtype is not None and built != compute_dtype:
            self.masters = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        if compute_dtype is not None:
            self.model.to(compute_dtype)  # the parameter objects stay (the masters map on them)
        self.optimizer = make_optimizer(self.stepped)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._grad_bytes = 0

    @property
    def stepped(self) -> list:
        """What the optimizer steps: the masters where kept, else the trained parameters."""
        return self.masters if self.masters is not None else self.params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.masters is not None:
            for m in self.masters:
                m.grad = None

    def reduce_gradients(self) -> None:
        if self.masters is not None:  # reduced in the masters' dtype (fp32 under bf16)
            for m, p in zip(self.masters, self.params):
                m.grad = None if p.grad is None else p.grad.detach().to(m.dtype)
                p.grad = None
        self._grad_bytes = sum(tensor_bytes(p.grad) for p in self.stepped)
        dense, experts = self._split(self.stepped)
        if self.world > 1 and dense:
            allreduce_gradients(dense, group=self.group)
        if experts:  # over the ranks holding the same slices
            self.experts.reduce(experts)

    def _split(self, params: list) -> tuple[list, list]:
        """(dense, expert slices) of a list in the order of ``self.params``."""
        dense = [p for p, e in zip(params, self.is_expert) if not e]
        return dense, [p for p, e in zip(params, self.is_expert) if e]

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.stepped if p.grad is not None]

    def grad_norm(self) -> float:
        if self.experts is not None:  # dense² + every expert once (the group's slices)
            dense, experts = self._split(self.stepped)
            return self.experts.norm([p.grad for p in dense if p.grad is not None],
                                     [p.grad for p in experts if p.grad is not None])
        grads = self._grads()  # as torch.nn.utils.clip_grad_norm_ computes it
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def scale_gradients(self, coef: float) -> None:
        for g in self._grads():
            g.mul_(coef)

    @torch.no_grad()
    def apply_update(self) -> None:
        self.optimizer.step()  # the gradients stay (readable after the step)
        if self.masters is not None:  # the model holds the masters' cast, and their grads
            self._masters_to_model()
            for m, p in zip(self.masters, self.params):
                p.grad = None if m.grad is None else m.grad.to(p.dtype)

    @torch.no_grad()
    def _masters_to_model(self) -> None:
        for m, p in zip(self.masters or [], self.params):
            p.copy_(m)

    def discard_gradients(self) -> None:
        self.zero_grad()

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """The masters from whole tensors (``state`` by parameter name; those absent: from
        the model's parameters), after the model's weights were replaced."""
        if self.masters is None:
            return
        for m, name, p in zip(self.masters, self.names, self.params):
            m.copy_(state[name] if name in state else p)

    def state_bytes(self) -> dict:
        # every weight held (a LoRA model's frozen base too); grads/optimizer: trained only
        masters = sum(tensor_bytes(m) for m in self.masters or [])
        return {"params": sum(tensor_bytes(p) for p in self.model.parameters()) + masters,
                "grads": self._grad_bytes, "optimizer": optimizer_bytes(self.optimizer)}

    @torch.no_grad()
    def param_norm(self) -> float:
        if self.experts is not None:
            return self.experts.norm(*self._split(self.stepped))
        return float(sum(p.double().pow(2).sum() for p in self.stepped) ** 0.5)

    def held(self) -> list:
        """Every rank holds every trained parameter whole: what it steps (the masters where
        kept) as one box at the origin; an expert slice is its box of the whole tensor."""
        from runtime.sharding.logical import Held

        out = []
        for n, p, s in zip(self.names, self.params, self.stepped):
            if self.experts is not None and self.experts.holds(p):
                out.append(self.experts.held_box(n, p, s))
            else:
                out.append(Held(n, tuple(p.shape), s, offsets=(0,) * p.dim()))
        return out

    def logical_loaded(self) -> None:
        self._masters_to_model()

    @torch.no_grad()
    def full_state(self) -> dict:
        """The model's state dict (expert slices gathered: a collective where divided)."""
        if self.experts is not None:
            return self.experts.full_state(self.model)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

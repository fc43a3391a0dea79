"""``replicate``: every rank holds the whole model, its gradients and the optimizer state;
the gradients are all-reduced (SUM, flat buckets) and every replica steps alike."""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.sharding.base import ShardingMode, register
from runtime.sharding.common import optimizer_bytes, tensor_bytes


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

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, **_):
        self.model, self.group = model, group
        if compute_dtype is not None:
            self.model.to(compute_dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._grad_bytes = 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def local_grad_params(self) -> list:
        return list(self.params)

    def reduce_gradients(self) -> None:
        self._grad_bytes = sum(tensor_bytes(p.grad) for p in self.params)
        if self.world > 1:
            allreduce_gradients(self.params, group=self.group)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def grad_norm(self) -> float:
        grads = self._grads()  # as torch.nn.utils.clip_grad_norm_ computes it
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def scale_gradients(self, coef: float) -> None:
        for g in self._grads():
            g.mul_(coef)

    def apply_update(self) -> None:
        self.optimizer.step()  # the gradients stay (readable after the step)

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict:
        # every weight held (a LoRA model's frozen base too); grads/optimizer: trained only
        return {"params": sum(tensor_bytes(p) for p in self.model.parameters()),
                "grads": self._grad_bytes, "optimizer": optimizer_bytes(self.optimizer)}

    @torch.no_grad()
    def param_norm(self) -> float:
        return float(sum(p.double().pow(2).sum() for p in self.params) ** 0.5)

    def sharded_state(self) -> dict:
        """Replicas hold everything: model and optimizer as plain (replicated) state."""
        return {"model": self.model, "optimizer": self.optimizer}

    @torch.no_grad()
    def full_state(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

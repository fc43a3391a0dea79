"""Small helpers shared by the sharding modes: byte counts, the AdamW/SGD factory."""
from __future__ import annotations

import torch
import torch.distributed as dist


def tensor_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor: what this rank holds
        t = t.to_local()
    return t.numel() * t.element_size()


def fsdp_param_groups(unit) -> list:
    """An FSDP2 unit's parameter groups (FSDP2's internals, read-only): torch 2.13 keeps a
    list, ``_fsdp_param_groups``; torch 2.10 one group or None, ``_fsdp_param_group``."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g for g in (state._fsdp_param_group,) if g is not None]
    return list(groups)


def optimizer_bytes(optimizer) -> int:
    return int(sum(tensor_bytes(v) for st in optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v)))


def optimizer_factory(ocfg):
    """params -> the configured optimizer (AdamW or SGD) over them."""

    def make(params):
        params = list(params)
        if ocfg.name == "sgd":
            return torch.optim.SGD(params, lr=float(ocfg.lr),
                                   weight_decay=float(ocfg.weight_decay))
        return torch.optim.AdamW(params, lr=float(ocfg.lr),
                                 betas=tuple(float(b) for b in ocfg.betas),
                                 eps=float(ocfg.eps), weight_decay=float(ocfg.weight_decay))

    return make


def clip_coefficient(norm: float, max_grad_norm) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(max / (norm + 1e-6), 1)."""
    if not max_grad_norm:
        return 1.0
    return min(float(max_grad_norm) / (norm + 1e-6), 1.0)


def allreduce_gradients(grads: list, like: list, bucket_elems: int = 1 << 24,
                        group=None) -> list:
    """Sum ``grads`` (tensors, None where this rank has none; ``like``: the parameters) over
    the group, in place in flat buckets of one dtype; returns them, None where no rank had
    one."""
    device = like[0].device
    present = torch.tensor([g is not None for g in grads], dtype=torch.float32, device=device)
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, like)]
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
    return [g if n > 0 else None for g, n in zip(grads, present.tolist())]

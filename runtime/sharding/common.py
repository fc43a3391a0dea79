"""Small helpers shared by the sharding modes: byte counts, the AdamW/SGD factory."""
from __future__ import annotations

import torch


def tensor_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor: what this rank holds
        t = t.to_local()
    return t.numel() * t.element_size()


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

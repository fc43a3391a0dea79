"""The optimizer state a checkpoint carries per parameter (:mod:`.logical`): which keys an
optimizer keeps, and its per-parameter state created up front (zeros, step 0: what AdamW's
first step would create), so that a load always has something to write into."""
from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

STATE_KEYS = {"AdamW": ("exp_avg", "exp_avg_sq"), "Adam": ("exp_avg", "exp_avg_sq"),
              "SGD": ()}


def state_keys(optimizer) -> tuple[str, ...]:
    name = type(optimizer).__name__
    if name not in STATE_KEYS:
        raise TypeError(f"sharded checkpoints support {sorted(STATE_KEYS)}, not {name}")
    if name == "SGD" and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return ("momentum_buffer",)
    return STATE_KEYS[name]


def ensure_state(optimizer, params) -> None:
    keys = state_keys(optimizer)
    for p in params:
        st = optimizer.state[p]
        if not st and keys:
            st["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            for k in keys:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)

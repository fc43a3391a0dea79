"""``train.sharding=auto``: the cheapest mode whose memory estimate fits the budget.

Resolved on the driver before any worker starts, from the model config, the worker count,
the first batch's longest path and largest node (:func:`dta.planning.memory.batch_extent`)
and ``train.memory_budget_gib`` (default: the GPU's memory, or this machine's RAM shared by
the workers). Cheapest = least communication: replicate, then zero1, then fsdp (either
memory policy: the estimate prices retain's graphs along the whole path).
"""
from __future__ import annotations

from dta.planning.memory import GIB, MODES, batch_extent, pick_mode


def default_budget_bytes(num_workers: int) -> float:
    try:
        import torch
        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        pass
    import psutil
    return float(psutil.virtual_memory().total) / max(1, int(num_workers))


def resolve(cfg, hf_config, tree=None) -> tuple[str, dict]:
    """(mode, report) for ``cfg`` (whose train.sharding is auto)."""
    W = int(cfg.ray.num_workers)
    budget = cfg.train.memory_budget_gib
    budget = float(budget) * GIB if budget is not None else default_budget_bytes(W)
    path, call = batch_extent(tree) if tree is not None else (0, 0)
    # LoRA: replicate or zero1 (dta.config refuses fsdp with adapters)
    modes = MODES if not int(cfg.model.lora.r) else tuple(m for m in MODES if m != "fsdp")
    mode, rows = pick_mode(hf_config, W, budget, modes=modes, path_tokens=path,
                           call_tokens=call, policy=str(cfg.walker.policy),
                           compute_dtype=str(cfg.model.dtype),
                           logits_chunk=int(cfg.walker.logits_chunk))
    report = {"budget_bytes": int(budget), "path_tokens": path, "call_tokens": call,
              "estimates": [r.as_dict() for r in rows], "chosen": mode}
    if mode is None:
        shown = ", ".join(f"{r.mode} {r.total / GIB:.2f} GiB" for r in rows)
        raise ValueError(f"train.sharding=auto: no mode fits train.memory_budget_gib "
                         f"{budget / GIB:.2f} GiB per worker ({shown})")
    return mode, report

"""``train.sharding=auto`` and ``walker.block_tokens=auto``: what fits the memory budget.

Resolved on the driver before any worker starts, from the model config, the worker count,
the first batch's longest path and largest node (:func:`dta.planning.memory.batch_extent`)
and ``train.memory_budget_gib`` (default: the GPU's memory, or this machine's RAM shared by
the workers) by :func:`dta.planning.memory.plan_memory`: the cheapest mode (least
communication: replicate, then zero1, then fsdp) under the configured walker policy, then the
largest block (``walker.block_tokens=auto``; a given block is priced as it is). With a fixed
mode the budget, when one is set, still chooses an ``auto`` block; with neither an ``auto``
mode nor a budget, an ``auto`` block is the walker's default. The run's walk settings come out
as one :class:`dta.options.WalkOptions` (``dta.config.walk.walk_options``: the one place
``auto`` becomes a block), which the driver hands to every worker unchanged.
"""
from __future__ import annotations

from dta.config.walk import walk_options
from dta.options import AUTO, WalkOptions
from dta.planning.memory import BLOCKS, GIB, MODES, batch_extent, lora_params, plan_memory


def default_budget_bytes(num_workers: int) -> float:
    try:
        import torch
        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        pass
    import psutil
    return float(psutil.virtual_memory().total) / max(1, int(num_workers))


def needs_budget(cfg) -> bool:
    """Whether the memory model decides something: an ``auto`` mode, or an ``auto`` block
    with a budget given."""
    return str(cfg.train.sharding) == "auto" or (
        cfg.walker.block_tokens == AUTO and cfg.train.memory_budget_gib is not None)


def resolve(cfg, hf_config, tree=None) -> tuple[str, WalkOptions, dict]:
    """(mode, the run's walk settings, report) for ``cfg``."""
    W = int(cfg.ray.num_workers)
    auto_mode = str(cfg.train.sharding) == "auto"
    block = cfg.walker.block_tokens
    walk = walk_options(cfg)  # an auto block: the default, unless the memory model chooses
    if not needs_budget(cfg):
        return str(cfg.train.sharding), walk, {}
    budget = cfg.train.memory_budget_gib
    budget = float(budget) * GIB if budget is not None else default_budget_bytes(W)
    path, call = batch_extent(tree) if tree is not None else (0, 0)
    # LoRA: the adapters' state only; replicate or zero1 (dta.config.schema refuses fsdp with adapters)
    lora = cfg.model.lora
    adapters = lora_params(hf_config, int(lora.r), list(lora.target_modules)) if int(lora.r) else 0
    plan = plan_memory(hf_config, W, budget, modes=MODES if auto_mode else (str(cfg.train.sharding),),
                       adapter_params=adapters,
                       path_tokens=path, call_tokens=call, policies=(walk.policy,),
                       blocks=BLOCKS if tree is not None and block == AUTO
                       else (walk.block_tokens,),
                       compute_dtype=str(cfg.model.dtype), logits_chunk=walk.logits_chunk)
    chosen = plan.chosen
    report = {"budget_bytes": int(budget), "usable_bytes": int(plan.budget), "path_tokens": path,
              "call_tokens": call, "estimates": [r.as_dict() for r in plan.tried],
              "chosen": chosen.mode if chosen is not None else None,
              "block_tokens": (chosen.block_tokens or 0) if chosen is not None else None}
    if chosen is None:
        what = "no mode fits" if auto_mode else f"train.sharding={cfg.train.sharding} does not fit"
        raise ValueError(f"train.sharding={cfg.train.sharding}, walker.block_tokens={block}: "
                         f"{what} train.memory_budget_gib ({plan.message()})")
    if block == AUTO:
        walk = walk_options(cfg, resolved_block=chosen.block_tokens or 0)
    return chosen.mode, walk, report

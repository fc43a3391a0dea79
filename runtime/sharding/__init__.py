"""Sharding the training state over the data-parallel ranks, applied from outside the walk.

The walker (``dta.train.accumulate_gradients``) never knows it is distributed: a mode wraps
the model and the optimizer before the walk and does all the communication around it.

- ``replicate`` (:mod:`.replicate`): full replicas, one gradient all-reduce per step;
- ``zero1`` (:mod:`.zero1`): compute parameters gathered once per step, gradients
  accumulated locally, one reduce-scatter per step, fp32 masters and optimizer state sharded;
- ``fsdp`` (:mod:`.fsdp`): FSDP2 ``fully_shard`` (parameters sharded, gathered per call);
- ``auto``: the cheapest of them that fits a memory budget (``dta.planning.memory``).

Every mode has the same small interface: ``model``, ``optimizer``, ``zero_grad()``,
``reduce_and_step(max_grad_norm) -> (grad norm, updated)``, ``state_bytes()``,
``param_norm()``, ``full_state()``, ``walk_options`` (walker options the mode needs) and,
for checkpoints, ``sharded_state()`` /
``load_sharded_state()`` (:mod:`runtime.dcp`).
"""
from __future__ import annotations

import torch

from runtime.sharding.flat import master_dtype_for

MODES = ("replicate", "zero1", "fsdp")


def make_strategy(mode: str, model, make_optimizer, *, group=None,
                  compute_dtype: torch.dtype | None = None, policy: str = "recompute",
                  context_parallel: int = 1):
    """Wrap ``model`` (built in the master dtype) for ``mode``; ``compute_dtype``: the
    dtype the walk runs in (16-bit: fp32 masters are kept and the compute copy is cast);
    ``policy``: the walker's memory policy (fsdp matches the ranks' calls accordingly).
    Pass the strategy's ``walk_options`` (``getattr(s, "walk_options", {})``) to the walker.
    ``context_parallel``: C > 1 when the ranks come in context-parallel groups of C whose
    gradients are identical (fsdp reduces inside the backward: it divides the sum by C;
    replicate and zero1 reduce after the walk, where the group's other ranks drop theirs)."""
    compute_dtype = compute_dtype or next(model.parameters()).dtype
    if mode in ("zero1", "fsdp"):
        # The walker's self-check (dta.selfcheck, cached per model) probes the model with its
        # own walks and forwards; run it here, on the unsharded model and outside the ranks'
        # matched calls, so that the sharded walks find it done.
        from dta.selfcheck import ensure_self_check
        ensure_self_check(model)
        for p in model.parameters():
            p.grad = None
    if mode == "replicate":
        from runtime.sharding.replicate import Replicate
        return Replicate(model.to(compute_dtype), make_optimizer, group=group)
    if mode == "zero1":
        from runtime.sharding.zero1 import Zero1
        return Zero1(model, make_optimizer, group=group, compute_dtype=compute_dtype)
    if mode == "fsdp":
        from runtime.sharding.fsdp import FSDP
        return FSDP(model, make_optimizer, group=group, compute_dtype=compute_dtype,
                    policy=policy, context_parallel=context_parallel)
    raise ValueError(f"unknown sharding mode {mode!r}; choose one of {MODES} (or auto, "
                     "resolved before the workers start)")


__all__ = ["MODES", "make_strategy", "master_dtype_for"]

"""Sharding the training state over the ranks, applied from outside the walk.

The walker (``dta.train.accumulate_gradients``) never knows it is distributed: a mode wraps
the model and the optimizer before the walk and does all the communication around it.

- ``replicate`` (:mod:`.replicate`): full replicas, one gradient all-reduce per step;
- ``zero1`` (:mod:`.zero1`): compute parameters gathered once per step, gradients
  accumulated locally, one reduce-scatter per step, fp32 masters and optimizer state sharded;
- ``zero2`` (:mod:`.zero2`): fsdp's layout with every layer gathered once per walk and kept,
  gradients reduce-scattered per call into the fp32 shard;
- ``fsdp`` (:mod:`.fsdp`): FSDP2 ``fully_shard`` (parameters sharded, gathered per call).

A mode is a list of parts (:mod:`.parts`), one per kind of trained state, and its step loops
over them. zero1, zero2 and fsdp shard within groups of ``train.shard_size`` ranks and replicate across them
(HSDP, :mod:`.hsdp`; fsdp's node residency, ``train.node_resident``, shards its masters
across those groups too: :mod:`.node_resident`); every mode can keep the optimizer's state in host memory
(``train.offload=optimizer``, :mod:`.offload`).

A mode is a registered class behind one interface (:mod:`.base`: ``Sharding``,
``register``; the names are the memory model's, ``dta.planning.memory.SHARDINGS``). Which mode a
run uses -- ``auto`` included -- is decided once, by the engine's layout
(``runtime.engine``), which is also the only caller of a mode's step.
"""
from __future__ import annotations

import torch

from dta.planning.memory import SHARDINGS as PRICED
from runtime.sharding import fsdp, replicate, zero1, zero2  # noqa: F401  (the modes)
from runtime.sharding.base import Sharding, master_dtype_for, register, registered, sharding_class

SHARDINGS = registered()  # the priced modes, each registered once
if SHARDINGS != tuple(PRICED):
    raise ImportError(f"runtime.sharding registers {SHARDINGS}; the memory model prices "
                      f"{tuple(PRICED)}: every priced mode needs a registered class")


def make_sharding(name: str, model, make_optimizer, *, group=None,
              compute_dtype: torch.dtype | None = None, policy: str = "recompute",
              layout=None, groups=None) -> Sharding:
    """The mode ``name`` over ``model`` (built in ``sharding_class(name).storage_dtype``);
    ``compute_dtype``: the dtype the walk runs in (16-bit: fp32 masters are kept and the
    compute copy is cast); ``policy``: the walker's memory policy (fsdp matches the ranks'
    calls accordingly); ``layout`` / ``groups``: the engine's
    :class:`~runtime.engine.layout.ParallelLayout` and its process groups (expert parallel,
    HSDP's shard and replica groups, the offload choice)."""
    cls = sharding_class(name)
    if layout is not None and layout.expert_parallel != 1 and not cls.holds_experts:
        raise NotImplementedError(f"sharding={name}: expert_parallel="
                                  f"{layout.expert_parallel} is not implemented yet")
    compute_dtype = compute_dtype or next(model.parameters()).dtype
    if cls.sharded:
        # The walker's self-check (dta.selfcheck, cached per model) probes the model with its
        # own walks and forwards; run it here, on the unsharded model and outside the ranks'
        # matched calls, so that the sharded walks find it done.
        from dta.selfcheck import ensure_self_check
        ensure_self_check(model)
        for p in model.parameters():
            p.grad = None
    return cls(model, make_optimizer, group=group, compute_dtype=compute_dtype, policy=policy,
               layout=layout, groups=groups)


__all__ = ["SHARDINGS", "Sharding", "make_sharding", "master_dtype_for", "sharding_class", "register"]

"""How a ``DTATrainEngine`` is laid out over its processes: AReaL's allocation translated
into the engine core's :class:`~runtime.engine.ParallelLayout`.

AReaL's backend string ``fsdp:dNcM`` (or an explicit ``ParallelStrategy``) gives the
context-parallel size M (``c``: ranks walking the same trees, their K/V spread over the
group) over the N·M processes running, and its expert-parallel size E (``e``, AReaL's
``expert_parallel_size``: groups of E ranks hold each MoE layer's experts once; AReaL's
``fsdp`` backend refuses ``e`` in its parser, so write e.g. ``archon:d4e2`` or pass the
``ParallelStrategy``); ``actor.dta.sharding`` gives the sharding mode, or --
unset -- what AReaL's ``fsdp:dN`` means: ``fsdp`` over N > 1 data-parallel ranks,
``replicate`` on one (``d1cM``) or for an engine without an optimizer (:func:`layout_of`).
Tensor and pipeline parallelism are refused (:func:`strategy_of`).

The process groups are the core's (``runtime.engine.layout.build_groups``, made once):
AReaL's data-parallel group is the layout's ``data`` group (the world when M = 1), its
model-parallel group the ``context`` group (this rank alone when M = 1), its CPU group the
gloo ``cpu`` group. ``torch.distributed`` itself is initialized here when it is not
(:func:`init_default_group`, as FSDPEngine does), and destroyed by the engine that did.
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from runtime.engine import LayoutError, ParallelLayout

__all__ = ["init_default_group", "layout_of", "strategy_of"]

_REFUSED = ("tensor_parallel_size", "pipeline_parallel_size")
# ParallelLayout field -> how AReaL spells it
SPELLING = {"world": "the processes running (AReaL's allocation)",
            "context_parallel": "the allocation's context-parallel size (fsdp:dNcM: M)",
            "sharding": "actor.dta.sharding", "shard_size": "actor.dta.shard_size",
            "offload": "actor.dta.offload", "node_resident": "actor.dta.node_resident",
            "prefetch": "actor.dta.prefetch",
            "expert_parallel": "the allocation's expert-parallel size (e)"}


def strategy_of(backend, parallel_strategy=None):
    """AReaL's ``ParallelStrategy`` from an explicit one or the ``backend`` string
    (``"fsdp:d2"``); refuses tensor and pipeline parallelism, which the DFS walker does not
    do (expert parallelism, ``e``, is the engine core's: docs/expert-parallel.md). Context
    parallelism (``fsdp:d1c2``) is the walker's: each group of ``c`` ranks walks the same trees
    with their K/V spread over it (docs/context-parallel.md)."""
    strategy = parallel_strategy
    if strategy is None and isinstance(backend, str) and ":" in backend:
        from areal.api.alloc_mode import ModelAllocation

        strategy = ModelAllocation.from_str(backend).parallel
    if strategy is not None:
        for name in _REFUSED:
            if getattr(strategy, name, 1) > 1:
                raise NotImplementedError(
                    f"DTATrainEngine does no tensor or pipeline parallelism; {name}="
                    f"{getattr(strategy, name)} (from {backend or parallel_strategy!r})")
    return strategy


def layout_of(option: str | None, *, world: int, context_parallel: int = 1, rank: int = 0,
              trains: bool = True, data_parallel: int | None = None, where=None,
              expert_parallel: int = 1, shard_size: int | None = None,
              offload: str = "none", node_resident: bool = False,
              prefetch: bool = False) -> ParallelLayout:
    """The engine core's layout of an AReaL engine, derived once: the processes running
    (``world``), the allocation's context-parallel size (and its data-parallel size, when it
    states one: it must be ``world / context_parallel``) and expert-parallel size,
    ``actor.dta.sharding`` (``option``) as given, or unset what AReaL's ``fsdp:dN`` means --
    ``fsdp`` over more than one data-parallel rank, else ``replicate`` (one data-parallel
    rank, or an engine without an optimizer: a reference model is held whole);
    ``actor.dta.shard_size`` (HSDP), ``offload``, ``node_resident`` and ``prefetch`` as
    given. Errors name AReaL's
    keys (``where``: the allocation they came from)."""
    spreads = isinstance(context_parallel, int) and context_parallel > 0 and \
        world % context_parallel == 0 and world // context_parallel > 1
    try:
        layout = ParallelLayout.make(world=world, context_parallel=context_parallel,
                                     sharding=option or ("fsdp" if trains and spreads
                                                         else "replicate"), rank=rank,
                                     expert_parallel=expert_parallel, shard_size=shard_size,
                                     offload=offload, node_resident=node_resident,
                                     prefetch=prefetch, spelling=SPELLING)
    except LayoutError as exc:
        raise ValueError(f"{exc}{f' (from {where!r})' if where else ''}") from None
    if data_parallel not in (None, layout.data_parallel):
        raise ValueError(f"data-parallel size {data_parallel} (from {where!r}) differs from the "
                         f"{world} process(es) running / context-parallel size "
                         f"{context_parallel}")
    if option is not None and layout.sharded and not trains:
        raise ValueError(f"actor.dta.sharding={option} needs an optimizer: an engine with "
                         "optimizer=None is inference only and runs replicated "
                         "(leave actor.dta.sharding unset)")
    return layout


def init_default_group() -> bool:
    """Initialize ``torch.distributed`` if it is not: ``env://`` with the platform's backend
    when ``WORLD_SIZE`` > 1 (as FSDPEngine does), else a one-process group through a file
    store in a fresh temporary directory (nothing listens on a socket). Returns whether it
    initialized the group (then the caller owns it)."""
    if dist.is_initialized():
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from areal.infra.platforms import current_platform

        dist.init_process_group(backend=current_platform.communication_backend)
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="dta-areal-pg-"), "store")
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return True

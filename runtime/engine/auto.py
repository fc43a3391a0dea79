"""``auto``, priced by the memory model: the sharding mode, block and context-parallel size
that fit a budget.

:func:`price` asks :func:`dta.planning.memory.plan_memory` -- the same function, with the
same arguments, as ``dta plan --memory`` -- for the mode x policy x block x context-parallel
size that fits the per-rank budget: with the batch's tree, the fastest by the planner's
modeled step time (its default hardware, its default context-parallel scheme); without one,
the first that fits in the memory order. The context-parallel sizes are priced as the run
gives them (``train.context_parallel``: C, or ``auto``: 1, 2, 4, 8 dividing the world), so
a run picks what ``dta plan --memory --context-parallel C`` picks for the same batch. The
layout knobs of :mod:`dta.planning.state` (expert parallelism, shard groups, offload) are
priced as the caller gives them; their defaults are a run without them (E = 1, the world
as the shard group, no offload). ``runtime.engine.resolve`` is the only caller.
"""
from __future__ import annotations

from dataclasses import dataclass

from dta.options import NO_CUT
from dta.planning.memory import BLOCKS, SHARDINGS, batch_extent, lora_params, plan_memory
from runtime.engine.model import ALL_LINEAR, lora_targets

__all__ = ["Priced", "price", "default_budget_bytes"]

# what "all-linear" adapts in a Llama/Qwen layer, as the memory model prices LoRA
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def default_budget_bytes(num_workers: int) -> float:
    """The GPU's memory, or this machine's RAM shared by ``num_workers``."""
    try:
        import torch
        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        pass
    import psutil
    return float(psutil.virtual_memory().total) / max(1, int(num_workers))


@dataclass(frozen=True)
class Priced:
    sharding: str
    block_tokens: int  # NO_CUT: nodes are not cut
    context_parallel: int
    report: dict
    expert_parallel: int = 1  # E (dta.planning.state)
    shard_size: int | None = None  # S as priced (the world: no shard groups)
    offload: str = "none"  # dta.planning.state.OFFLOADS
    node_resident: bool = False  # fsdp gathers from a node-resident copy (hpZ)
    prefetch: bool = False  # fsdp's next-layer all-gather overlaps the current layer


def price(hf_config, *, world: int, budget_bytes: float, tree, walk, shardings=SHARDINGS,
          context_parallel=(1,), blocks=None, compute_dtype: str,
          lora: tuple[int, list] | None = None, expert_parallel=(1,), shard_size=(None,),
          offload=("none",), node_resident=(False,), prefetch=(False,),
          host_budget_bytes: float | None = None) -> Priced:
    """The planner's choice. ``walk``: the run's walk settings (its policy, logits chunk and
    packing are priced; its block only where ``blocks`` says so). ``blocks``: the blocks to
    try (``NO_CUT`` for none); None: the planner's candidates. ``lora``: (rank,
    target_modules as the front door gives them). ``expert_parallel``, ``shard_size`` (None:
    the world), ``offload``, ``node_resident``, ``prefetch``: the sizes / choices to try
    (``dta.planning.state.layout_choices`` lists what a world allows).
    ``host_budget_bytes``: host memory per rank (None: unbudgeted). Raises ValueError when
    nothing fits, with the planner's message (what misses: device or host memory)."""
    path, call = batch_extent(tree) if tree is not None else (0, 0)
    adapters = 0
    if lora:
        targets = lora_targets(lora[1])
        adapters = lora_params(hf_config, int(lora[0]),
                               LINEAR if targets == ALL_LINEAR else list(targets))
    planner_blocks = BLOCKS if blocks is None else tuple(b or None for b in blocks)
    plan = plan_memory(hf_config, world, budget_bytes, shardings=tuple(shardings),
                       adapter_params=adapters, path_tokens=path, call_tokens=call,
                       policies=(walk.policy,), blocks=planner_blocks,
                       compute_dtype=compute_dtype, logits_chunk=walk.logits_chunk,
                       context_parallel=tuple(context_parallel), tree=tree,
                       walk=walk if tree is not None else None,
                       expert_parallel=tuple(expert_parallel), shard_size=tuple(shard_size),
                       offload=tuple(offload), node_resident=tuple(node_resident),
                       prefetch=tuple(prefetch), host_budget_bytes=host_budget_bytes)
    chosen = plan.chosen
    report = {"budget_bytes": int(budget_bytes), "usable_bytes": int(plan.budget),
              "path_tokens": path, "call_tokens": call, "policy": walk.policy,
              "by": "modeled step time" if tree is not None else "memory order",
              "context_parallel": chosen.context_parallel if chosen is not None else None,
              "priced_context_parallel": list(context_parallel),
              "expert_parallel": chosen.expert_parallel if chosen is not None else None,
              "shard_size": chosen.shard_size if chosen is not None else None,
              "offload": chosen.offload if chosen is not None else None,
              "host_bytes": chosen.host if chosen is not None else None,
              "host_budget_bytes": host_budget_bytes,
              "node_resident": chosen.node_resident if chosen is not None else None,
              "prefetch": chosen.prefetch if chosen is not None else None,
              "priced_expert_parallel": list(expert_parallel),
              "priced_shard_size": [world if s is None else s for s in shard_size],
              "priced_offload": list(offload),
              "estimates": [r.as_dict() for r in plan.tried],
              "chosen": chosen.sharding if chosen is not None else None,
              "block_tokens": (chosen.block_tokens or NO_CUT) if chosen is not None else None,
              "choice": chosen.label() if chosen is not None else None}
    if chosen is None:
        raise ValueError(plan.message())
    return Priced(chosen.sharding, chosen.block_tokens or NO_CUT, chosen.context_parallel, report,
                  chosen.expert_parallel, chosen.shard_size, chosen.offload,
                  chosen.node_resident, chosen.prefetch)


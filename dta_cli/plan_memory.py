"""`dta plan --memory`: the memory and time model's report for a batch (dta.planning.memory,
dta.planning.timing; docs/planning.md): per-rank memory of each sharding mode at the choice,
every candidate layout priced, the fastest that fits ``--budget-gib``."""
from __future__ import annotations

import json
from dataclasses import asdict

HARDWARE = ("peak_tflops", "utilization", "intra_node_gbs", "inter_node_gbs", "gpus_per_node",
            "latency_us", "host_link_gbs", "host_adam_gparams", "host_add_gelems")  # Hardware's fields, a flag each


def _memory_config(name: str):
    """A model config for the memory model: a named shape (dta.planning.shapes.SHAPES), a
    size of dta.model.models, or a config.json."""
    from dta.planning.memory import SHAPES
    if name in SHAPES:
        return SHAPES[name]
    if name.endswith(".json"):
        with open(name, encoding="utf-8") as f:
            return json.load(f)
    from dta.model.models import SIZES, build_config
    if name not in SIZES:
        raise ValueError(f"unknown model {name!r} for --memory; choose from "
                         f"{', '.join(list(SHAPES) + list(SIZES))} or a config.json")
    return build_config("qwen3", name)


def memory_report(args, tree) -> dict:
    from dta.planning.memory import (
        BLOCKS,
        CONTEXT_PARALLEL,
        GIB,
        HEADROOM,
        POLICY_ORDER,
        SHARDINGS,
        ModelShape,
        batch_extent,
        estimate,
        plan_memory,
    )
    from dta.planning.state import GATHERED
    from dta.planning.timing import Hardware

    config = _memory_config(args.model)
    path, node = batch_extent(tree)
    call = min(args.capacity, path) if args.capacity else node
    adapters = 0
    if args.lora_r:
        from dta.planning.memory import lora_params

        adapters = lora_params(config, args.lora_r, [t.strip() for t in
                                                     args.lora_targets.split(",") if t.strip()])
    from dta.planning.lora import LORA_SHARDINGS

    shardings = SHARDINGS if args.sharding == "auto" else (args.sharding,)
    if adapters:
        shardings = tuple(m for m in shardings if m in LORA_SHARDINGS)
        if not shardings:
            raise ValueError(f"--sharding {args.sharding} is not priced with --lora-r; choose "
                             f"one of {LORA_SHARDINGS}")
    budget = None if args.budget_gib is None else args.budget_gib * GIB
    if args.host_budget_gib is not None and not args.host_budget_gib > 0:
        raise ValueError(f"--host-budget-gib must be > 0, got {args.host_budget_gib}")
    host_budget = None if args.host_budget_gib is None else args.host_budget_gib * GIB
    from dta.options import WalkOptions

    if args.block_tokens is not None:  # a walk setting: validated as the walker does
        WalkOptions.make({"block_tokens": "--block-tokens"}, block_tokens=args.block_tokens)
    # the walk the time model plans each group's calls with (packing, pack cap: the defaults)
    walk = WalkOptions.make({"min_shared": "--min-shared"}, min_shared=args.min_shared)
    policies = POLICY_ORDER if args.policy == "auto" else (args.policy,)
    cps = _context_parallel(args.context_parallel, args.workers, CONTEXT_PARALLEL)
    blocks = BLOCKS if args.block_tokens is None else (args.block_tokens or None,)
    hardware = Hardware(**{f: getattr(args, f) for f in HARDWARE if getattr(args, f) is not None})
    shape = ModelShape.of(config)
    layout = _layout(args, shape, hardware, adapters)
    kw = dict(path_tokens=path, call_tokens=call, policies=policies, blocks=blocks,
              compute_dtype=args.compute_dtype, adapter_params=adapters, shardings=shardings,
              headroom=HEADROOM if args.headroom is None else args.headroom,
              context_parallel=cps, cp_schemes=(args.context_parallel_scheme,), **layout)
    limit = float("inf") if budget is None else budget
    plan = plan_memory(config, args.workers, limit, tree=tree, hardware=hardware, walk=walk,
                       host_budget_bytes=host_budget, **kw)
    first = plan_memory(config, args.workers, limit, host_budget_bytes=host_budget,
                        **kw).chosen  # the memory order's pick
    pick = plan.chosen if plan.chosen is not None else plan.cheapest
    if budget is None:  # nothing to choose for: the last policy (recompute), the given block
        shard = layout["shard_size"][0] if shardings[0] != "replicate" else None
        pick = estimate(config, args.workers, shardings[0], path_tokens=path, call_tokens=call,
                        policy=policies[-1], block_tokens=blocks[0] if len(blocks) == 1 else None,
                        compute_dtype=args.compute_dtype, adapter_params=adapters,
                        context_parallel=cps[0], cp_scheme=args.context_parallel_scheme,
                        expert_parallel=layout["expert_parallel"][0], shard_size=shard,
                        offload=layout["offload"][0])
    rows = [estimate(config, args.workers, m, path_tokens=path, call_tokens=call,
                     policy=pick.policy, compute_dtype=args.compute_dtype,
                     block_tokens=pick.block_tokens, adapter_params=adapters,
                     context_parallel=pick.context_parallel, cp_scheme=pick.cp_scheme,
                     expert_parallel=pick.expert_parallel, offload=pick.offload,
                     shard_size=None if m == "replicate" else pick.shard_size,
                     node_resident=pick.node_resident and m in GATHERED,
                     prefetch=pick.prefetch and m in GATHERED)
            for m in shardings]
    for e in [pick, first] + rows:  # their modeled step, on the same batch
        if e is not None and e.time is None:
            plan.pricer.price(e)
    chosen = plan.chosen.sharding if budget is not None and plan.chosen is not None else None
    block = pick.block_tokens
    active = (f" ({shape.active_params / 1e9:.2f}B active, {shape.experts.count} experts, "
              f"top {shape.experts.top_k})" if shape.is_moe else "")
    print(f"memory per rank ({args.model}: {shape.params / 1e9:.2f}B parameters{active}, "
          f"{args.workers} ranks, context parallel {pick.context_parallel} (data parallel "
          f"{pick.data_parallel}), expert parallel {pick.expert_parallel}, shard size "
          f"{pick.shard_size}, offload {pick.offload}, {args.compute_dtype} compute, "
          f"{pick.policy}, block {block or 'none'}; longest path {path:,} tokens, largest call "
          f"{min(call, block) if block else call:,} (largest node {call:,})):")
    print(f"  {'mode':<10} {'params':>9} {'grads':>9} {'optim':>9} {'activ':>9} {'total':>9}"
          f" {'host':>9} {'step':>8}")
    for r in rows:
        mark = "  <- chosen" if r.sharding == chosen else ""
        print(f"  {r.sharding:<10} " + " ".join(f"{v / GIB:>8.2f}G" for v in (
            r.params, r.grads, r.optimizer, r.activations, r.total, r.host)) +
            f" {r.time.step_s:>7.1f}s" + mark)
    split = pick.split
    print("  activations: " + ", ".join(f"{k} {v / GIB:.2f}G" for k, v in split.items()))
    if budget is not None:
        print(f"  budget {args.budget_gib:g} GiB: " + (
            f"sharding={chosen}, policy={pick.policy}, block_tokens={block or 0}, "
            f"context_parallel={pick.context_parallel}, expert_parallel={pick.expert_parallel}, "
            f"shard_size={pick.shard_size}, offload={pick.offload}, "
            f"node_resident={pick.node_resident}, prefetch={pick.prefetch}"
            if chosen else "no mode fits") + f" ({plan.message()})")
    _print_time(plan, pick if chosen else None, first)
    # dta train runs every sharding mode with context_parallel > 1 (fsdp and zero1 shard
    # over the whole world: docs/context-parallel.md)
    runnable = bool(chosen)
    if adapters:
        print(f"  LoRA r={args.lora_r} on {args.lora_targets}: {adapters:,} adapter parameters "
              "(grads and optimizer state; the base is frozen)")
    t = pick.time
    return {"model": args.model, "params": shape.params, "active_params": shape.active_params,
            "routed_params": shape.routed_params, "lora_params": adapters,
            "expert_parallel": pick.expert_parallel, "shard_size": pick.shard_size,
            "offload": pick.offload, "host_bytes": pick.host,
            "node_resident": pick.node_resident, "prefetch": pick.prefetch,
            "step_counter_bytes": pick.steps, "refused": pick.refused,
            "host_budget_bytes": host_budget,
            "compute_share": t.compute_share,
            "path_tokens": path,
            "call_tokens": min(call, block) if block else call, "node_tokens": node,
            "compute_dtype": args.compute_dtype, "policy": pick.policy,
            "block_tokens": block or 0, "activation_split": split, "budget_bytes": budget,
            "context_parallel": pick.context_parallel, "data_parallel": pick.data_parallel,
            "cp_scheme": pick.cp_scheme,
            "usable_bytes": plan.budget if budget is not None else None,
            "chosen": chosen, "choice": pick.label() if chosen else None,
            "rule": plan.rule, "runnable": runnable,
            "shortfall_bytes": int(plan.shortfall) if budget is not None else None,
            "flops_per_rank": t.flops_per_rank, "group_efficiency": t.group_efficiency,
            "bytes_sent": t.bytes_sent, "intra_node_bytes": t.intra_bytes,
            "inter_node_bytes": t.inter_bytes, "overlap_seconds": t.overlap_s,
            "overlapped": t.overlapped, "step_seconds": t.step_s,
            "tokens_per_second": t.tokens_per_s, "time": asdict(t),
            "hardware": plan.hardware,
            "first_fit": None if first is None else {
                "choice": first.label(), "data_parallel": first.data_parallel,
                "step_seconds": first.time.step_s},
            "shardings": [r.as_dict() for r in rows],
            "candidates": [e.as_dict() for e in plan.tried]}


def _print_time(plan, chosen, first) -> None:
    """Per data-parallel x context-parallel x mode: the fastest candidate that fits (else the
    smallest), its per-rank FLOPs, bytes sent and modeled step."""
    from dta.planning.memory import GIB, SHARDINGS

    h = plan.hardware
    print(f"time per step (a model, docs/planning.md: {h['peak_tflops']:g} TFLOP/s peak x "
          f"{h['utilization']:g} ({h['compute_dtype']}) per GPU, {h['intra_node_gbs']:g} GB/s "
          f"in a node, {h['inter_node_gbs']:g} GB/s across, {h['gpus_per_node']} GPUs a node, "
          f"{h['latency_us']:g} us a collective, host {h['host_link_gbs']:g} GB/s and "
          f"{h['host_adam_gparams']:g} G params/s, adds {h['host_add_gelems']:g} G/s, no "
          "overlap but prefetch's; --peak-tflops --utilization --intra-node-gbs "
          "--inter-node-gbs --gpus-per-node --latency-us --host-link-gbs --host-adam-gparams "
          "--host-add-gelems):")
    print(f"  {'D x C':<7} {'mode':<10} {'E/S/offload':<31} {'policy':<9} {'block':>5} "
          f"{'GiB/GPU':>8} {'TFLOP/rank':>10} {'GB sent':>8} {'step s':>7} {'tokens/s':>9} "
          f"{'effic.':>6} {'compute':>7}")
    best = {}
    for e in plan.tried:  # fitting first, the fastest of them; else the smallest
        rank = (0, e.time.step_s) if e.total <= plan.budget else (1, e.total)
        if (e.context_parallel, e.sharding) not in best or rank < best[e.context_parallel, e.sharding][1]:
            best[e.context_parallel, e.sharding] = (e, rank)
    for (c, _), (e, rank) in sorted(best.items(), key=lambda kv: (kv[0][0], SHARDINGS.index(kv[0][1]))):
        t = e.time
        mark = "  <- chosen" if e is chosen else "" if rank[0] == 0 else "  (does not fit)"
        lay = f"{e.expert_parallel}/{e.shard_size}/{e.offload}" + \
            ("/resident" if e.node_resident else "") + ("/prefetch" if e.prefetch else "")
        print(f"  {f'{e.data_parallel} x {c}':<7} {e.sharding:<10} {lay:<31} {e.policy:<9} "
              f"{e.block_tokens or 'none':>5} {e.total / GIB:>8.1f} {t.flops_per_rank / 1e12:>10.0f} "
              f"{t.bytes_sent / 1e9:>8.1f} {t.step_s:>7.1f} {t.tokens_per_s:>9.0f} "
              f"{t.group_efficiency:>6.3f} {t.compute_share:>7.2f}{mark}")
    if chosen is not None and chosen.time.overlapped:
        print(f"  prefetch assumed overlapped: the {chosen.time.overlapped} on the slowest "
              f"rank, {chosen.time.overlap_s:.2f} s hidden under compute (a call's backward "
              "only under recompute, where it follows its call)")
    if chosen is not None and first is not None:
        print(f"  chosen by modeled throughput: {chosen.label()} ({chosen.time.step_s:.1f} s); "
              f"the first that fits in the memory order, {first.label()} (data parallel "
              f"{first.data_parallel}): {first.time.step_s:.1f} s")


def _layout(args, shape, hardware, adapters: int) -> dict:
    """--expert-parallel, --shard-size, --offload, --node-resident, --prefetch: the layouts
    plan_memory tries (``auto``: every one the world allows, dta.planning.state.layout_choices;
    a LoRA run: none of them)."""
    from dta.planning.state import check_layout, layout_choices

    W = args.workers
    pinned = {}
    for flag, value in (("--expert-parallel", args.expert_parallel),
                        ("--shard-size", args.shard_size)):
        if value != "auto":
            try:
                pinned[flag] = int(value)
            except ValueError:
                raise ValueError(f"{flag} must be auto or an integer >= 1, got {value!r}") \
                    from None
    on = {"on": (True,), "off": (False,), "auto": None}
    if adapters and (pinned.get("--expert-parallel", 1) != 1 or args.offload not in ("none", "auto")
                     or pinned.get("--shard-size", W) != W or "on" in (args.node_resident,
                                                                       args.prefetch)):
        raise ValueError("--lora-r is priced without expert parallelism, shard groups, "
                         "offload, node residency or prefetch (--expert-parallel 1 "
                         "--shard-size W --offload none)")
    E = pinned.get("--expert-parallel")
    S = pinned.get("--shard-size")
    try:  # a pinned size: checked as the planner checks it, named by its flag
        check_layout(shape, W, "zero1", E or 1, None, "none")
    except ValueError as e:
        raise ValueError(f"--expert-parallel: {e}") from None
    try:
        check_layout(shape, W, "zero1", 1, S, "none")
    except ValueError as e:
        raise ValueError(f"--shard-size: {e}") from None
    none = (1,) if adapters else None
    groups = (None if S == W else S,) if S else (None,) if adapters else None
    choices = layout_choices(shape, W, hardware.gpus_per_node, shard_size=groups)
    if args.node_resident == "on" and all(g is None or g == W for g in choices["shard_size"]):
        raise ValueError(f"--node-resident on needs a shard size below --workers {W} (the "
                         "node: --shard-size, or --gpus-per-node dividing W)")
    return layout_choices(
        shape, W, hardware.gpus_per_node,
        expert_parallel=(E,) if E else none,
        shard_size=groups,
        offload=("none",) if adapters and args.offload == "auto" else
        None if args.offload == "auto" else (args.offload,),
        node_resident=(False,) if adapters else on[args.node_resident],
        prefetch=(False,) if adapters else on[args.prefetch])


def _context_parallel(value: str, workers: int, sizes) -> tuple:
    """--context-parallel: ``auto`` (the sizes dividing W) or one size dividing W."""
    if value == "auto":
        return tuple(c for c in sizes if workers % c == 0)
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1 or workers % size:
        raise ValueError(f"--context-parallel must be auto or an integer >= 1 dividing --workers "
                         f"{workers}, got {value!r}")
    return (size,)

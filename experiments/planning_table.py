"""The table of docs/planning.md: what ``dta plan --memory`` chooses by modeled throughput for
long trajectories -- four rollouts of L tokens on one 8,192-token prompt (L = 32K, 64K, 128K,
256K) -- for Qwen3-8B/14B/32B and Qwen3-30B-A3B on 8 and 16 x 80 GB, Llama-3.1-70B on 16 and
32, Qwen3-235B-A22B on 32 and 64: data-parallel x context-parallel size, sharding, policy and
block, expert parallelism, shard group (HSDP) and offload, per-rank FLOPs, bytes sent,
modeled step time and its compute share (compute / step), group efficiency and memory per
GPU (and per rank in host memory), under the split context-parallel scheme; beside it the
replicated scheme's choice (its efficiency and step). The same call ``dta plan --memory
--budget-gib 80`` makes (``dta.planning.memory.plan_memory`` with the batch's tree, every
layout the world allows, the default walk options and the default rates of
``dta.planning.timing.Hardware``). A model, not a measurement. The last lines list the rows
on 16 or more GPUs whose compute share is under :data:`SHARE` (the issue's bar).

    python -m experiments.planning_table [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

MODELS = {"qwen3-8b": (8, 16), "qwen3-14b": (8, 16), "qwen3-32b": (8, 16),  # GPUs (x 80 GB)
          "qwen3-30b-a3b": (8, 16), "llama-70b": (16, 32), "qwen3-235b-a22b": (32, 64)}
SHARE = 0.6  # compute / modeled step the issue asks of every row that fits on >= 16 GPUs
LENGTHS = (32_768, 65_536, 131_072, 262_144)
PROMPT, ROLLOUTS, GIB_PER_GPU = 8192, 4, 80
# host memory per GPU: a DGX H100's 2 TiB of DRAM over its 8 GPUs (--host-budget-gib 256)
HOST_GIB_PER_GPU = 256


def rollouts(length: int):
    """The batch's prefix tree: ROLLOUTS sequences of ``length`` tokens on one prompt."""
    import numpy as np

    from dta.planning import build_tree

    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 150_000, PROMPT)
    return build_tree([np.concatenate([prompt, rng.integers(3, 150_000, length - PROMPT)])
                       for _ in range(ROLLOUTS)])


def row(plan) -> dict:
    from dta.planning.memory import GIB

    e = plan.chosen or plan.cheapest
    t = e.time
    return dict(fits=plan.chosen is not None, data_parallel=e.data_parallel,
                context_parallel=e.context_parallel, sharding=e.sharding, policy=e.policy,
                block_tokens=e.block_tokens or 0, expert_parallel=e.expert_parallel,
                shard_size=e.shard_size, offload=e.offload, node_resident=e.node_resident,
                prefetch=e.prefetch, flops_per_rank=t.flops_per_rank,
                bytes_sent=t.bytes_sent, cp_bytes=t.cp_bytes, step_s=t.step_s,
                compute_s=t.compute_s, compute_share=t.compute_share,
                tokens_per_s=t.tokens_per_s, group_efficiency=t.group_efficiency,
                total_gib=e.total / GIB, host_gib=e.host / GIB, refused=e.refused,
                shortfall_gib=plan.shortfall / GIB, time=asdict(t), binds=binds(plan))


def binds(plan) -> str:
    """What keeps the choice's compute share under SHARE, with its number: the largest
    part of the step that is not compute (bandwidth in or across nodes, the host), and the
    fastest candidate tried whose share would reach SHARE with what refused it (memory, host
    memory). Empty at SHARE or above."""
    e = plan.chosen
    if e is None or e.time.compute_share >= SHARE:
        return ""
    t, hw = e.time, plan.hardware
    gpn = hw["gpus_per_node"]
    link = {True: f"in a node at {hw['intra_node_gbs']:g} GB/s",
            False: f"across nodes at {hw['inter_node_gbs']:g} GB/s"}
    parts = [  # (seconds, what)
        (t.sharding_s - t.overlap_s, f"bandwidth: {e.sharding}'s collectives, "
         f"{t.sharding_bytes / 1e9:,.0f} GB {link[e.shard_size <= gpn]}"
         + (f" ({t.overlap_s:,.0f} s hidden by prefetch)" if t.overlap_s else "")),
        (t.ep_s, f"bandwidth: expert all-to-alls, {t.ep_bytes / 1e9:,.0f} GB "
         f"{link[e.expert_parallel <= gpn]}"),
        (t.cp_s, f"bandwidth: context-parallel all-to-alls, {t.cp_bytes / 1e9:,.0f} GB "
         f"{link[e.context_parallel <= gpn]}"),
        (t.replica_s, f"bandwidth: once-a-step collectives, {t.replica_bytes / 1e9:,.0f} GB "
         f"{link[e.world <= gpn]}"),
        (t.host_s, f"host: the offloaded step, {t.host_bytes / 1e9:,.0f} GB over the "
         f"{hw['host_link_gbs']:g} GB/s host link and AdamW at {hw['host_adam_gparams']:g} "
         "G params/s" + (f", the calls' gradients summed at {hw['host_add_gelems']:g} G/s"
                         if e.offload == "gradients" else ""))]
    secs, what = max(parts)
    out = f"{what}: {secs:,.1f} s of the {t.step_s:,.1f} s step (compute {t.compute_s:,.1f} s)"
    # the refused candidate that would reach SHARE and misses its budgets by the least
    better = [c for c in plan.tried if c.refused and c.time is not None
              and c.time.compute_share >= SHARE]
    if better:
        b = min(better, key=lambda c: (c.total - plan.budget, c.host))
        out += (f"; memory: the closest to fitting at share >= {SHARE}, {b.label()} (share "
                f"{b.time.compute_share:.2f}, {b.time.step_s:,.1f} s), does not fit "
                f"({b.refused})")
    return out


def plan(name: str, gpus: int, tree, scheme: str = "split", **pinned):
    """``dta plan --memory --budget-gib 80 --host-budget-gib 256``'s choice: every C and
    every layout the world allows (``dta.planning.state.layout_choices``; ``pinned``: knobs
    given a tuple of values instead)."""
    from dta.options import WalkOptions
    from dta.planning.memory import CONTEXT_PARALLEL, GIB, SHAPES, ModelShape, plan_memory
    from dta.planning.state import layout_choices
    from dta.planning.timing import Hardware

    shape = ModelShape.of(SHAPES[name])
    return plan_memory(SHAPES[name], gpus, GIB_PER_GPU * GIB, tree=tree, walk=WalkOptions(),
                       context_parallel=tuple(c for c in CONTEXT_PARALLEL if gpus % c == 0),
                       cp_schemes=(scheme,), host_budget_bytes=HOST_GIB_PER_GPU * GIB,
                       **layout_choices(shape, gpus, Hardware().gpus_per_node, **pinned))


def _layout(r: dict, gpus: int) -> str:
    parts = [f"EP {r['expert_parallel']}"] if r["expert_parallel"] > 1 else []
    if r["shard_size"] != gpus:
        parts.append(f"{'node-resident' if r['node_resident'] else 'HSDP'} {r['shard_size']}")
    if r["prefetch"]:
        parts.append("prefetch")
    if r["offload"] != "none":
        parts.append("offload" + (" + gradients" if r["offload"] == "gradients" else ""))
    return ", ".join(parts) or "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    rows = []
    print("| path | model | GPUs | D x C, sharding / policy / block | EP, HSDP, prefetch, "
          "offload | TFLOP per rank | GB sent per rank (across nodes) | step (compute) | "
          "compute share | efficiency | GiB per GPU (host) | replicated CP: D x C, "
          "efficiency, step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for length in LENGTHS:
        tree = rollouts(length)
        for name, counts in MODELS.items():
            for gpus in counts:
                got = {s: row(plan(name, gpus, tree, s)) for s in ("split", "replicated")}
                rows.append(dict(length=length, model=name, gpus=gpus, **got))
                r, o = got["split"], got["replicated"]
                if r["fits"]:
                    host = f" ({r['host_gib']:.0f})" if r["offload"] != "none" else ""
                    cell = (f"{r['data_parallel']} x {r['context_parallel']}, {r['sharding']} / "
                            f"{r['policy']} / {r['block_tokens'] or 'none'} | "
                            f"{_layout(r, gpus)} | "
                            f"{r['flops_per_rank'] / 1e12:,.0f} | {r['bytes_sent'] / 1e9:,.0f} "
                            f"({r['time']['inter_bytes'] / 1e9:,.0f}) | "
                            f"{r['step_s']:,.0f} s ({r['compute_s']:,.0f}) | "
                            f"{r['compute_share']:.2f} | {r['group_efficiency']:.3f} | "
                            f"{r['total_gib']:.1f}{host}")
                else:
                    cell = (f"**no fit** ({r['refused']}, C = {r['context_parallel']}) "
                            "| | | | | | | ")
                other = (f"{o['data_parallel']} x {o['context_parallel']}, "
                         f"{o['group_efficiency']:.2f}, {o['step_s']:,.0f} s"
                         if o["fits"] else f"no fit ({o['shortfall_gib']:.1f} GiB over)")
                print(f"| {length // 1024}K | {name} | {gpus} x {GIB_PER_GPU} GB | {cell} | "
                      f"{other} |")
    low = [r for r in rows if r["gpus"] >= 16 and r["split"]["fits"]
           and r["split"]["compute_share"] < SHARE]
    print(f"\nrows fitting on >= 16 GPUs with compute share < {SHARE}: {len(low)} of "
          f"{sum(r['gpus'] >= 16 and r['split']['fits'] for r in rows)}")
    for r in low:
        print(f"  {r['length'] // 1024}K {r['model']} on {r['gpus']}: share "
              f"{r['split']['compute_share']:.2f}; binds: {r['split']['binds']}")
    if args.json:
        print(json.dumps({"prompt": PROMPT, "rollouts": ROLLOUTS, "gib_per_gpu": GIB_PER_GPU,
                          "share": SHARE, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

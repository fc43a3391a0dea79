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
                shard_size=e.shard_size, offload=e.offload, flops_per_rank=t.flops_per_rank,
                bytes_sent=t.bytes_sent, cp_bytes=t.cp_bytes, step_s=t.step_s,
                compute_s=t.compute_s, compute_share=t.compute_share,
                tokens_per_s=t.tokens_per_s, group_efficiency=t.group_efficiency,
                total_gib=e.total / GIB, host_gib=e.host / GIB,
                shortfall_gib=plan.shortfall / GIB, time=asdict(t))


def plan(name: str, gpus: int, tree, scheme: str = "split"):
    """``dta plan --memory --budget-gib 80``'s choice: every C, E, S and offload the world
    allows."""
    from dta.options import WalkOptions
    from dta.planning.memory import CONTEXT_PARALLEL, GIB, SHAPES, ModelShape, plan_memory
    from dta.planning.state import OFFLOADS, expert_parallel_sizes, shard_sizes
    from dta.planning.timing import Hardware

    shape = ModelShape.of(SHAPES[name])
    return plan_memory(SHAPES[name], gpus, GIB_PER_GPU * GIB, tree=tree, walk=WalkOptions(),
                       context_parallel=tuple(c for c in CONTEXT_PARALLEL if gpus % c == 0),
                       cp_schemes=(scheme,), expert_parallel=expert_parallel_sizes(shape, gpus),
                       shard_size=shard_sizes(gpus, Hardware().gpus_per_node), offload=OFFLOADS)


def _layout(r: dict, gpus: int) -> str:
    parts = [f"EP {r['expert_parallel']}"] if r["expert_parallel"] > 1 else []
    if r["shard_size"] != gpus:
        parts.append(f"HSDP {r['shard_size']}")
    if r["offload"] != "none":
        parts.append("offload")
    return ", ".join(parts) or "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    rows = []
    print("| path | model | GPUs | D x C, sharding / policy / block | EP, HSDP, offload | TFLOP "
          "per rank | GB sent per rank | step (compute) | compute share | efficiency | GiB "
          "per GPU (host) | replicated CP: D x C, efficiency, step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for length in LENGTHS:
        tree = rollouts(length)
        for name, counts in MODELS.items():
            for gpus in counts:
                got = {s: row(plan(name, gpus, tree, s)) for s in ("split", "replicated")}
                rows.append(dict(length=length, model=name, gpus=gpus, **got))
                r, o = got["split"], got["replicated"]
                if r["fits"]:
                    host = f" ({r['host_gib']:.0f})" if r["host_gib"] else ""
                    cell = (f"{r['data_parallel']} x {r['context_parallel']}, {r['sharding']} / "
                            f"{r['policy']} / {r['block_tokens'] or 'none'} | "
                            f"{_layout(r, gpus)} | "
                            f"{r['flops_per_rank'] / 1e12:,.0f} | {r['bytes_sent'] / 1e9:,.0f} | "
                            f"{r['step_s']:,.0f} s ({r['compute_s']:,.0f}) | "
                            f"{r['compute_share']:.2f} | {r['group_efficiency']:.3f} | "
                            f"{r['total_gib']:.1f}{host}")
                else:
                    cell = (f"**no fit** ({r['shortfall_gib']:.1f} GiB over at C = "
                            f"{r['context_parallel']}) | | | | | | | ")
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
        t = r["split"]["time"]
        print(f"  {r['length'] // 1024}K {r['model']} on {r['gpus']}: share "
              f"{r['split']['compute_share']:.2f}; of the {t['step_s']:,.0f} s step: compute "
              f"{t['compute_s']:,.0f}, sharding {t['sharding_s']:,.0f}, expert all-to-alls "
              f"{t['ep_s']:,.0f}, context parallel {t['cp_s']:,.0f}, HSDP all-reduce "
              f"{t['replica_s']:,.0f}, host {t['host_s']:,.0f}")
    if args.json:
        print(json.dumps({"prompt": PROMPT, "rollouts": ROLLOUTS, "gib_per_gpu": GIB_PER_GPU,
                          "share": SHARE, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

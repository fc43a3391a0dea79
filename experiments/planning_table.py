"""The table of docs/planning.md: what ``dta plan --memory`` chooses by modeled throughput for
long trajectories -- four rollouts of L tokens on one 8,192-token prompt (L = 32K, 64K, 128K,
256K) -- for Qwen3-8B/14B/32B on 8 and 16 x 80 GB: data-parallel x context-parallel size,
sharding, policy and block, per-rank FLOPs, bytes sent, modeled step time, group efficiency
and memory per GPU, under the split context-parallel scheme; beside it the replicated
scheme's choice (its efficiency and step). The same call ``dta plan --memory --budget-gib 80``
makes (``dta.planning.memory.plan_memory`` with the batch's tree, the default walk options
and the default rates of ``dta.planning.timing.Hardware``). A model, not a measurement.

    python -m experiments.planning_table [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")
GPUS = (8, 16)  # x 80 GB
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
                context_parallel=e.context_parallel, mode=e.mode, policy=e.policy,
                block_tokens=e.block_tokens or 0, flops_per_rank=t.flops_per_rank,
                bytes_sent=t.bytes_sent, cp_bytes=t.cp_bytes, step_s=t.step_s,
                compute_s=t.compute_s, tokens_per_s=t.tokens_per_s,
                group_efficiency=t.group_efficiency, total_gib=e.total / GIB,
                shortfall_gib=plan.shortfall / GIB)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from dta.options import WalkOptions
    from dta.planning.memory import CONTEXT_PARALLEL, GIB, SHAPES, plan_memory

    rows = []
    print("| path | model | GPUs | D x C, sharding / policy / block | TFLOP per rank | GB sent "
          "per rank | step (compute) | efficiency | GiB per GPU | replicated CP: D x C, "
          "efficiency, step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in LENGTHS:
        tree = rollouts(length)
        for name in MODELS:
            for gpus in GPUS:
                sizes = tuple(c for c in CONTEXT_PARALLEL if gpus % c == 0)
                got = {s: row(plan_memory(SHAPES[name], gpus, GIB_PER_GPU * GIB, tree=tree,
                                          context_parallel=sizes, cp_schemes=(s,),
                                          walk=WalkOptions()))
                       for s in ("split", "replicated")}
                rows.append(dict(length=length, model=name, gpus=gpus, **got))
                r, o = got["split"], got["replicated"]
                if r["fits"]:
                    cell = (f"{r['data_parallel']} x {r['context_parallel']}, {r['mode']} / "
                            f"{r['policy']} / {r['block_tokens'] or 'none'} | "
                            f"{r['flops_per_rank'] / 1e12:,.0f} | {r['bytes_sent'] / 1e9:,.0f} | "
                            f"{r['step_s']:,.0f} s ({r['compute_s']:,.0f}) | "
                            f"{r['group_efficiency']:.3f} | {r['total_gib']:.1f}")
                else:
                    cell = (f"**no fit** ({r['shortfall_gib']:.1f} GiB over at C = "
                            f"{r['context_parallel']}) | | | | | ")
                other = (f"{o['data_parallel']} x {o['context_parallel']}, "
                         f"{o['group_efficiency']:.2f}, {o['step_s']:,.0f} s"
                         if o["fits"] else f"no fit ({o['shortfall_gib']:.1f} GiB over)")
                print(f"| {length // 1024}K | {name} | {gpus} x {GIB_PER_GPU} GB | {cell} | "
                      f"{other} |")
    if args.json:
        print(json.dumps({"prompt": PROMPT, "rollouts": ROLLOUTS, "gib_per_gpu": GIB_PER_GPU,
                          "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

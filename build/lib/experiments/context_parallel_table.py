"""The table of docs/context-parallel.md: what the memory model (``dta.planning.memory``)
chooses for long trajectories -- four rollouts of L tokens on one 8,192-token prompt (the
longest path L, the largest node L − 8,192), L = 32K, 64K, 128K, 256K -- for Qwen3-8B/14B/32B
on 8 x 80 GB, 8 x 141 GB and 16 x 80 GB: sharding mode, memory policy, block and context
parallel size C (tried 1, 2, 4, 8 dividing the GPUs; a larger C only when nothing fits with a
smaller), the same choice ``dta plan --memory --budget-gib G`` makes. A model, not a
measurement.

    python -m experiments.context_parallel_table [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")
CLUSTERS = ((8, 80), (8, 141), (16, 80))  # (GPUs, GiB each)
LENGTHS = (32_768, 65_536, 131_072, 262_144)
PROMPT = 8192


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from dta.planning.memory import CONTEXT_PARALLEL, GIB, SHAPES, plan_memory

    rows = []
    for length in LENGTHS:
        for name in MODELS:
            for gpus, gib in CLUSTERS:
                sizes = tuple(c for c in CONTEXT_PARALLEL if gpus % c == 0)
                plan = plan_memory(SHAPES[name], gpus, gib * GIB, path_tokens=length,
                                   call_tokens=length - PROMPT, context_parallel=sizes)
                e = plan.chosen or plan.cheapest
                rows.append(dict(length=length, model=name, gpus=gpus, gib=gib,
                                 fits=plan.chosen is not None, sharding=e.sharding, policy=e.policy,
                                 block_tokens=e.block_tokens or 0,
                                 context_parallel=e.context_parallel,
                                 total_gib=e.total / GIB, usable_gib=plan.budget / GIB,
                                 path_kv_gib=e.split["path_kv"] / GIB,
                                 shortfall_gib=plan.shortfall / GIB))
    print("| trajectory | model | 8 x 80 GB | 8 x 141 GB | 16 x 80 GB |")
    print("|---|---|---|---|---|")
    for length in LENGTHS:
        for name in MODELS:
            cells = []
            for gpus, gib in CLUSTERS:
                r = next(x for x in rows if (x["length"], x["model"], x["gpus"], x["gib"]) ==
                         (length, name, gpus, gib))
                if r["fits"]:
                    cells.append(f"C={r['context_parallel']}, {r['sharding']}/{r['policy']}/"
                                 f"{r['block_tokens'] or 'none'}: {r['total_gib']:.0f} GiB")
                else:
                    cells.append(f"**no fit** ({r['shortfall_gib']:.0f} GiB over at "
                                 f"C={r['context_parallel']})")
            print(f"| {length // 1024}K | {name} | " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps({"prompt": PROMPT, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

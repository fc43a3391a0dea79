"""The memory table of docs/memory.md: per-GPU memory of one training step at τ² full scale,
for Qwen3-8B/14B/32B on 8 x 80 GB, 8 x 141 GB and 16 x 80 GB, with the sharding mode, memory
policy and block the memory model (``dta.planning.memory.plan_memory``) chooses -- the same
choice ``dta plan --memory --budget-gib G`` prints for one model and cluster.

    python -m experiments.memory_table [--workload tau2-airline] [--scale full] [--json]

Prints a Markdown table; ``--json``: one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import sys

MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")
CLUSTERS = ((8, 80), (8, 141), (16, 80))  # (GPUs, GiB each)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="tau2-airline")
    p.add_argument("--scale", default="full")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from dta.planning.memory import GIB, HEADROOM, SHAPES, ModelShape, batch_extent, plan_memory
    from dta.tree import PrefixTree
    from experiments.workloads import make_workload

    w = make_workload(args.workload, scale=args.scale, seed=args.seed)
    tree = PrefixTree([r["input_ids"] for r in w.records])
    path, node = batch_extent(tree)
    rows = []
    for name in MODELS:
        for gpus, gib in CLUSTERS:
            plan = plan_memory(SHAPES[name], gpus, gib * GIB, path_tokens=path, call_tokens=node)
            e = plan.chosen or plan.cheapest
            rows.append({"model": name, "params_b": round(ModelShape.of(SHAPES[name]).params / 1e9, 2),
                         "gpus": gpus, "gib": gib, "fits": plan.chosen is not None,
                         "sharding": e.sharding, "policy": e.policy, "block_tokens": e.block_tokens or 0,
                         "state_gib": e.state / GIB, "activations_gib": e.activations / GIB,
                         "split_gib": {k: v / GIB for k, v in e.split.items()},
                         "total_gib": e.total / GIB, "usable_gib": plan.budget / GIB,
                         "shortfall_gib": plan.shortfall / GIB})
    print(f"{args.workload}, scale {args.scale}: longest path {path:,} tokens, largest node "
          f"{node:,}; bfloat16 compute (fp32 masters), {HEADROOM:.0%} of each GPU left free\n")
    print("| model | GPUs | chosen (mode / policy / block) | state | activations (path K/V + "
          "graphs + head) | total per GPU |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        s = r["split_gib"]
        choice = (f"{r['sharding']} / {r['policy']} / {r['block_tokens'] or 'none'}" if r["fits"]
                  else f"**none fits** (cheapest: {r['sharding']} / {r['policy']} / "
                       f"{r['block_tokens'] or 'none'}, {r['shortfall_gib']:.1f} GiB over)")
        print(f"| {r['model']} | {r['gpus']} x {r['gib']} GB | {choice} | {r['state_gib']:.1f} GiB "
              f"| {r['activations_gib']:.1f} GiB ({s['path_kv']:.1f} + {s['graphs']:.1f} + "
              f"{s['head']:.1f}) | {r['total_gib']:.1f} of {r['usable_gib']:.1f} GiB |")
    if args.json:
        print(json.dumps({"workload": args.workload, "scale": args.scale, "path_tokens": path,
                          "node_tokens": node, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

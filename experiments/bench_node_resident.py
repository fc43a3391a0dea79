"""Bytes across the nodes per step against the number of calls: fsdp over the world, fsdp
under HSDP and fsdp with node-resident gathers (``train.node_resident``, ZeRO++'s hpZ), on 4
local gloo ranks as two "nodes" of 2 (the tiny Qwen3 by default).

The same τ²-airline batch is trained one step per layout and per ``walker.block_tokens``
(smaller blocks: the walk cuts its paths into more packs, so more decoder calls), through the
Ray worker's code without Ray (``experiments.bench_hsdp``'s counting): every collective a rank
makes is counted by process group; with two ranks per node, the replica group's and the
world's collectives cross the nodes, the shard group's stay inside one. Per layout and block
size: the shard group's collectives (they grow with the calls), the bytes sent across the
nodes (a ring's share, ``bench_hsdp._sent``) beside the planner's figure for them
(``dta.planning.timing.replica_traffic``), the largest rank's device bytes (params + grads +
optimizer) and the largest relative L2 of the parameters to the first run's. Counts, not timings::

    python -m experiments.bench_node_resident --json
"""
from __future__ import annotations

import argparse
import json

WORLD = 4
NODE = 2
# (label, shard size or None for the world, node_resident)
LAYOUTS = [("fsdp over the world", None, False), ("fsdp HSDP 2x2", NODE, False),
           ("fsdp node-resident 2x2", NODE, True)]
BLOCKS = (None, 32, 16)  # walker.block_tokens: None = the default (whole paths per pack)


def _config(shard, resident, block, args):
    from dta.config.schema import load_config

    over = [f"workload.scale={args.scale}", f"model.size={args.size}",
            f"model.dtype={args.dtype}", f"walker.policy={args.policy}",
            "train.sharding=fsdp", f"ray.num_workers={WORLD}", "optimizer.lr=1e-3",
            "optimizer.max_grad_norm=0.5", f"train.offload={args.offload}"]
    over += [f"train.shard_size={shard}"] if shard else []
    over += ["train.node_resident=true"] if resident else []
    over += [f"walker.block_tokens={block}"] if block else []
    return load_config(None, over)


def _planned(config, layout, cfg) -> float | None:
    """The planner's bytes a rank sends across the nodes per step for this layout
    (``dta.planning.timing.replica_traffic``: the once-a-step collectives; None for fsdp over
    the world, whose crossings are its per-call gathers)."""
    from dta.planning.shapes import ModelShape
    from dta.planning.timing import replica_traffic

    if layout.shard_size == layout.world:
        return None
    c = 8 if str(cfg.model.dtype) == "float64" else 4 if str(cfg.model.dtype) == "float32" \
        else 2
    return replica_traffic("fsdp", layout.world, ModelShape.of(config), c,
                           shard_size=layout.shard_size,
                           node_resident=layout.node_resident)[0]


def count(rank, world, cases, args):
    """Per case ``(shard, resident, block)``: this rank's collectives of one step by group
    (shard / replicas / world: calls and bytes sent) and, on rank 0, the parameters after."""
    import torch

    from dta.losses import batch_totals
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from experiments.bench_hsdp import _batch, _sent, _worker
    from experiments.comm_count import CommCounter

    torch.set_num_threads(1)
    out = []
    for shard, resident, block in cases:
        cfg = _config(shard, resident, block, args)
        w, mine = _worker(rank, world, cfg)
        batch = _batch(cfg, 0)
        ids = assign_workers(PrefixTree(batch.input_ids), world).workers[rank]
        with CommCounter() as counter:
            stats = w.step(0, batch.subset(ids) if ids else None, batch_totals(batch))
        by = {g: {"calls": 0, "sent": 0.0} for g in ("shard", "replicas", "world")}
        for op, ranks, nbytes in counter.calls:
            name = "world" if len(ranks) == world else \
                next(n for n, r in mine.items() if list(ranks) == r)
            by[name]["calls"] += 1
            by[name]["sent"] += _sent(op, len(ranks), nbytes)
        state = w.core.full_state()  # gathered: every rank takes part
        sb = stats["state_bytes"]
        out.append({"comm": by, "planned": _planned(w.core.model.config, w.core.layout, cfg),
                    "device_bytes": sb["params"] + sb["grads"] + sb["optimizer"],
                    "state": state if rank == 0 else None})
    return out


def main(argv=None) -> dict:
    from dta.planning.state import OFFLOADS
    from experiments.bench_hsdp import _rel
    from experiments.local_ranks import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny", help="model.size (qwen3)")
    ap.add_argument("--scale", default="tiny", help="workload.scale of τ²-airline")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policy", default="recompute", choices=("retain", "recompute"))
    ap.add_argument("--offload", default="none", choices=OFFLOADS)
    ap.add_argument("--blocks", default=",".join(str(b or 0) for b in BLOCKS),
                    help="walker.block_tokens to try, comma-separated (0: the default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    blocks = [int(b) or None for b in args.blocks.split(",")]
    cases = [(shard, resident, block) for _, shard, resident in LAYOUTS for block in blocks]
    res = run_ranks(count, WORLD, cases, args, timeout=1800.0)
    first = res[0][0]["state"]
    rows = []
    for i, (shard, resident, block) in enumerate(cases):
        label = next(lb for lb, s, r in LAYOUTS if (s, r) == (shard, resident))
        comm = {g: {k: max(r[i]["comm"][g][k] for r in res) for k in ("calls", "sent")}
                for g in ("shard", "replicas", "world")}
        rows.append({"layout": label, "shard_size": shard or WORLD, "node_resident": resident,
                     "block_tokens": block, "comm_per_rank": comm,
                     "in_node_collectives": comm["shard"]["calls"],
                     "cross_node_sent": comm["replicas"]["sent"] + comm["world"]["sent"],
                     "planned_cross_node_sent": res[0][i]["planned"],
                     "device_bytes": max(r[i]["device_bytes"] for r in res),
                     "rel_l2_vs_first": _rel(res[0][i]["state"], first)})
    report = {"world": WORLD, "ranks_per_node": NODE, "model_size": args.size,
              "workload_scale": args.scale, "dtype": args.dtype, "policy": args.policy,
              "offload": args.offload, "rows": rows,
              "max_rel_l2": max(r["rel_l2_vs_first"] for r in rows)}
    print(f"{'layout':24} {'block':>6} {'in-node collectives':>20} {'cross-node B sent':>18} "
          f"{'planner B':>10} {'device B':>10}")
    for r in rows:
        plan = r["planned_cross_node_sent"]
        print(f"{r['layout']:24} {r['block_tokens'] or '-':>6} {r['in_node_collectives']:>20} "
              f"{r['cross_node_sent']:>18,.0f} {'-' if plan is None else f'{plan:,.0f}':>10} "
              f"{r['device_bytes']:>10,}")
    for label, *_ in LAYOUTS:
        sent = [r["cross_node_sent"] for r in rows if r["layout"] == label]
        print(f"{label}: cross-node bytes, most / fewest calls = {sent[-1] / sent[0]:.3f}")
    print(f"largest relative L2 between the runs' parameters: {report['max_rel_l2']:.2g}")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

"""HSDP and optimizer offload, counted side by side on 4 local gloo ranks (two "nodes" of 2).

Each layout trains the same steps of a τ²-airline batch (the tiny Qwen3 by default) through
the Ray worker's code without Ray (``runtime.ray_runtime.worker.DFSWorker`` on
``experiments.local_ranks.run_ranks``); per rank and step the collectives are counted by
process group (``experiments.comm_count``): within the rank's shard group, across its
replica group (HSDP), over the world. Bytes are what each collective is handed (an
all-reduce: its tensor; a reduce-scatter: its input; an all-gather: its output) and what a
ring sends per rank ((g - 1) / g of that, twice for an all-reduce, g the group's size): with
two ranks per node, every world collective and every replica collective crosses the nodes,
a shard group's stays inside its node. State: ``state_bytes`` (device: params + grads +
optimizer; host: what offload keeps in host memory). Every layout ends at the same
parameters (the largest relative L2 difference to the first layout is reported). Counts,
not timings::

    python -m experiments.bench_hsdp --json
"""
from __future__ import annotations

import argparse
import json

WORLD = 4
NODE = 2  # ranks per "node": the HSDP shard size
# (mode, shard size or None for the world, offload)
LAYOUTS = [("fsdp", None, "none"), ("fsdp", NODE, "none"), ("zero1", None, "none"),
           ("zero1", NODE, "none"), ("replicate", None, "none"),
           ("replicate", None, "optimizer"), ("zero1", None, "optimizer"),
           ("fsdp", None, "optimizer"), ("fsdp", NODE, "optimizer")]


def _config(mode, shard, offload, args):
    from dta.config.schema import load_config

    over = [f"workload.scale={args.scale}", f"model.size={args.size}",
            f"model.dtype={args.dtype}", f"walker.policy={args.policy}",
            f"train.sharding={mode}", f"train.offload={offload}", f"ray.num_workers={WORLD}",
            "optimizer.lr=1e-3", "optimizer.max_grad_norm=0.5"]
    return load_config(None, over + ([f"train.shard_size={shard}"] if shard else []))


def _batch(cfg, step):
    from dta.batch import Batch
    from experiments.workloads import make_workload

    scale = str(cfg.workload.scale)
    scale = scale if scale in ("tiny", "small", "full") else float(scale)
    recs = make_workload(str(cfg.workload.name), scale=scale, seed=int(cfg.workload.seed) + step,
                         vocab_size=512).records
    return Batch.from_records(recs, vocab_size=512)


def _worker(rank: int, world: int, cfg):
    """The Ray worker's code on this rank, parallelized, and this rank's shard and replica
    groups (the ranks of each)."""
    from dta.config.schema import as_dict
    from runtime.engine import resolve_run_config
    from runtime.ray_runtime.worker import DFSWorker

    w = DFSWorker(rank, world, as_dict(cfg), resolve_run_config(cfg, None))
    w.parallelize()
    layout = w.core.layout
    return w, {"shard": next(g for g in layout.shard_groups() if rank in g),
               "replicas": next(g for g in layout.replica_groups() if rank in g)}


def _sent(op: str, size: int, nbytes: int) -> float:
    """Bytes a ring sends per rank for ``op`` over ``size`` ranks handed ``nbytes``."""
    if size <= 1:
        return 0.0
    share = (size - 1) / size * nbytes
    return 2 * share if op == "all_reduce" else share


def one_rank(rank, world, layouts, args):
    import torch

    from dta.losses import batch_totals
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from experiments.comm_count import CommCounter

    torch.set_num_threads(1)
    out = []
    for mode, shard, offload in layouts:
        cfg = _config(mode, shard, offload, args)
        w, groups = _worker(rank, world, cfg)
        steps = []
        for k in range(args.steps):
            batch = _batch(cfg, k)
            ids = assign_workers(PrefixTree(batch.input_ids), world).workers[rank]
            with CommCounter() as counter:
                stats = w.step(k, batch.subset(ids) if ids else None, batch_totals(batch))
            by = {"shard": {"calls": 0, "bytes": 0, "sent": 0.0},
                  "replicas": {"calls": 0, "bytes": 0, "sent": 0.0},
                  "world": {"calls": 0, "bytes": 0, "sent": 0.0}}
            for op, ranks, nbytes in counter.calls:
                if len(ranks) == world:
                    name = "world"  # plain sharding's shard group is the world
                elif list(ranks) == groups["shard"]:
                    name = "shard"
                elif list(ranks) == groups["replicas"]:
                    name = "replicas"
                else:
                    raise RuntimeError(f"a collective over ranks {ranks}: neither the shard, "
                                       "the replica group nor the world")
                by[name]["calls"] += 1
                by[name]["bytes"] += nbytes
                by[name]["sent"] += _sent(op, len(ranks), nbytes)
            steps.append({"comm": by, "state_bytes": stats["state_bytes"]})
        state = w.core.full_state()  # gathered: every rank takes part
        out.append({"layout": [mode, layout.shard_size, offload], "steps": steps,
                    "state": state if rank == 0 else None})
    return out


def _rel(a, b) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def main(argv=None) -> dict:
    from experiments.local_ranks import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny", help="model.size (qwen3)")
    ap.add_argument("--scale", default="tiny", help="workload.scale of τ²-airline")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policy", default="recompute", choices=("retain", "recompute"))
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = run_ranks(one_rank, WORLD, LAYOUTS, args, timeout=1800.0)
    rows = []
    first = res[0][0]["state"]
    for i, (mode, shard, offload) in enumerate(LAYOUTS):
        last = [r[i]["steps"][-1] for r in res]
        comm = {g: {"calls": max(s["comm"][g]["calls"] for s in last),
                    "bytes": max(s["comm"][g]["bytes"] for s in last),
                    "sent": max(s["comm"][g]["sent"] for s in last)}
                for g in ("shard", "replicas", "world")}
        sb = last[0]["state_bytes"]
        rows.append({"mode": mode, "shard_size": res[0][i]["layout"][1], "offload": offload,
                     "comm_per_rank": comm,
                     "cross_node_sent": comm["replicas"]["sent"] + comm["world"]["sent"],
                     "device_bytes": sb["params"] + sb["grads"] + sb["optimizer"],
                     "host_bytes": sb["host"], "state_bytes": sb,
                     "rel_l2_vs_first": _rel(res[0][i]["state"], first)})

    def row(mode, shard, offload):
        return next(r for r in rows if (r["mode"], r["shard_size"], r["offload"]) ==
                    (mode, shard, offload))

    ratios = {}
    for mode in ("fsdp", "zero1"):
        plain, hsdp = row(mode, WORLD, "none"), row(mode, NODE, "none")
        ratios[f"{mode}_hsdp_vs_plain_cross_node_sent"] = \
            hsdp["cross_node_sent"] / plain["cross_node_sent"]
    for mode in ("replicate", "zero1", "fsdp"):
        kept, off = row(mode, WORLD, "none"), row(mode, WORLD, "optimizer")
        ratios[f"{mode}_offload_vs_kept_device_bytes"] = off["device_bytes"] / kept["device_bytes"]
    report = {"world": WORLD, "ranks_per_node": NODE, "model_size": args.size,
              "workload_scale": args.scale, "dtype": args.dtype, "policy": args.policy,
              "steps": args.steps, "layouts": rows, "ratios": ratios,
              "max_rel_l2_between_layouts": max(r["rel_l2_vs_first"] for r in rows)}
    print(f"{'mode':9} {'S':>2} {'offload':9} {'shard calls/sent B':>20} "
          f"{'replica calls/sent B':>22} {'world calls/sent B':>20} {'device B':>10} "
          f"{'host B':>10}")
    for r in rows:
        c = r["comm_per_rank"]
        print(f"{r['mode']:9} {r['shard_size']:>2} {r['offload']:9} "
              f"{c['shard']['calls']:>6} / {c['shard']['sent']:>11,.0f} "
              f"{c['replicas']['calls']:>6} / {c['replicas']['sent']:>13,.0f} "
              f"{c['world']['calls']:>6} / {c['world']['sent']:>11,.0f} "
              f"{r['device_bytes']:>10,} {r['host_bytes']:>10,}")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    print(f"largest relative L2 between the layouts' parameters: "
          f"{report['max_rel_l2_between_layouts']:.2g}")
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()

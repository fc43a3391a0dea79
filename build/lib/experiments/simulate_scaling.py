"""Projected data-parallel scaling of DFS training on τ²-shaped batches, W = 1 ... 64.

For each W, the batch's prefix tree is balanced over W workers (``dta.planning.balance``
through :func:`dta.planning.workers.assign_workers`) under the planning cost model
(``dta.planning.cost``: analytic FLOPs of the model, linear work per unique token plus
attention work per context token). A worker's compute time is its planned FLOPs divided by
an effective throughput; a step adds the gradient all-reduce (ring: 2 (W-1)/W x gradient
bytes / bus bandwidth) and a fixed per-step overhead:

    step(W) = max_w cost_w / throughput + allreduce(W) + overhead
    speed-up(W) = step(1) / step(W)

The imbalance (max/mean worker cost) and the duplicated tokens (a shared prefix split across
workers is forwarded by each of them) are what keeps the speed-up below W, besides the
all-reduce. The unpacked baseline (every sequence trained on its own, perfectly balanced)
is shown for comparison. Nothing is trained: this is metadata and arithmetic, seconds on a
laptop. It is a projection under the stated throughput and bandwidth, not a measurement.

    python -m experiments.simulate_scaling --plot scaling.png [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

DEFAULT_WORKERS = "1,2,3,4,6,8,12,16,24,32,48,64"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="simulate_scaling", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="tau2-airline")
    p.add_argument("--scale", default="full", help="tiny | small | full | a number in (0, 1]")
    p.add_argument("--seeds", type=int, default=3, help="batches averaged (seeds 0..n-1)")
    p.add_argument("--family", default="qwen3")
    p.add_argument("--size", default="qwen3-0.6b", help="model shape of the cost model")
    p.add_argument("--workers", default=DEFAULT_WORKERS, help="comma-separated W values")
    p.add_argument("--tflops", type=float, default=250.0,
                   help="effective training throughput per worker, TFLOP/s (default 250: "
                        "~25%% MFU of an H200's dense bf16 peak)")
    p.add_argument("--bandwidth", type=float, default=100.0,
                   help="all-reduce bus bandwidth, GB/s (default 100)")
    p.add_argument("--grad-bytes", type=int, default=4, help="bytes per gradient element")
    p.add_argument("--overhead", type=float, default=0.05, help="fixed seconds per step")
    p.add_argument("--plot", metavar="PNG", help="write the speed-up plot to this file")
    p.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = p.parse_args(argv)
    try:
        args.worker_list = sorted({int(w) for w in args.workers.split(",") if w.strip()})
    except ValueError:
        p.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    if not args.worker_list or args.worker_list[0] < 1:
        p.error("--workers must hold integers >= 1")
    if args.seeds < 1 or args.tflops <= 0 or args.bandwidth <= 0:
        p.error("--seeds, --tflops and --bandwidth must be positive")
    return args


def _scale(value: str):
    return value if value in ("tiny", "small", "full") else float(value)


def simulate(args) -> dict:
    from dta.model.models import build_config
    from dta.planning.cost import CostModel, flops, flops_unpacked
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from experiments.workloads import make_workload

    hf = build_config(args.family, args.size)
    model = CostModel.from_config(hf, name=args.size)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    embed = hf.vocab_size * hf.hidden_size * (1 if hf.tie_word_embeddings else 2)
    layer = (hf.hidden_size * head_dim * 2 * (hf.num_attention_heads + hf.num_key_value_heads)
             + 3 * hf.hidden_size * hf.intermediate_size)  # q, k, v, o + gated MLP
    params = embed + hf.num_hidden_layers * layer  # norms omitted (negligible)
    grad_bytes = params * args.grad_bytes
    throughput = args.tflops * 1e12

    batches = []
    for seed in range(args.seeds):
        wl = make_workload(args.workload, scale=_scale(args.scale), seed=seed,
                           vocab_size=hf.vocab_size)
        tree = PrefixTree([r["input_ids"] for r in wl.records])
        batches.append((tree, tree.stats()))

    rows = []
    for W in args.worker_list:
        per = []
        for tree, st in batches:
            t0 = time.perf_counter()
            plan = assign_workers(tree, W, model)
            plan_s = time.perf_counter() - t0
            compute = max(plan.costs) / throughput
            allreduce = 0.0 if W == 1 else 2 * (W - 1) / W * grad_bytes / (args.bandwidth * 1e9)
            unpacked = flops_unpacked(tree, model) / W / throughput  # perfect balance
            per.append(dict(
                step_s=compute + allreduce + args.overhead, compute_s=compute,
                allreduce_s=allreduce, imbalance=plan.imbalance,
                duplicated_tokens=plan.duplicated_tokens,
                duplicated_share=plan.duplicated_tokens / st.unique_tokens,
                unique_tokens=st.unique_tokens, total_tokens=st.total_tokens,
                tree_flops=flops(tree, model),
                unpacked_step_s=unpacked + allreduce + args.overhead, plan_s=plan_s,
                method=plan.method))
        row = {"workers": W}
        for key in per[0]:
            if key == "method":
                row[key] = per[0][key]
            else:
                row[key] = float(np.mean([p[key] for p in per]))
        rows.append(row)
    base = rows[0]["step_s"] if rows[0]["workers"] == 1 else None
    if base is None:  # W = 1 not asked for: compute it as the reference
        tree_flops = float(np.mean([flops(t, model) for t, _ in batches]))
        base = tree_flops / throughput + args.overhead
    for row in rows:
        row["speedup"] = base / row["step_s"]
        row["efficiency"] = row["speedup"] / row["workers"]
        row["speedup_vs_unpacked"] = row["unpacked_step_s"] / row["step_s"]
    st0 = batches[0][1]
    return {
        "workload": args.workload, "scale": str(args.scale), "seeds": args.seeds,
        "model": f"{args.family}/{args.size}", "params": int(params),
        "sequences": st0.sequences, "total_tokens": st0.total_tokens,
        "unique_tokens": st0.unique_tokens, "sharing_ratio": st0.sharing_ratio,
        "assumptions": {"tflops_per_worker": args.tflops, "allreduce_gbs": args.bandwidth,
                        "grad_bytes": args.grad_bytes, "overhead_s": args.overhead,
                        "cost_model": "analytic FLOPs (dta.planning.cost.CostModel.from_config)"},
        "rows": rows,
    }


def print_table(result: dict, file=None) -> None:
    out = file or sys.stdout
    print(f"{result['workload']} ({result['scale']}, {result['seeds']} batches; first: "
          f"{result['sequences']} sequences, {result['total_tokens']:,} tokens, "
          f"{result['unique_tokens']:,} unique, sharing {result['sharing_ratio']:.2f}x); "
          f"model {result['model']} ({result['params'] / 1e6:.0f}M params)", file=out)
    a = result["assumptions"]
    print(f"projection: {a['tflops_per_worker']:g} TFLOP/s per worker, all-reduce "
          f"{a['allreduce_gbs']:g} GB/s, {a['overhead_s']:g} s overhead per step", file=out)
    head = (f"{'W':>3} {'step s':>8} {'compute':>8} {'allred':>7} {'speedup':>8} {'eff':>6} "
            f"{'imbal':>6} {'dup tok':>10} {'dup %':>6} {'vs unpacked':>11}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in result["rows"]:
        print(f"{r['workers']:>3} {r['step_s']:>8.3f} {r['compute_s']:>8.3f} "
              f"{r['allreduce_s']:>7.3f} {r['speedup']:>8.2f} {r['efficiency']:>6.2f} "
              f"{r['imbalance']:>6.3f} {r['duplicated_tokens']:>10,.0f} "
              f"{100 * r['duplicated_share']:>5.1f}% {r['speedup_vs_unpacked']:>10.2f}x",
              file=out)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    W = [r["workers"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(W, W, "k--", lw=1, label="ideal")
    ax1.plot(W, [r["speedup"] for r in rows], "o-", label="DFS, balanced (projected)")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log", base=2)
    ax1.set_xlabel("workers W")
    ax1.set_ylabel("speed-up over W = 1")
    ax1.set_title(f"{result['workload']} ({result['scale']}), {result['model']}")
    ax1.legend()
    ax1.grid(True, which="both", alpha=0.3)
    ax2.plot(W, [r["imbalance"] for r in rows], "o-", label="imbalance (max/mean)")
    ax2.plot(W, [1 + r["duplicated_share"] for r in rows], "s-",
             label="1 + duplicated / unique tokens")
    ax2.plot(W, [r["efficiency"] for r in rows], "^-", label="parallel efficiency")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("workers W")
    ax2.legend()
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = simulate(args)
    print_table(result)
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

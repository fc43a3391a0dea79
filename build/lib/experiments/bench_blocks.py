"""Memory bounded by a block: peak memory and step time of one training step (policy
recompute, the "small" model) against ``block_tokens``, on a prompt of 2,048 tokens shared by
4 leaves of 6,144 tokens (loss on the leaves only).

Without blocks a leaf is one 6,144-token call whose graph (and attention scores over the
8,192-token path) is alive at once; with blocks of B tokens no call and no live graph is
longer than B (``dta/planning/blocks.py``). Targets (issue 21): with blocks of 1,024 the peak
is <= 0.4 x the peak without blocks and the step time <= 1.15 x.

Each setting runs in a fresh process, settings interleaved over ``--repeats`` rounds. On CPU
two peaks are sampled every millisecond (``experiments/peak_memory.py``), over the process's
state after loading the model and batch and one 16-token step (which loads what a first
backward loads), the heap trimmed: the bytes allocated (live tensors and buffers: what CUDA's
``max_memory_allocated`` counts) and the resident set (which also holds what glibc freed but
kept); the warm-up is included (it has the timed step's peak). On CUDA both are
``max_memory_allocated`` over the memory allocated after the warm-up. A warm-up step (same
setting, same process) runs first unless ``--no-warmup``; the step time is the
timed step's wall time (median over the rounds), the peak the largest seen. ``--scale S``
multiplies every length (prompt, leaves, blocks, the LM head's chunk) by S for a quick check. Results (table,
JSON, plot) go to ``--out`` (default ``bench-out/blocks``); the last line of ``--json`` is
one JSON object.

    python -m experiments.bench_blocks [--device cuda] [--scale 1] [--repeats 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

BLOCKS = (0, 4096, 2048, 1024, 512)  # 0: no cut
DEFAULT_OUT = os.path.join("bench-out", "blocks")
TARGET_PEAK, TARGET_TIME, TARGET_BLOCK = 0.4, 1.15, 1024


def child(block: int, prompt: int, leaf_len: int, leaves: int, size: str, device: str,
          warmup: bool, threads: int, logits_chunk: int) -> dict:
    import time

    import numpy as np
    import torch

    from dta.batch import Batch
    from dta.losses import NLL
    from dta.model.models import build_model
    from dta.train import accumulate_gradients
    from experiments.bench_path_memory import shared_prefix_batch
    from experiments.peak_memory import PeakSampler

    if threads:
        torch.set_num_threads(threads)
    model = build_model("qwen3", size, seed=0, max_position_embeddings=max(
        32768, prompt + leaf_len)).to(device)
    batch, seqs, mask = shared_prefix_batch(model.config.vocab_size, prompt, leaf_len, leaves)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step():
        model.zero_grad(set_to_none=True)
        return accumulate_gradients(model, batch, NLL(), policy="recompute",
                                    block_tokens=block,
                                    logits_chunk=logits_chunk).walk

    # a 16-token step first: the libraries' code and thread pools a first backward loads
    # (~0.4 GB of RSS on CPU, whatever the step) are not the step's activations
    tiny = Batch.from_records([{"input_ids": s[:16], "loss_mask": np.ones(16)} for s in seqs[:2]])
    accumulate_gradients(model, tiny, NLL(), policy="recompute", block_tokens=block,
                         logits_chunk=logits_chunk)
    model.zero_grad(set_to_none=True)
    # CPU: the current RSS sampled every millisecond by a thread (ru_maxrss cannot see a
    # peak below the model's own load transient), from the RSS after the 16-token step with
    # the heap trimmed; CUDA: the allocator's peak, reset after the warm-up
    sampler = None if device.startswith("cuda") else PeakSampler().start()
    if warmup:
        step()
        sync()
    if device.startswith("cuda"):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    walk = step()
    sync()
    step_s = time.perf_counter() - t0
    if device.startswith("cuda"):
        peak = alloc = torch.cuda.max_memory_allocated() - base
    else:
        sampler.stop()
        peak, alloc = sampler.rss, sampler.allocated
    return {"block_tokens": block, "peak_mb": peak / 2**20, "step_s": step_s,
            "alloc_mb": None if alloc is None else alloc / 2**20,
            "max_call_tokens": walk.max_call_tokens, "max_graph_tokens": walk.max_graph_tokens,
            "forward_calls": walk.forward_calls, "recomputed_tokens": walk.recomputed_tokens}


def _label(block: int) -> str:
    return "none" if not block else f"{block:,}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS),
                   help="block_tokens values (0: no cut; default: 0 4096 2048 1024 512)")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--leaf-len", type=int, default=6144)
    p.add_argument("--leaves", type=int, default=4)
    p.add_argument("--logits-chunk", type=int, default=1024,
                   help="LM-head rows per chunk (the walker's default, 1024)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply prompt, leaf length, blocks and the head chunk by this "
                        "(quick checks)")
    p.add_argument("--size", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every setting")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: default)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    def scaled(n):
        return max(1, round(n * args.scale)) if n else 0

    prompt, leaf_len = scaled(args.prompt), scaled(args.leaf_len)
    if args.child is not None:
        print(json.dumps(child(args.child, prompt, leaf_len, args.leaves, args.size,
                               args.device, not args.no_warmup, args.threads,
                               scaled(args.logits_chunk))))
        return 0
    blocks = [scaled(b) for b in args.blocks]
    if 0 not in blocks:
        raise SystemExit("--blocks must include 0 (no cut): the ratios are against it")
    from tqdm import tqdm

    runs = [b for _ in range(args.repeats) for b in blocks]  # interleaved settings
    rows = []
    for b in tqdm(runs, desc="runs"):
        cmd = [sys.executable, "-m", "experiments.bench_blocks", "--child", str(b),
               "--prompt", str(args.prompt), "--leaf-len", str(args.leaf_len),
               "--leaves", str(args.leaves), "--scale", str(args.scale), "--size", args.size,
               "--logits-chunk", str(args.logits_chunk),
               "--device", args.device, "--threads", str(args.threads)] + (
            ["--no-warmup"] if args.no_warmup else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if out.returncode != 0:
            raise RuntimeError(f"block_tokens={b} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {}
    for b in blocks:
        mine = [r for r in rows if r["block_tokens"] == b]
        allocs = [r["alloc_mb"] for r in mine if r.get("alloc_mb") is not None]
        summary[b] = {"peak_mb": max(r["peak_mb"] for r in mine),
                      "alloc_mb": max(allocs) if allocs else None,
                      "step_s": statistics.median(r["step_s"] for r in mine),
                      "max_call_tokens": mine[0]["max_call_tokens"],
                      "forward_calls": mine[0]["forward_calls"]}
    none = summary[0]
    for s in summary.values():
        s["peak_ratio"] = s["peak_mb"] / none["peak_mb"] if none["peak_mb"] > 0 else None
        s["alloc_ratio"] = s["alloc_mb"] / none["alloc_mb"] \
            if s["alloc_mb"] is not None and none["alloc_mb"] else None
        s["time_ratio"] = s["step_s"] / none["step_s"]
    target_block = scaled(TARGET_BLOCK)
    lines = [f"one step, policy recompute, qwen3 {args.size}, {args.device}: prompt {prompt:,} "
             f"+ {args.leaves} leaves x {leaf_len:,} tokens (loss on the leaves), "
             f"{args.repeats} round(s)",
             f"{'block':>8} {'allocated MiB':>14} {'x none':>7} {'RSS MiB':>8} {'x none':>7} "
             f"{'step s':>8} {'x none':>7} {'longest call':>13} {'calls':>6}"]
    for b in blocks:
        s = summary[b]
        lines.append(f"{_label(b):>8} {s['alloc_mb'] or 0:14.0f} {s['alloc_ratio'] or 0:7.2f} "
                     f"{s['peak_mb']:8.0f} {s['peak_ratio'] or 0:7.2f} {s['step_s']:8.2f} {s['time_ratio']:7.2f} {s['max_call_tokens']:13,} "
                     f"{s['forward_calls']:6}")
    verdict = None
    if target_block in summary:
        s = summary[target_block]
        verdict = {"block_tokens": target_block, "alloc_ratio": s["alloc_ratio"],
                   "rss_ratio": s["peak_ratio"], "time_ratio": s["time_ratio"],
                   "alloc_ok": s["alloc_ratio"] is not None and s["alloc_ratio"] <= TARGET_PEAK,
                   "rss_ok": s["peak_ratio"] is not None and s["peak_ratio"] <= TARGET_PEAK,
                   "time_ok": s["time_ratio"] <= TARGET_TIME}
        lines.append(f"blocks of {target_block:,}: allocated peak {s['alloc_ratio'] or 0:.2f}x, "
                     f"RSS peak {s['peak_ratio'] or 0:.2f}x (target <= {TARGET_PEAK}), step time "
                     f"{s['time_ratio']:.2f}x (target <= {TARGET_TIME})")
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "blocks.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    result = {"size": args.size, "device": args.device, "prompt": prompt, "leaf_len": leaf_len,
              "logits_chunk": scaled(args.logits_chunk),
              "leaves": args.leaves, "scale": args.scale, "repeats": args.repeats,
              "results": {_label(b): summary[b] for b in blocks}, "target": verdict, "runs": rows}
    with open(os.path.join(args.out, "blocks.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot = os.path.join(args.out, "blocks.png")
    _plot(plot, blocks, summary, args, prompt, leaf_len)
    print(f"plot: {plot}")
    if args.json:
        print(json.dumps(result))
    return 0


def _plot(path, blocks, summary, args, prompt, leaf_len) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(blocks)))
    labels = [_label(b) for b in blocks]
    panels = [("peak_mb", "peak_ratio", "peak RSS growth (MiB)", "{:,.0f}"),
              ("step_s", "time_ratio", "step time (s)", "{:.2f}")]
    if all(summary[b]["alloc_mb"] is not None for b in blocks):
        panels.insert(0, ("alloc_mb", "alloc_ratio", "peak allocated (MiB)", "{:,.0f}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, ratio_key, ylabel, fmt) in zip(axes, panels):
        ys = [summary[b][key] for b in blocks]
        ax.bar(xs, ys, color="#4477aa")
        for x, y, b in zip(xs, ys, blocks):
            ratio = summary[b][ratio_key]
            ax.annotate(fmt.format(y) + (f"\n{ratio:.2f}x" if ratio is not None else ""),
                        (x, y), fontsize=8, xytext=(0, 3), textcoords="offset points",
                        ha="center")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("block_tokens")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0, top=max(1e-9, max(summary[b][key] for b in blocks)) * 1.25)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"one step, recompute, qwen3 {args.size} ({args.device}): prompt {prompt:,} + "
                 f"{args.leaves} leaves x {leaf_len:,}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

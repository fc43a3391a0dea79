"""Memory bounded by one path: peak memory of one training step as the number of leaves
under one shared prefix grows (1 -> 64), DFS (both policies) vs one padded batch.

Each point runs in a fresh process; on CPU the figure is the growth of peak RSS over the
process's peak after loading the model and batch (ru_maxrss), on CUDA max_memory_allocated.
The padded mode's memory grows with the leaves: a point whose estimated peak exceeds
``--padded-budget-mb`` (default 4096; 0: no limit) is skipped and reported as such, so the
default run cannot exhaust a shared machine. Results (table, JSON, plot) go to ``--out``
(default ``bench-out/path-memory``); nothing is written under ``results/`` unless ``--out``
says so.

    python -m experiments.bench_path_memory [--leaves 1 2 4 8 16 32 64] [--json] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = ("dfs-retain", "dfs-recompute", "padded")
DEFAULT_OUT = os.path.join("bench-out", "path-memory")


def padded_estimate_mb(leaves: int, prefix: int, leaf_len: int, size: str) -> float:
    """A generous estimate of the padded step's peak (float32): logits, their log-softmax and
    gradient ([B, S, V] x 3) plus ~24 activations of [B, S, hidden] per layer."""
    from dta.model.models import build_config

    cfg = build_config("qwen3", size)
    tokens = leaves * (prefix + leaf_len)
    per_token = 3 * cfg.vocab_size + 24 * cfg.hidden_size * cfg.num_hidden_layers
    return 1.35 * tokens * per_token * 4 / 2**20  # 1.35: measured on CPU (results/path_memory.txt)


def shared_prefix_batch(vocab: int, prefix: int, leaf_len: int, leaves: int, seed: int = 0):
    """``leaves`` random sequences sharing a ``prefix``-token prompt, the loss on the leaves:
    (the batch, the sequences, the loss mask every sequence shares)."""
    import numpy as np

    from dta.batch import Batch

    rng = np.random.default_rng(seed)
    shared = rng.integers(3, vocab, prefix)
    seqs = [np.concatenate([shared, rng.integers(3, vocab, leaf_len)]) for _ in range(leaves)]
    mask = np.r_[np.zeros(prefix), np.ones(leaf_len)]
    return Batch.from_records([{"input_ids": s, "loss_mask": mask} for s in seqs]), seqs, mask


def child(mode: str, leaves: int, prefix: int, leaf_len: int, size: str, device: str) -> dict:
    import resource
    import time

    import numpy as np
    import torch

    from dta.losses import NLL
    from dta.model.models import build_model
    from dta.train import accumulate_gradients

    torch.set_num_threads(2)
    model = build_model("qwen3", size, seed=0).to(device)
    batch, seqs, mask = shared_prefix_batch(model.config.vocab_size, prefix, leaf_len, leaves)

    def peak():
        if device == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB

    base = peak()
    t0 = time.perf_counter()
    if mode == "padded":  # one [B, S] batch, the loss mask's token mean
        ids = torch.as_tensor(np.stack(seqs), device=device)
        logits = model(input_ids=ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        m = torch.as_tensor(mask[1:], device=device, dtype=logp.dtype)
        (-(logp * m).sum() / (m.sum() * leaves)).backward()
    else:
        accumulate_gradients(model, batch, NLL(), policy=mode.split("-")[1])
    return {"mode": mode, "leaves": leaves, "peak_mb": peak() - base,
            "step_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leaves", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--leaf-len", type=int, default=64)
    p.add_argument("--size", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--plot", default=None, help="also write the PNG here")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for path_memory.txt/.json/.png (default {DEFAULT_OUT})")
    p.add_argument("--padded-budget-mb", type=float, default=4096.0,
                   help="skip padded points estimated above this peak (0: no limit)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("MODE", "LEAVES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.prefix, args.leaf_len,
                               args.size, args.device)))
        return 0

    from tqdm import tqdm

    rows, skipped = [], []
    runs = [(n, m) for n in args.leaves for m in args.modes]  # interleaved modes
    for n, mode in tqdm(runs, desc="runs"):
        if mode == "padded" and args.padded_budget_mb:
            est = padded_estimate_mb(n, args.prefix, args.leaf_len, args.size)
            if est > args.padded_budget_mb:
                skipped.append(f"padded with {n} leaves: estimated {est:,.0f} MiB > budget "
                               f"{args.padded_budget_mb:,.0f} MiB (--padded-budget-mb)")
                rows.append({"mode": mode, "leaves": n, "peak_mb": None, "skipped": skipped[-1]})
                continue
        cmd = [sys.executable, "-m", "experiments.bench_path_memory", "--child", mode, str(n),
               "--prefix", str(args.prefix), "--leaf-len", str(args.leaf_len),
               "--size", args.size, "--device", args.device]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if out.returncode != 0:
            raise RuntimeError(f"{mode} with {n} leaves failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = {m: {r["leaves"]: r["peak_mb"] for r in rows if r["mode"] == m} for m in args.modes}
    lines = [f"prefix {args.prefix} tokens + N leaves x {args.leaf_len} tokens, model "
             f"{args.size}, {args.device}: peak memory growth of one step (MiB)",
             "leaves " + "".join(f"{m:>15s}" for m in args.modes)]
    for n in args.leaves:
        lines.append(f"{n:6d} " + "".join(
            f"{'skipped':>15s}" if table[m][n] is None else f"{table[m][n]:15.0f}"
            for m in args.modes))
    lines += [f"skipped: {x}" for x in skipped]
    print("\n".join(lines))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "path_memory.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    result = {"prefix": args.prefix, "leaf_len": args.leaf_len, "size": args.size,
              "device": args.device, "peak_mb": table, "skipped": skipped}
    with open(os.path.join(args.out, "path_memory.json"), "w") as f:
        json.dump(result, f, indent=1)
    plots = [os.path.join(args.out, "path_memory.png")] + ([args.plot] if args.plot else [])
    if plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from experiments.bench.report import mode_color, model_label

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for m in args.modes:
            xs = [n for n in args.leaves if table[m][n] is not None]
            ys = [table[m][n] for n in xs]
            ax.plot(xs, ys, marker="o", label=m, color=mode_color(m))
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:,.0f}", (x, y), fontsize=7, xytext=(0, 4),
                            textcoords="offset points", ha="center")
        ax.set_xlabel("leaves under one shared prefix")
        ax.set_ylabel("peak memory growth (MiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(f"one step, {model_label({'family': 'qwen3', 'size': args.size})}, "
                     f"prefix {args.prefix} + leaves x {args.leaf_len}", fontsize=9)
        ax.legend()
        fig.tight_layout()
        for path in plots:
            fig.savefig(path, dpi=120)
            print(f"plot: {path}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

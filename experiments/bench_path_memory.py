"""Memory bounded by one path: peak memory of one training step as the number of leaves
under one shared prefix grows (1 -> 64), DFS (both policies) vs one padded batch.

Each point runs in a fresh process; on CPU the figure is the growth of peak RSS over the
process's peak after loading the model and batch (ru_maxrss), on CUDA max_memory_allocated.

    python -m experiments.bench_path_memory [--leaves 1 2 4 8 16 32 64] [--json] [--plot F]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MODES = ("dfs-retain", "dfs-recompute", "padded")


def child(mode: str, leaves: int, prefix: int, leaf_len: int, size: str, device: str) -> dict:
    import resource
    import time

    import numpy as np
    import torch

    from dta.batch import Batch
    from dta.losses import NLL
    from dta.models import build_model
    from dta.train import accumulate_gradients

    torch.set_num_threads(2)
    model = build_model("qwen3", size, seed=0).to(device)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, model.config.vocab_size, prefix)
    seqs = [np.concatenate([shared, rng.integers(3, model.config.vocab_size, leaf_len)])
            for _ in range(leaves)]
    mask = np.r_[np.zeros(prefix), np.ones(leaf_len)]
    batch = Batch.from_records([{"input_ids": s, "loss_mask": mask} for s in seqs])

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
    p.add_argument("--plot", default=None, help="write a PNG of peak memory vs leaves")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", nargs=2, metavar=("MODE", "LEAVES"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.prefix, args.leaf_len,
                               args.size, args.device)))
        return 0

    from tqdm import tqdm

    rows = []
    runs = [(n, m) for n in args.leaves for m in args.modes]  # interleaved modes
    for n, mode in tqdm(runs, desc="runs"):
        cmd = [sys.executable, "-m", "experiments.bench_path_memory", "--child", mode, str(n),
               "--prefix", str(args.prefix), "--leaf-len", str(args.leaf_len),
               "--size", args.size, "--device", args.device]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if out.returncode != 0:
            raise RuntimeError(f"{mode} with {n} leaves failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = {m: {r["leaves"]: r["peak_mb"] for r in rows if r["mode"] == m} for m in args.modes}
    print(f"prefix {args.prefix} tokens + N leaves x {args.leaf_len} tokens, model {args.size}, "
          f"{args.device}: peak memory growth of one step (MiB)")
    print("leaves " + "".join(f"{m:>15s}" for m in args.modes))
    for n in args.leaves:
        print(f"{n:6d} " + "".join(f"{table[m][n]:15.0f}" for m in args.modes))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for m in args.modes:
            ax.plot(args.leaves, [table[m][n] for n in args.leaves], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("leaves under one shared prefix")
        ax.set_ylabel("peak memory growth (MiB)")
        ax.set_title(f"one step, prefix {args.prefix} + leaves x {args.leaf_len}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")
    if args.json:
        print(json.dumps({"prefix": args.prefix, "leaf_len": args.leaf_len, "size": args.size,
                          "device": args.device, "peak_mb": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

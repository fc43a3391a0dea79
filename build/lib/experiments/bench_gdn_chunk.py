"""The GDN pack path's chunk size, measured: one DFS step (auto packs) of a hybrid model on a
τ²-shaped batch with the delta rule's chunk fixed at 16 / 32 / 64 / 128 and with the adaptive
rule (``dta.model.gdn``: a pack's chunk is the smallest power of two >= its longest segment, 16..64),
rounds interleaved, side by side in one run. Prints step times (median), their ratio to the
adaptive rule, and the scan's chunk steps and chunks per step; ``--json``: one JSON line.

    python -m experiments.bench_gdn_chunk --family qwen3_5 --scale small --repeats 3 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--size", default="small")
    p.add_argument("--workload", default="tau2-airline")
    p.add_argument("--scale", default="small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--policy", default="retain", choices=["retain", "recompute"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch
    from tqdm import tqdm

    from dta.losses import PPO
    from dta.model import gdn
    from dta.model.models import build_model
    from dta.train import accumulate_gradients
    from experiments.bench.worker import load_batch

    torch.set_num_threads(args.threads)
    model = build_model(args.family, args.size, dtype="float32")
    batch, _ = load_batch(dict(workload=args.workload, scale=args.scale), model.config.vocab_size)
    loss = PPO(eps_clip=0.2)
    settings = {"adaptive<=64": (64, True), "16": (16, False), "32": (32, False),
                "64": (64, False), "128": (128, False)}
    times = {k: [] for k in settings}
    counts = {}
    accumulate_gradients(model, batch, loss, policy=args.policy)  # warm-up (and self-check)
    with tqdm(total=args.repeats * len(settings), desc="steps") as bar:
        for _ in range(args.repeats):
            for name, (chunk, adaptive) in settings.items():
                gdn.CHUNK, gdn.ADAPTIVE = chunk, adaptive
                gdn.STATS.reset()
                model.zero_grad(set_to_none=True)
                t = time.perf_counter()
                accumulate_gradients(model, batch, loss, policy=args.policy, self_check=False)
                times[name].append(time.perf_counter() - t)
                counts[name] = gdn.STATS.as_dict()
                bar.update()
    gdn.CHUNK, gdn.ADAPTIVE = 64, True
    ref = statistics.median(times["adaptive<=64"])
    out = {name: dict(step_s=statistics.median(ts), over_adaptive=statistics.median(ts) / ref,
                      **counts[name]) for name, ts in times.items()}
    for name, r in out.items():
        print(f"chunk {name:>12}: step {r['step_s']:.2f} s ({r['over_adaptive']:.2f}x adaptive), "
              f"{r['gdn_chunk_steps']} chunk steps, {r['gdn_chunks']} chunks over "
              f"{r['gdn_calls']} GDN layer calls")
    if args.json:
        print(json.dumps(dict(family=args.family, size=args.size, workload=args.workload,
                              scale=args.scale, repeats=args.repeats, policy=args.policy,
                              chunks=out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

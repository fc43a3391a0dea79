"""Per-rank memory of the sharding modes at W = 2, measured beside the memory model.

A ~100M-parameter Qwen3-shaped model (hidden 768, 15 layers, vocabulary 4096, float32)
trains one DFS step on 2 local gloo ranks (``experiments.local_ranks.run_ranks``, the Ray
worker's code without Ray) in each mode. Measured per rank: the bytes of parameters,
gradients and optimizer state the mode holds at its peak (``state_bytes``: tensors actually
allocated — for fsdp including the layer parameters gathered during a call, sampled at each
layer's forward) and the process's peak RSS; predicted: ``dta.planning.memory.estimate``.
Not a timed test: ``python -m experiments.bench_sharding [--json]``.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

SHAPE = dict(hidden_size=768, num_hidden_layers=15, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=4096,
             tie_word_embeddings=False, max_position_embeddings=4096)
MODES = ("replicate", "zero1", "fsdp")


def _batch(vocab: int):
    from dta.batch import Batch

    rng = np.random.default_rng(0)
    prefix = rng.integers(1, vocab, 48)
    recs = [{"input_ids": np.concatenate([prefix, rng.integers(1, vocab, 16 + 4 * i)]),
             "loss_mask": None} for i in range(4)]
    for r in recs:
        r["loss_mask"] = np.r_[np.zeros(40, np.int64), np.ones(len(r["input_ids"]) - 40, np.int64)]
    return Batch.from_records(recs)


def one_rank(rank, world, mode):
    import torch

    from dta.config.schema import as_dict, load_config
    from dta.losses import batch_totals
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from runtime.ray_runtime import worker as worker_mod

    cfg = load_config(None, ["loss.name=nll", "walker.policy=recompute",
                             f"train.sharding={mode}", "model.dtype=float32"])
    original = worker_mod.build_replica

    def build(cfg_, device="cpu", dtype=None):  # the benchmark's model shape
        from dta.model.models import build_model
        return build_model("qwen3", SHAPE, dtype=dtype or "float32", seed=0).to(device)

    from omegaconf import OmegaConf

    from runtime.engine import resolve_run_config

    settings = resolve_run_config(OmegaConf.merge(cfg, {"ray": {"num_workers": world}}), None)
    worker_mod.build_replica = build
    try:
        w = worker_mod.DFSWorker(rank, world, as_dict(cfg), settings)
    finally:
        worker_mod.build_replica = original
    w.parallelize()  # run_ranks made the process group
    batch = _batch(SHAPE["vocab_size"])
    ids = assign_workers(PrefixTree(batch.input_ids), world).workers[rank]
    stats = w.step(0, batch.subset(ids) if ids else None, batch_totals(batch))
    n = sum(p.numel() for p in w.model.parameters()) if mode != "fsdp" else None
    del torch
    return {"state_bytes": stats["state_bytes"], "peak_rss": stats.get("peak_bytes"),
            "params": n, "tree": PrefixTree(batch.input_ids)}


def run() -> dict:
    from dta.planning.memory import ModelShape, batch_extent, estimate
    from experiments.local_ranks import run_ranks

    rows = []
    for mode in MODES:
        res = run_ranks(one_rank, 2, mode, timeout=1800)
        tree = res[0].pop("tree")
        path, node = batch_extent(tree)
        pred = estimate(SHAPE, 2, mode, path_tokens=path, call_tokens=node,
                        policy="recompute", compute_dtype="float32")
        per_rank = [r["state_bytes"] for r in res]
        worst = {k: max(sb[k] for sb in per_rank) for k in ("params", "grads", "optimizer")}
        rows.append({"mode": mode, "measured": worst, "measured_total": sum(worst.values()),
                     "per_rank": per_rank, "peak_rss": [r["peak_rss"] for r in res],
                     "predicted": {"params": pred.params, "grads": pred.grads,
                                   "optimizer": pred.optimizer},
                     "predicted_total": pred.state})
    base = rows[0]
    for r in rows:
        r["ratio_total"] = r["measured_total"] / base["measured_total"]
        r["ratio_optimizer"] = r["measured"]["optimizer"] / base["measured"]["optimizer"]
        r["predicted_ratio_total"] = r["predicted_total"] / base["predicted_total"]
    return {"model_params": ModelShape.of(SHAPE).params, "world": 2, "rows": rows,
            "fsdp_total_vs_replicate": rows[2]["ratio_total"],
            "zero1_optimizer_vs_replicate": rows[1]["ratio_optimizer"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_sharding",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object, last line")
    args = parser.parse_args(argv)
    out = run()
    mb = 2 ** 20
    print(f"~{out['model_params'] / 1e6:.0f}M parameters, W = 2, float32, per-rank peak MiB "
          "(measured | model)")
    print(f"{'mode':<10} {'params':>15} {'grads':>15} {'optimizer':>15} {'total':>15} "
          f"{'vs replicate':>13} {'peak RSS':>9}")
    for r in out["rows"]:
        cells = [f"{r['measured'][k] / mb:7.0f} | {r['predicted'][k] / mb:<5.0f}"
                 for k in ("params", "grads", "optimizer")]
        cells.append(f"{r['measured_total'] / mb:7.0f} | {r['predicted_total'] / mb:<5.0f}")
        rss = max(x or 0 for x in r["peak_rss"]) / mb
        print(f"{r['mode']:<10} " + " ".join(f"{c:>15}" for c in cells)
              + f" {r['ratio_total']:>6.3f}|{r['predicted_ratio_total']:.3f} {rss:>8.0f}")
    print(f"fsdp total / replicate: {out['fsdp_total_vs_replicate']:.3f} (<= 0.6); zero1 "
          f"optimizer / replicate: {out['zero1_optimizer_vs_replicate']:.3f} (<= 0.55)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

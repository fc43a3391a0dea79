"""Timing through verl's engine interface: one GRPO ``train_batch`` (forward, backward,
optimizer step) on the τ²-airline per-call batch, by the dta engine and by verl's own FSDP
engine (FSDP2) with ``use_remove_padding`` on (packed, one varlen call per micro-batch) and
off (right-padded micro-batches), in one process, rounds interleaved so that the three see the
same machine; the figure is the ratio of medians, FSDP time / dta time.

The batch, the loss (verl's ``ppo_loss``, token-mean) and the model (a random Qwen3 of
``dta.model.models.SIZES[--model-size]``, float32, vocabulary from the size) are the same for
the three; before timing, each engine's loss on the batch is computed and reported (they agree
to float32 rounding: tests/test_verl.py checks the gradients). CPU, through
``runtime.verl.use_cpu_platform``; not a test. ``python -m experiments.bench_verl [--json]``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

ENGINES = ("dta", "fsdp_rmpad", "fsdp_padded")


def _engine(kind: str, path: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from runtime.verl import DTAEngineConfig

    model = HFModelConfig(path=path, use_remove_padding=kind != "fsdp_padded",
                          override_config={"attn_implementation": "sdpa"})
    optim = FSDPOptimizerConfig(lr=1e-6, clip_grad=1.0, total_training_steps=100)
    common = dict(model_dtype="fp32", use_torch_compile=False, fsdp_size=1,
                  mixed_precision=dict(param_dtype="fp32", reduce_dtype="fp32",
                                       buffer_dtype="fp32"))
    if kind == "dta":
        engine = EngineRegistry.new("language_model", "dta", model_config=model,
                                    engine_config=DTAEngineConfig(**common),
                                    optimizer_config=optim, checkpoint_config=CheckpointConfig())
    else:
        engine = FSDPEngineWithLMHead(model_config=model,
                                      engine_config=FSDPEngineConfig(strategy="fsdp2", **common),
                                      optimizer_config=optim,
                                      checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def _batch(records, kind: str, max_tokens: int):
    """verl's dynamic micro-batching (``use_dynamic_bsz``, at most ``max_tokens`` tokens a
    micro-batch) for FSDP; the dta engine walks the whole batch as one tree."""
    from runtime.verl.records import records_to_verl

    return records_to_verl(records, temperature=1.0, use_remove_padding=kind != "fsdp_padded",
                           max_token_len=max_tokens if kind != "dta" else None)


def run(args) -> dict:
    from functools import partial

    import numpy as np
    import torch
    import torch.distributed as dist
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from dta.model.models import SIZES, build_model, save_word_tokenizer
    from dta.tree import PrefixTree
    from experiments.workloads import make_workload
    from runtime.verl import use_cpu_platform

    torch.set_num_threads(args.threads)
    use_cpu_platform()
    work = tempfile.mkdtemp(prefix="bench-verl-")
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=0,
                            world_size=1)
    try:
        vocab = SIZES[args.model_size]["vocab_size"]
        path = os.path.join(work, "model")
        build_model("qwen3", args.model_size, dtype="float32", seed=0).save_pretrained(path)
        save_word_tokenizer(path, vocab)
        records = make_workload("tau2-airline", scale=args.scale, seed=0,
                                vocab_size=vocab).records
        stats = PrefixTree([np.asarray(r["input_ids"]) for r in records]).stats()
        config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             loss_agg_mode="token-mean")
        loss = partial(ppo_loss, config)
        kinds = [k for k in ENGINES if k in args.engines]
        engines = {k: _engine(k, path) for k in kinds}
        losses = {}
        for k, e in engines.items():  # the same loss on the same weights (no step yet)
            e.optimizer_zero_grad()
            out = e.forward_backward_batch(_batch(records, k, args.max_tokens), loss)
            losses[k] = float(sum(out["loss"]))
        times = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for k, e in engines.items():
                td = _batch(records, k, args.max_tokens)
                start = time.perf_counter()
                e.train_batch(td, loss_function=loss)
                times[k].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        out = dict(workload="tau2-airline", scale=args.scale, model_size=args.model_size,
                   sequences=stats.sequences, total_tokens=stats.total_tokens,
                   unique_tokens=stats.unique_tokens, sharing_ratio=stats.sharing_ratio,
                   max_tokens=args.max_tokens, rounds=args.rounds, threads=args.threads,
                   loss={k: losses[k] for k in kinds}, seconds=times, median_s=med,
                   dta_walked_tokens=engines["dta"].last.get("dta_forwarded_tokens")
                   if "dta" in engines else None)
        if "dta" in med:
            out["speedup_vs_dta"] = {k: med[k] / med["dta"] for k in kinds if k != "dta"}
        return out
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="small", help="τ² workload scale (tiny, small, full, or "
                   "a number in (0, 1]); default small: 35 sequences, 24,545 tokens")
    p.add_argument("--model-size", default="small", help="dta.model.models.SIZES key")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="verl's max_token_len_per_gpu for the FSDP engine's dynamic micro-batches")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.max_tokens < 1 or args.threads < 1:
        p.error("--rounds, --max-tokens and --threads must be >= 1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run(args)
    if args.json:
        print(json.dumps(res))
        return
    print(f"τ²-airline {res['scale']}: {res['sequences']} sequences, {res['total_tokens']} "
          f"tokens, {res['unique_tokens']} unique ({res['sharing_ratio']:.2f}x); model "
          f"{res['model_size']}, {res['rounds']} rounds, {res['threads']} thread(s)")
    for k, v in res["median_s"].items():
        extra = f"  {res['speedup_vs_dta'][k]:.2f}x the dta engine's time" \
            if k in res.get("speedup_vs_dta", {}) else ""
        print(f"  {k:12s} train_batch median {v:8.3f} s  loss {res['loss'][k]:.6f}{extra}")


if __name__ == "__main__":
    sys.exit(main())

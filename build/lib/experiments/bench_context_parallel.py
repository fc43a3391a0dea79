"""Context parallelism on CPU: what each rank of a C-rank group computes, holds and sends for one
long-path training step (docs/context-parallel.md).

One batch: ``--rollouts`` rollouts of ``--rollout`` tokens on one ``--prompt``-token shared
prompt (loss on the rollouts), float32, policy recompute, blocks of ``--block`` tokens, on a
model whose attention has at least 4 K/V heads (default ``small-8x4``: the "small" model with
8 query heads over 4 K/V heads of 32, so C = 2 and 4 divide the heads). For each C in
``--sizes`` (default 1, 2, 4) a group of C gloo ranks walks it (one world of the largest C
is spawned once, ``dta.local_ranks``; each C runs on a group of its first C ranks while the
others wait; C = 1 runs the same code on a group of one), and each rank reports, for one
step:

* ``flops``: the matmul / attention FLOPs its process ran, counted by
  ``torch.utils.flop_counter.FlopCounterMode`` (a separate, counted step);
* ``cpu_s``: the CPU seconds its process used in the (uncounted) step, one thread per rank:
  the work a rank does, whatever the ranks sharing the 2 cores;
* ``sent_bytes``: what it sent to the other ranks in the step (all-to-alls forward and
  backward, the loss and router sums);
* ``path_kv_bytes``: the peak of its stored path K/V plus their gradient accumulators
  (counted tensors: ``ContextParallel.path_bytes_peak``);
* ``peak_alloc_bytes``: its peak allocated heap in the step (``experiments.peak_memory``);
* the group's gradient (the sum of the ranks' partial gradients) against C = 1's.

The same is run at a second path length: rollouts of ``--short`` tokens (default
``--rollout`` halved), as many more of them as keep the tokens walked -- and so the blocks --
the same (2 x 4,096 -> 4 x 2,048 on the same prompt: paths of 5,120 and 3,072 tokens, 9,216
tokens walked each): bytes sent per step then show whether communication follows the path
or the blocks. A last row walks the long batch with no context parallelism at all (the
walker alone, its attention through the split kernels; FLOPs counted with the CPU flash
op's formula) next to the C = 1 row of the group code.

Checks (``--json``'s ``passed``): per-rank FLOPs at C = 2 <= 0.58x and at C = 4 <= 0.30x
of C = 1's; path K/V at C = 2 <= 0.55x and at C = 4 <= 0.30x; the gradients of every C equal
C = 1's (float32 relative L2 <= 1e-5); bytes sent per step within 10 % between the two path
lengths. Wall times put C ranks on 2 cores: printed, not claimed.

    python -m experiments.bench_context_parallel [--json] [--prompt 1024 --rollout 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

FLOPS_TARGETS = {2: 0.58, 4: 0.30}
KV_TARGETS = {2: 0.55, 4: 0.30}
MODELS = {  # sizes beyond dta.model.models.SIZES: at least 4 K/V heads
    "small-8x4": dict(vocab_size=32000, hidden_size=256, intermediate_size=704,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=32, max_position_embeddings=32768),
}


def _flop_counter():
    """FlopCounterMode, with the CPU flash attention ops the walker alone uses counted as
    their CUDA counterparts are (torch counts those only)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, flop_registry

    aten = torch.ops.aten

    def same_as(op):  # the registered formula, taken as is (it reads the shapes itself)
        def count(*args, **kwargs):
            return flop_registry[op](*args, **kwargs)

        count._get_raw = True
        return count

    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu:
            same_as(aten._scaled_dot_product_flash_attention),
        aten._scaled_dot_product_flash_attention_for_cpu_backward:
            same_as(aten._scaled_dot_product_flash_attention_backward)})


def _rank(group, prompt: int, rollout: int, rollouts: int, block: int, size: str,
          plain: bool = False):
    import numpy as np
    import torch

    from dta.batch import Batch
    from dta.losses import NLL
    from dta.model.context_parallel import ContextParallel, parallelize_context
    from dta.model.models import build_model
    from dta.train import accumulate_gradients
    from experiments.peak_memory import PeakSampler

    model = build_model("qwen3", MODELS.get(size, size), dtype="float32", seed=0)
    cp = ContextParallel(group)
    if not plain:
        parallelize_context(model, cp)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, model.config.vocab_size, prompt)
    seqs = [np.concatenate([shared, rng.integers(3, model.config.vocab_size, rollout)])
            for _ in range(rollouts)]
    mask = np.r_[np.zeros(prompt), np.ones(rollout)]
    batch = Batch.from_records([{"input_ids": s, "loss_mask": mask} for s in seqs])
    tiny = Batch.from_records([{"input_ids": s[:16], "loss_mask": np.ones(16)} for s in seqs])
    kw = dict(policy="recompute", block_tokens=block)
    accumulate_gradients(model, tiny, NLL(), **kw)  # what a first backward loads
    model.zero_grad(set_to_none=True)
    with _flop_counter() as counter:  # a counted step (the counter slows the step down)
        accumulate_gradients(model, batch, NLL(), **kw)
    flops = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    cp.path_bytes_peak, sent0 = cp.path_bytes, cp.sent_bytes
    sampler = PeakSampler().start()
    t0, c0 = time.perf_counter(), time.process_time()
    res = accumulate_gradients(model, batch, NLL(), **kw)
    step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    sampler.stop()
    sent = cp.sent_bytes - sent0
    cp.sum_gradients(model)  # the group's gradient: the sum of the ranks' shares
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return dict(rank=cp.rank, flops=flops, path_kv_bytes=cp.path_bytes_peak,
                peak_alloc_bytes=sampler.allocated, sent_bytes=sent, step_s=step_s,
                cpu_s=cpu_s, loss=res.loss, forward_calls=res.walk.forward_calls,
                path_tokens=prompt + rollout, grads=grads if cp.rank == 0 else None)


def _configs(group, configs: list[dict]) -> list:
    """Every rank of one spawned world: each configuration on a group of its first C ranks
    (the others wait), one after the other."""
    import gc

    import torch.distributed as dist

    rank, out = dist.get_rank(group), []
    for cfg in configs:
        cfg = dict(cfg)
        size = cfg.pop("context_parallel")
        sub = dist.new_group(list(range(size)))  # every rank takes part in making it
        out.append(_rank(sub, **cfg) if rank < size else None)
        gc.collect()
        dist.barrier(group)
    return out


def run(configs: list[dict]) -> list[dict]:
    """Each configuration's ranks' results: one world of the largest C spawned once."""
    from dta.local_ranks import run_group

    world = max(c["context_parallel"] for c in configs)
    ranks = run_group(_configs, world, configs, timeout=3600)
    return [dict(context_parallel=c["context_parallel"], rollout=c["rollout"],
                 plain=c.get("plain", False),
                 ranks=[ranks[r][i] for r in range(c["context_parallel"])])
            for i, c in enumerate(configs)]


def _row(r, base, g1) -> dict:
    c, ranks = r["context_parallel"], r["ranks"]
    b1 = base["ranks"]
    kv = max(x["path_kv_bytes"] for x in ranks)
    flops = max(x["flops"] for x in ranks)
    g = ranks[0]["grads"]
    return dict(context_parallel=c, rollout=r["rollout"], plain=r["plain"],
                path_tokens=ranks[0]["path_tokens"],
                flops=[x["flops"] for x in ranks],
                flops_ratio=flops / max(max(x["flops"] for x in b1), 1),
                cpu_s=[x["cpu_s"] for x in ranks],
                cpu_ratio=max(x["cpu_s"] for x in ranks) / max(max(x["cpu_s"] for x in b1), 1e-9),
                path_kv_bytes=[x["path_kv_bytes"] for x in ranks],
                path_kv_ratio=kv / max(max(x["path_kv_bytes"] for x in b1), 1),
                peak_alloc_bytes=[x["peak_alloc_bytes"] for x in ranks],
                sent_bytes=[x["sent_bytes"] for x in ranks],
                sent_bytes_per_call=max(x["sent_bytes"] for x in ranks)
                / max(ranks[0]["forward_calls"], 1),
                step_s=[x["step_s"] for x in ranks], forward_calls=ranks[0]["forward_calls"],
                grad_rel_err=None if g1 is None else float((g - g1).norm() / g1.norm()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--rollout", type=int, default=4096)
    p.add_argument("--short", type=int, default=None,
                   help="the second rollout length (default: --rollout / 2)")
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--model", default="small-8x4",
                   help=f"{', '.join(MODELS)} or a dta.model.models.SIZES name")
    p.add_argument("--no-plain", dest="plain", action="store_false",
                   help="skip the row of the walker alone (no context parallelism)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if 1 not in args.sizes:
        raise SystemExit("bench_context_parallel: --sizes must include 1 (the baseline)")
    short = args.short or args.rollout // 2
    if (args.rollouts * args.rollout) % short:
        raise SystemExit(f"bench_context_parallel: --short {short} must divide the rollout tokens "
                         f"{args.rollouts} x {args.rollout} (the tokens walked are kept)")
    short_n = args.rollouts * args.rollout // short  # the same tokens walked, a shorter path
    common = dict(prompt=args.prompt, block=args.block, size=args.model)
    configs = [dict(common, context_parallel=c, rollout=args.rollout, rollouts=args.rollouts)
               for c in args.sizes] + \
        [dict(common, context_parallel=c, rollout=short, rollouts=short_n) for c in args.sizes]
    if args.plain:
        configs.append(dict(common, context_parallel=1, rollout=args.rollout,
                            rollouts=args.rollouts, plain=True))
    load = [os.getloadavg()[0]]  # other jobs on the machine inflate every CPU figure
    rows = run(configs)
    load.append(os.getloadavg()[0])
    long_rows = [r for r in rows if r["rollout"] == args.rollout and not r["plain"]]
    short_rows = [r for r in rows if r["rollout"] == short]
    plain_rows = [r for r in rows if r["plain"]]
    base_long = next(r for r in long_rows if r["context_parallel"] == 1)
    base_short = next(r for r in short_rows if r["context_parallel"] == 1)
    g1 = base_long["ranks"][0]["grads"]
    out = [_row(r, base_long, g1) for r in long_rows + plain_rows] + \
        [_row(r, base_short, base_short["ranks"][0]["grads"]) for r in short_rows]
    ok = True
    for row in out:
        c = row["context_parallel"]
        if row["plain"]:
            continue
        if c in FLOPS_TARGETS and row["flops_ratio"] > FLOPS_TARGETS[c]:
            ok = False
        if c in KV_TARGETS and row["path_kv_ratio"] > KV_TARGETS[c]:
            ok = False
        if not row["grad_rel_err"] <= 1e-5:
            ok = False
    print(f"context parallel, {args.rollouts} x {args.rollout:,} tokens on a {args.prompt:,}-token "
          f"prompt (and {short_n} x {short:,}), {args.model} model, float32, recompute, blocks of "
          f"{args.block:,}; per rank, the most of any rank:")
    print(f"  {'C':>5} {'rollout':>8} {'GFLOP':>8} {'x C=1':>6} {'CPU s':>7} {'x C=1':>6} "
          f"{'path K/V MiB':>13} {'x C=1':>6} {'peak MiB':>9} {'sent MiB':>9} {'step s':>7} "
          f"{'grad rel':>9}")
    for row in out:
        name = "alone" if row["plain"] else str(row["context_parallel"])
        print(f"  {name:>5} {row['rollout']:>8,} {max(row['flops']) / 1e9:>8.2f} "
              f"{row['flops_ratio']:>6.3f} {max(row['cpu_s']):>7.2f} {row['cpu_ratio']:>6.3f} "
              f"{max(row['path_kv_bytes']) / 2**20:>13.2f} {row['path_kv_ratio']:>6.3f} "
              f"{max(x or 0 for x in row['peak_alloc_bytes']) / 2**20:>9.1f} "
              f"{max(row['sent_bytes']) / 2**20:>9.2f} {max(row['step_s']):>7.2f} "
              f"{row['grad_rel_err']:>9.1e}")
    growth = {}
    for c in args.sizes:
        if c == 1:
            continue
        a = next(r for r in out if r["context_parallel"] == c and r["rollout"] == args.rollout
                 and not r["plain"])
        b = next(r for r in out if r["context_parallel"] == c and r["rollout"] == short)
        growth[c] = max(a["sent_bytes"]) / max(max(b["sent_bytes"]), 1)
        ok &= abs(growth[c] - 1) <= 0.10
    print("  bytes sent per step, long / short path (same tokens walked): " +
          ", ".join(f"C={c}: {g:.3f}" for c, g in growth.items()))
    print(f"  load average (1 min) at the start and the end: {load[0]:.1f}, {load[1]:.1f} "
          f"({os.cpu_count()} CPUs)")
    print(f"{'PASS' if ok else 'FAIL'}: per-rank FLOPs at C=2 <= 0.58x, C=4 <= 0.30x; path K/V "
          "at C=2 <= 0.55x, C=4 <= 0.30x; gradients equal C=1's (<= 1e-5); sent per step "
          "within 10 % across path lengths")
    if args.json:
        print(json.dumps(dict(rows=out, sent_per_step_growth={str(k): v for k, v in growth.items()},
                              short_rollouts=short_n, passed=bool(ok), prompt=args.prompt,
                              rollout=args.rollout, short=short, rollouts=args.rollouts,
                              block=args.block, model=args.model, load_average=load,
                              model_config=MODELS.get(args.model, args.model))))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

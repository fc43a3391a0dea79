"""The sharding layouts on one device: memory per layout, and prefetch's overlap in a profile.

Two stages, for the prepared GPU run (``experiments/bench/gpu.sh``; docs/gpu.md) and, small,
on CPU (tests/test_bench_layouts.py):

1. **memory**: replicate, zero1, zero2, fsdp, fsdp + prefetch and fsdp with the optimizer
   (``+offload``) or also the calls' gradient sum (``+gradients``) on the host, each one
   training step
   (the walk, the reduction, AdamW) on a 1-rank process group in this process (nccl on
   cuda, gloo on cpu; the mode built by ``runtime.sharding.make_sharding`` as the engine
   builds it): the device's peak allocated bytes (cuda; CPU: none) and the bytes the mode
   holds at its peak (``state_bytes``: parameters, gathered layers included, gradients,
   optimizer state). One rank shards nothing: what differs is what each layout keeps --
   the compute copy (replicate, zero1, zero2 whole; fsdp one layer at a time, two with
   prefetch), the fp32 masters, the gradients' dtype. (The planner prices one rank as
   replicate, so there is no per-layout figure to set beside these.)
2. **overlap**: fsdp with and without prefetch on ``--world`` local ranks
   (``experiments.local_ranks``: gloo; on cuda every rank on the one GPU, gloo staging its
   CUDA tensors), a warm-up step, then one step of rank 0 under ``torch.profiler``: the
   all-gathers' time (device kernels on cuda, CPU events on cpu, by name), the part of it
   covered by compute (the union of the other kernels / operators), its fraction, and the
   step's wall time. A Chrome trace of each profiled step is written beside (``--out``).

``python -m experiments.bench_layouts --device cuda --size qwen3-0.6b [--json]``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

LAYOUTS = ("replicate", "zero1", "zero2", "fsdp", "fsdp+prefetch", "fsdp+offload",
           "fsdp+gradients")  # +offload: train.offload=optimizer; +gradients: =gradients
COMM = ("allgather", "all_gather", "reducescatter", "reduce_scatter", "allreduce",
        "all_reduce", "nccl", "gloo", "memcpy", "memset", "c10d")


@dataclass(frozen=True)
class _OneRank:
    """What a mode reads of the engine's layout, for a 1-rank group (the engine's
    ``ParallelLayout`` makes one rank replicate: nothing to shard)."""
    prefetch: bool = False
    node_resident: bool = False
    offload: str = "none"
    expert_parallel: int = 1


def _config(size: str, scale: str, dtype: str, policy: str, extra=()):
    from dta.config.schema import load_config

    return load_config(None, [f"model.size={size}", f"workload.scale={scale}",
                              f"model.dtype={dtype}", f"walker.policy={policy}",
                              "optimizer.lr=1e-5", *extra])


def _batch(cfg, step: int):
    """The workload's batch of ``step`` (as ``dta train`` makes it from a generated workload,
    its advantages kept, its rewards dropped; vocabulary 512)."""
    from dta.batch import Batch
    from experiments.workloads import make_workload

    w = cfg.workload
    scale = str(w.scale)
    scale = scale if scale in ("tiny", "small", "full") else float(scale)
    vocab = int(w.vocab_size or 512)
    records = make_workload(w.name, scale=scale, seed=int(w.seed) + step,
                            vocab_size=vocab).records
    records = [{k: v for k, v in r.items() if k != "reward"} for r in records]
    return Batch.from_records(records, vocab_size=vocab)


# ----------------------------------------------------------------- 1. memory --
def memory(layout: str, cfg, device) -> dict:
    """One step of ``layout`` on a 1-rank group in this process (stage 1)."""
    import torch
    import torch.distributed as dist

    from dta.losses import batch_totals
    from dta.train import accumulate_gradients
    from runtime.engine.step import optimizer_step
    from runtime.ray_runtime.worker import build_replica, make_training_loss
    from runtime.sharding import make_sharding, sharding_class
    from runtime.sharding.common import optimizer_factory

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    name, *knobs = layout.split("+")
    offload = "gradients" if "gradients" in knobs else "optimizer" if "offload" in knobs \
        else "none"
    compute = getattr(torch, str(cfg.model.dtype))
    model = build_replica(cfg, device=device, dtype=sharding_class(name).storage_dtype(compute))
    policy = str(cfg.walker.policy)
    mode = make_sharding(name, model, optimizer_factory(cfg.optimizer), group=dist.group.WORLD,
                         compute_dtype=compute, policy=policy,
                         layout=_OneRank(prefetch="prefetch" in knobs, offload=offload))
    batch = _batch(cfg, 0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    mode.zero_grad()
    accumulate_gradients(mode.model, batch, make_training_loss(cfg), policy=policy,
                         totals=batch_totals(batch))
    mode.release_gathered()  # the lockstep's end on more ranks
    optimizer_step(mode, cfg.optimizer.max_grad_norm)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    held = mode.state_bytes()
    del mode, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"layout": layout, "peak_bytes": peak, "state_bytes": held,
            "state_total": sum(held[k] for k in ("params", "grads", "optimizer")),
            "step_s": wall}


# ---------------------------------------------------------------- 2. overlap --
def _union(spans: list) -> list:
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _covered(spans: list, by: list) -> float:
    """Length of ``spans`` (a union) covered by ``by`` (a union)."""
    total, j = 0.0, 0
    for a, b in spans:
        while j < len(by) and by[j][1] <= a:
            j += 1
        k = j
        while k < len(by) and by[k][0] < b:
            total += min(b, by[k][1]) - max(a, by[k][0])
            k += 1
    return total


def overlap_of(events, device_type: str) -> dict:
    """All-gather time of a profiled step and the part of it covered by compute. The
    all-gathers: the device's all-gather kernels (nccl) where there are any, else the CPU
    events of the gathers (gloo: the host runs the transfer); the compute: on cuda the
    device kernels that are neither communication nor copies, on cpu the top-level operators
    of the profiled thread (a gather's own inner operators are not compute beside it)."""
    from torch.autograd import DeviceType

    kernels, cpu_gathers, compute = [], [], []
    for e in events:
        if e.time_range.end <= e.time_range.start:
            continue
        name, span = e.name.lower(), (e.time_range.start, e.time_range.end)
        gather = ("allgather" in name or "all_gather" in name) and "copy" not in name
        if e.device_type == DeviceType.CUDA:
            if gather:
                kernels.append(span)
            elif not any(c in name for c in COMM):
                compute.append(span)
        elif e.device_type == DeviceType.CPU:
            if gather:
                cpu_gathers.append(span)
            elif device_type == "cpu" and name.startswith("aten::") and e.cpu_parent is None:
                compute.append(span)
    gathers = kernels or cpu_gathers
    g, c = _union(gathers), _union(compute)
    total = sum(b - a for a, b in g)
    hidden = _covered(g, c)
    return {"gathers_from": "device kernels" if kernels else "cpu events",
            "all_gathers": len(gathers), "all_gather_us": total, "overlapped_us": hidden,
            "overlap_fraction": hidden / total if total else 0.0}


def _profiled(rank, world, size, scale, dtype, out_dir, use_gpu):
    """On each local rank, fsdp without then with prefetch: a warm-up step, then one step
    profiled on rank 0 (stage 2); returns rank 0's rows."""
    import gc

    import torch
    from omegaconf import OmegaConf

    from dta.config.schema import as_dict
    from dta.losses import batch_totals
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from runtime.engine import resolve_run_config
    from runtime.ray_runtime.worker import DFSWorker

    torch.set_num_threads(1)
    rows = []
    for prefetch in (False, True):
        cfg = _config(size, scale, dtype, "recompute",
                      ["train.sharding=fsdp", f"train.prefetch={str(prefetch).lower()}"])
        settings = resolve_run_config(OmegaConf.merge(cfg, {"ray": {"num_workers": world}}),
                                      None)
        w = DFSWorker(rank, world, as_dict(cfg), settings, use_gpu=use_gpu)
        w.parallelize()  # run_ranks made the process group
        def step(k):
            batch = _batch(cfg, k)
            ids = assign_workers(PrefixTree(batch.input_ids), world).workers[rank]
            return w.step(k, batch.subset(ids) if ids else None, batch_totals(batch))

        step(0)  # warm-up
        acts = [torch.profiler.ProfilerActivity.CPU]
        if w.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        if rank != 0:
            step(1)
        else:
            with torch.profiler.profile(activities=acts) as prof:
                t0 = time.perf_counter()
                step(1)
                wall = time.perf_counter() - t0
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                prof.export_chrome_trace(os.path.join(out_dir,
                                                      f"fsdp-prefetch-{prefetch}.json.gz"))
            rows.append({"prefetch": prefetch, "step_s": wall,
                         **overlap_of(prof.events(), w.device.type)})
            del prof
        del w
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def overlap(size, scale, dtype, world, out_dir, use_gpu) -> list:
    from experiments.local_ranks import run_ranks

    try:
        return run_ranks(_profiled, world, size, scale, dtype, out_dir, use_gpu,
                         timeout=600.0)[0]
    except Exception as exc:  # noqa: BLE001 (reported: the memory rows stand)
        why = str(exc).strip().splitlines()[-1][:300]
        return [{"prefetch": ahead, "error": why} for ahead in (False, True)]


# ------------------------------------------------------------------------ main --
def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="python -m experiments.bench_layouts",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="qwen3-0.6b")
    p.add_argument("--scale", default="0.05", help="workload.scale of the τ² batch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policy", default="recompute", choices=("recompute", "retain"))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--world", type=int, default=2, help="ranks of the overlap stage (0: skip)")
    p.add_argument("--out", default=None, help="folder for the profiles' Chrome traces")
    p.add_argument("--json", action="store_true", help="one JSON object, last line")
    args = p.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts: unknown {bad} (choose from {', '.join(LAYOUTS)})")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = _config(args.size, args.scale, args.dtype, args.policy)
    mib = 2 ** 20
    rows = []
    print(f"memory per layout, one rank ({args.size}, {args.dtype}, {args.policy}, "
          f"{args.device}); MiB: device peak | state held (params, grads, optimizer; host)")
    for layout in layouts:
        r = memory(layout, cfg, device)
        rows.append(r)
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / mib:.0f}"
        held = ", ".join(f"{r['state_bytes'][k] / mib:.1f}" for k in ("params", "grads",
                                                                        "optimizer"))
        print(f"  {layout:<14} {peak:>8} {r['state_total'] / mib:>9.1f} ({held}; "
              f"{r['state_bytes']['host'] / mib:.1f})  "
              f"step {r['step_s']:.2f} s")
    prof = []
    if args.world > 0:
        prof = overlap(args.size, args.scale, args.dtype, args.world, args.out,
                       device.type == "cuda")
        for r in prof:
            if "error" in r:
                print(f"fsdp{' + prefetch' if r['prefetch'] else ''} on {args.world} ranks: "
                      f"failed: {r['error']}")
                continue
            print(f"fsdp{' + prefetch' if r['prefetch'] else ''} on {args.world} ranks, rank 0: "
                  f"{r['all_gathers']} all-gathers ({r['gathers_from']}), "
                  f"{r['all_gather_us'] / 1e3:.1f} ms, "
                  f"{r['overlap_fraction']:.2f} of it under compute; step {r['step_s']:.2f} s")
    if args.json:
        print(json.dumps({"device": args.device, "size": args.size, "dtype": args.dtype,
                          "policy": args.policy, "memory": rows, "world": args.world,
                          "overlap": prof}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

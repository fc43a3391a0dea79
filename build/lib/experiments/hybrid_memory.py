"""Where a step's memory goes: live tensor bytes at the step's peak, attributed to source lines.

One step of one bench mode (``microbatch``, ``dfs-retain``, ``dfs-recompute``, ...) on a
workload batch, run under a dispatch mode that follows every tensor storage an op allocates
until it is freed (forward and backward): the step's peak of live bytes, and at that peak the
live bytes grouped by where they were made (the innermost frame in ``dta/`` or
``transformers/models/``, or ``backward``), largest first. Also the process's RSS growth (as
the benchmark measures it), the walk's calls and the GDN scan's chunk steps. CPU, slow (every
op is intercepted): use it for attribution, not timing.

    python -m experiments.hybrid_memory --family qwen3_5 --scale small --mode dfs-retain --json
    python -m experiments.hybrid_memory --mode microbatch --top 15
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import weakref

_ROOTS = (os.sep + "dta" + os.sep, os.sep + "transformers" + os.sep + "models" + os.sep)


def _where() -> str:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if any(r in name for r in _ROOTS) and not name.endswith("hybrid_memory.py"):
            short = name.split(os.sep + "dta" + os.sep)[-1] if os.sep + "dta" + os.sep in name \
                else name.split(os.sep + "models" + os.sep)[-1]
            return f"{short}:{f.f_lineno}"
        f = f.f_back
    return "backward/other"


def tracker():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytes(TorchDispatchMode):
        """Live bytes of storages made by ops (each counted once, until freed)."""

        def __init__(self):
            super().__init__()
            self.live, self.peak, self.by, self.at_peak, self.seen = 0, 0, {}, {}, set()

        def _free(self, key, label, n):
            self.seen.discard(key)
            self.live -= n
            self.by[label] -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            label = None
            made_before = {t.untyped_storage().data_ptr()  # views of inputs (parameters too)
                           for t in torch.utils._pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
            for t in torch.utils._pytree.tree_leaves(out):
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                    continue
                st = t.untyped_storage()
                key = st.data_ptr()
                n = st.nbytes()
                if key in self.seen or key in made_before or n == 0:
                    continue
                if label is None:
                    label = f"{_where()} {func.__name__.split('.')[0]}"
                self.seen.add(key)
                self.live += n
                self.by[label] = self.by.get(label, 0) + n
                weakref.finalize(st, self._free, key, label, n)
                if self.live > self.peak:
                    if self.live > self.peak + (1 << 20) or not self.at_peak:
                        self.at_peak = {k: v for k, v in self.by.items() if v > 0}
                    self.peak = self.live
            return out

    return LiveBytes()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_5")
    p.add_argument("--size", default="small")
    p.add_argument("--workload", default="tau2-airline")
    p.add_argument("--scale", default="small")
    p.add_argument("--mode", default="dfs-retain")
    p.add_argument("--pack-tokens", type=int, default=None)
    p.add_argument("--packing", default=None)
    p.add_argument("--head-rows", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--no-track", action="store_true", help="RSS only (no dispatch mode)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import gc
    import resource

    import torch

    from dta.losses import PPO
    from dta.model.models import build_model
    from experiments.bench.modes import run_mode
    from experiments.bench.worker import PeakSampler, load_batch, rss_bytes, warmup_batch

    torch.set_num_threads(args.threads)
    model = build_model(args.family, args.size, dtype="float32")
    batch, _ = load_batch(dict(workload=args.workload, scale=args.scale), model.config.vocab_size)
    loss = PPO(eps_clip=0.2)
    opts = {k: v for k, v in dict(pack_tokens=args.pack_tokens, packing=args.packing,
                                  head_rows=args.head_rows).items() if v is not None}
    run_mode(args.mode, model, warmup_batch(batch), loss, **opts)  # warm-up (and self-check)
    model.zero_grad(set_to_none=True)
    gc.collect()
    base, max0 = rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampler = PeakSampler(0.002)
    sampler.start()
    mode = None if args.no_track else tracker()
    if mode is not None:
        with mode:
            _, calls = run_mode(args.mode, model, batch, loss, **opts)
    else:
        _, calls = run_mode(args.mode, model, batch, loss, **opts)
    peak = sampler.stop()
    max1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = (max(peak, max1 if max1 > max0 else 0) - base) / 2**20
    out = dict(mode=args.mode, family=args.family, scale=args.scale, opts=opts,
               rss_growth_mb=rss, calls={k: v for k, v in calls.items() if k != "plan"})
    print(f"{args.mode} {opts}: RSS growth {rss:.0f} MB; calls {out['calls']}")
    if mode is not None:
        top = sorted(mode.at_peak.items(), key=lambda kv: -kv[1])[: args.top]
        out.update(peak_live_mb=mode.peak / 2**20,
                   at_peak_mb={k: v / 2**20 for k, v in top})
        print(f"peak live tensor bytes {mode.peak / 2**20:.1f} MB; at the peak:")
        for k, v in top:
            print(f"  {v / 2**20:8.1f} MB  {k}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

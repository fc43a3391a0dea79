"""One measured run in a fresh process: ``python -m experiments.bench.worker SPEC.json``.

The spec (written by :mod:`experiments.bench.run`) names the workload, the model, the mode
and where to write the result (JSON) and the flattened gradient (``.npy``). The process:

1. sets ``torch.set_num_threads(threads)``, builds the batch and the model (same seeds in
   every run, so every mode trains the same parameters on the same batch);
2. warm-up (``warmup``: small | full | none): by default one step of the same mode on a
   2-sequence batch cut from the real one (the last 96 tokens of one sequence, and a copy
   forked 8 tokens before its end): it pays one-time costs (lazy initialization, first-call
   dispatch, allocator growth) on every code path the mode uses (fork, padding, mask,
   chunked head) for about 1 % of a step on CPU. ``full`` warms up on the real batch (the
   GPU script: kernel autotuning and FlexAttention compilation depend on the shapes). Then
   ``zero_grad(set_to_none=True)``, as a training loop would;
3. baseline memory (RSS, or CUDA allocated), then the timed step, with a background thread
   sampling RSS every ``sample_ms``; the peak growth is the larger of the sampled peak and,
   when the step raised the process's high-water mark, ``ru_maxrss`` (exact) minus the
   baseline. On CUDA: ``max_memory_allocated`` minus the allocated baseline;
   what else ran meanwhile (:func:`disturbance`: other processes' CPU and the host's steal,
   in cores) is recorded with it, and the machine's speed just before (:func:`probe_gflops`),
   so a disturbed run can be told from a slow one;
4. saves the gradient (float32; a fixed strided sample per parameter when the model has more
   than ``grad_full_max`` parameters) and the result.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import sys
import threading
import time
import traceback

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_times() -> tuple[float, float] | None:
    """The machine's busy and steal CPU seconds so far (``/proc/stat``; None where absent):
    busy = user + nice + system + irq + softirq over all cores; steal = time the hypervisor
    gave this machine's cores to someone else."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / TICK, steal / TICK


def disturbance(before, after, own_cpu_s: float, step_s: float) -> dict:
    """What else ran during a timed step, in cores on average: other processes' CPU (the
    machine's busy time less this process's) and the hypervisor's steal."""
    if before is None or after is None or step_s <= 0:
        return dict(others_cores=None, steal_cores=None)
    others = max(after[0] - before[0] - own_cpu_s, 0.0)
    return dict(others_cores=others / step_s, steal_cores=(after[1] - before[1]) / step_s)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler(threading.Thread):
    def __init__(self, interval_s: float):
        super().__init__(daemon=True)
        self.interval, self.peak, self._done = interval_s, rss_bytes(), threading.Event()

    def run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._done.wait(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def probe_gflops(seconds: float = 0.25, n: int = 384) -> float:
    """The machine's speed just now: GFLOP/s of fp32 [n, n] @ [n, n] products for about
    ``seconds`` on this process's threads. Beside a step, it tells a slow machine (another
    tenant, frequency scaling) from a slow mode; it is measured, never used to correct."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    count, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        a @ b
        count += 1
    return 2 * n ** 3 * count / dt / 1e9


def load_batch(spec: dict, vocab_size: int):
    """(the batch, its workload) of a spec: the generated workload, or the ``input`` JSONL
    (already checked and cut by the harness; its workload's ``params`` name the file)."""
    from dta.batch import Batch
    from experiments.workloads import make_workload

    if spec.get("input"):
        import types

        from dta.records.jsonl import read_jsonl

        records = read_jsonl(spec["input"], vocab_size=vocab_size)
        return Batch.from_records(records), types.SimpleNamespace(
            params=dict(input=spec["input"]), records=records)

    wl = make_workload(spec["workload"], scale=spec["scale"], seed=spec.get("seed", 0),
                       vocab_size=vocab_size, **spec.get("overrides", {}))
    return Batch.from_records(wl.records), wl


def warmup_batch(batch):
    """Two short sequences that fork near their end, cut from the batch's first trainable one."""
    import numpy as np

    from dta.batch import Batch

    i = next(k for k in range(len(batch)) if batch.loss_mask(k).any())
    ids, mask = batch.input_ids[i][-96:].copy(), batch.loss_mask(i)[-96:].copy()
    mask[0] = 0
    if not mask.any():
        mask[len(mask) // 2:] = 1
    fork = ids.copy()
    fork[-8:] = (fork[-8:] + 1) % max(int(batch.input_ids[i].max()) + 1, 2)
    recs = []
    for s in (ids, fork):
        rec = {"input_ids": s, "loss_mask": mask}
        for k, v in batch.fields.items():
            if k != "loss_mask":
                rec[k] = v[i][-96:]
        recs.append(rec)
    out = Batch.from_records(recs)
    if not all(np.array_equal(out.loss_mask(k), mask) for k in range(2)):
        raise RuntimeError("warm-up batch: the loss mask did not survive Batch.from_records")
    return out


def flat_grad(model, full_max: int):
    import numpy as np
    import torch

    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    stride = max(1, -(-n // full_max)) if n > full_max else 1
    parts = []
    for p in params:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts.append(g.detach().reshape(-1)[::stride].float().cpu())
    return np.concatenate([x.numpy() for x in parts]), stride


class Context:
    """The loaded model, batch and loss of a worker (built once, used by every run)."""

    def __init__(self, spec: dict):
        import torch

        torch.set_num_threads(int(spec.get("threads", 2)))
        from dta.losses import make_loss
        from dta.model.models import build_model, load_model
        from experiments.bench.inputs import model_config

        self.spec, self.device = spec, spec.get("device", "cpu")
        self.cuda = self.device.startswith("cuda")
        config = model_config(spec.get("model_path"), spec["family"], spec["size"],
                              spec.get("vocab_size"))
        self.batch, _ = load_batch(spec, config.vocab_size)
        if spec.get("model_path"):  # a local directory: its weights, then to the device
            self.model = load_model(spec["model_path"], dtype=spec.get("dtype", "float32"),
                                    attn_implementation=spec.get("attn", "sdpa")).to(self.device)
        else:
            with torch.device(self.device):  # initialize on the device (fast for 1B+ models)
                self.model = build_model(spec["family"], spec["size"],
                                         dtype=spec.get("dtype", "float32"),
                                         seed=spec.get("model_seed", 0),
                                         attn_implementation=spec.get("attn", "sdpa"),
                                         **({} if spec.get("vocab_size") is None else
                                            {"vocab_size": spec["vocab_size"]}))
        self.loss = make_loss(spec.get("loss", "ppo"))
        self.opts = dict(spec.get("opts", {}))
        self.warmed: set = set()

    def sync(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()


def measure(ctx: Context, mode: str, repeat: int, grad_path: str) -> dict:
    import numpy as np
    import torch

    from experiments.bench.modes import run_mode

    spec, model, batch = ctx.spec, ctx.model, ctx.batch
    warm = spec.get("warmup", "small")
    warm = {True: "small", False: "none"}.get(warm, warm)
    t = time.perf_counter()
    if warm != "none" and (mode not in ctx.warmed or warm == "full"):
        run_mode(mode, model, warmup_batch(batch) if warm == "small" else batch, ctx.loss, **ctx.opts)
        ctx.sync()
        ctx.warmed.add(mode)
    warm_s = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    gc.collect()
    probe = probe_gflops() if not ctx.cuda else None
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    base_rss, maxrss0 = rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampler = PeakSampler(float(spec.get("sample_ms", 2)) / 1000)
    sampler.start()
    cpu0 = cpu_times()
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    value, calls = run_mode(mode, model, batch, ctx.loss, **ctx.opts)
    ctx.sync()
    step_s = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu1 = cpu_times()
    peak_rss = sampler.stop()
    maxrss1 = ru1.ru_maxrss * 1024
    peak_cpu = max(peak_rss, maxrss1 if maxrss1 > maxrss0 else 0) - base_rss
    peak = (torch.cuda.max_memory_allocated() - base) if ctx.cuda else peak_cpu
    grad, stride = flat_grad(model, int(spec.get("grad_full_max", 64_000_000)))
    np.save(grad_path, grad)
    model.zero_grad(set_to_none=True)
    tokens = int(batch.lengths.sum())
    return dict(
        mode=mode, repeat=repeat, ok=True, loss=float(value), calls=calls,
        step_s=step_s, warmup_s=warm_s, tokens=tokens, tokens_per_s=tokens / step_s,
        peak_mem_mb=peak / 2**20, peak_rss_growth_mb=peak_cpu / 2**20,
        baseline_rss_mb=base_rss / 2**20, maxrss_exact=maxrss1 > maxrss0,
        user_s=ru1.ru_utime - ru0.ru_utime, sys_s=ru1.ru_stime - ru0.ru_stime,
        probe_gflops=probe,
        **disturbance(cpu0, cpu1, ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime,
                      step_s),
        threads=torch.get_num_threads(), device=ctx.device, grad_stride=stride,
        grad_norm=float(np.linalg.norm(grad.astype(np.float64))),
        params=sum(p.numel() for p in model.parameters()), grad_path=grad_path)


def _failure(mode, repeat, e: BaseException) -> dict:
    return dict(mode=mode, repeat=repeat, ok=False, error=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc())


def main(argv=None) -> int:
    """Spec with ``mode``/``repeat``/``grad_path``: one run. With ``runs`` (a list of
    ``{mode, repeat, grad_path}``): all of them in this process (the GPU script's way: no
    model load per run; CUDA peaks are per run, CPU RSS peaks are not), the result file
    (a JSON list) rewritten after each run so a killed worker leaves what it finished."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    runs = spec.get("runs") or [dict(mode=spec["mode"], repeat=spec.get("repeat", 0),
                                     grad_path=spec["grad_path"])]
    results = []
    try:
        ctx = Context(spec)
    except Exception as e:  # reported in the table, not fatal to the harness
        results = [_failure(r["mode"], r["repeat"], e) for r in runs]
        ctx = None
    for r in runs if ctx is not None else []:
        try:
            results.append(measure(ctx, r["mode"], r["repeat"], r["grad_path"]))
        except Exception as e:
            ctx.model.zero_grad(set_to_none=True)
            results.append(_failure(r["mode"], r["repeat"], e))
        with open(spec["result_path"], "w") as f:
            json.dump(results if "runs" in spec else results[0], f)
    if ctx is None or "runs" not in spec:
        with open(spec["result_path"], "w") as f:
            json.dump(results if "runs" in spec else results[0], f)
    return 0 if all(x["ok"] for x in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where a step's time goes: one profiled step of each mode, side by side, by kind of work.

    python -m experiments.bench.profile --scale 0.2 --modes microbatch,dfs-retain --json

In one process (2 threads, the same model, batch and loss for every mode, each mode warmed
up first on the bench's 2-sequence cut), one step of each mode runs under the PyTorch
profiler. Its self CPU time is split into

``matmul``     the matrix-product kernels (``aten::mm``, ``addmm``, ``bmm``, ...): the decoder
               body's projections and the LM head;
``attention``  the SDPA kernels (CPU flash forward and backward, the math fallback);
``other``      every other operator (element-wise, norms, copies, indexing, autograd nodes);
``outside``    the step's wall time outside any operator (Python, dispatch, the profiler's own
               cost): wall − all self time;

each beside the FLOPs :mod:`experiments.bench.flops` gives that kind of work in that mode
(matmul: body + head; attention: the pairs the kernels execute). Against the first mode (the
baseline) it prints, per kind, the time ratio (baseline / mode) next to the FLOP ratio: a
kind whose time ratio falls short of its FLOP ratio runs less efficiently in the mode than in
the baseline. The profiler adds a per-operator cost, so times are a little above an
unprofiled step's; the ratios are what to read. Writes ``results.json``, ``results.md`` and
``profile.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

MATMUL = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::addmv",
          "aten::mv", "aten::dot")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
             "aten::_scaled_dot_product_attention_math",
             "aten::_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_efficient_attention_backward",
             "aten::_scaled_dot_product_flash_attention",
             "aten::_scaled_dot_product_flash_attention_backward",
             "aten::_flash_attention_forward", "aten::_flash_attention_backward")
KINDS = ("matmul", "attention", "other", "outside")


def kind_of(op: str) -> str:
    if op in MATMUL:
        return "matmul"
    if op in ATTENTION:
        return "attention"
    return "other"


def by_kind(self_us: dict[str, float], wall_s: float) -> dict[str, float]:
    """Seconds per kind from per-operator self CPU microseconds and the step's wall time."""
    out = {k: 0.0 for k in KINDS}
    for op, us in self_us.items():
        out[kind_of(op)] += us / 1e6
    out["outside"] = max(wall_s - sum(out[k] for k in KINDS[:3]), 0.0)
    return out


def self_times(step) -> tuple[float, dict[str, float]]:
    """(wall seconds, self CPU microseconds per operator) of ``step()`` under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        step()
        wall = time.perf_counter() - t
    self_us: dict[str, float] = {}
    for e in prof.key_averages():
        self_us[e.key] = self_us.get(e.key, 0.0) + e.self_cpu_time_total
    return wall, self_us


def profiled_step(mode: str, model, batch, loss, opts: dict) -> tuple[float, dict[str, float]]:
    """:func:`self_times` of one step of ``mode``, from and back to zeroed gradients."""
    from experiments.bench.modes import run_mode

    model.zero_grad(set_to_none=True)
    out = self_times(lambda: run_mode(mode, model, batch, loss, **opts))
    model.zero_grad(set_to_none=True)
    return out


def compare(rows: dict[str, dict]) -> dict[str, dict]:
    """Per mode after the first: baseline / mode for each kind's time and FLOPs, and the whole
    step's."""
    names = list(rows)
    base = rows[names[0]]
    out = {}
    for m in names[1:]:
        r = rows[m]
        ratio = {k: (base["seconds"][k] / r["seconds"][k] if r["seconds"][k] else None) for k in KINDS}
        ratio["step"] = base["wall_s"] / r["wall_s"]
        flops = {k: base["flops"][k] / r["flops"][k] if r["flops"][k] else None
                 for k in ("matmul", "attention")}
        flops["step"] = base["flops"]["total"] / r["flops"]["total"]
        out[m] = dict(time_ratio=ratio, flop_ratio=flops)
    return out


def markdown(out: dict) -> str:
    names = list(out["modes"])
    lines = [f"# Where the time goes: {out['workload']} scale {out['scale']} ({out['date']}, "
             f"{out['model']}, fp32, {out['threads']} threads, one profiled step per mode)", "",
             "| mode | wall s | " + " | ".join(f"{k} s" for k in KINDS)
             + " | matmul GFLOP | attention GFLOP | matmul GFLOP/s | attention GFLOP/s |",
             "|---|---:|" + "---:|" * len(KINDS) + "---:|---:|---:|---:|"]
    for m in names:
        r = out["modes"][m]
        s, f = r["seconds"], r["flops"]
        rate = {k: (f[k] / 1e9 / s[k] if s[k] else 0.0) for k in ("matmul", "attention")}
        lines.append(f"| {m} | {r['wall_s']:.2f} | " + " | ".join(f"{s[k]:.2f}" for k in KINDS)
                     + f" | {f['matmul'] / 1e9:,.0f} | {f['attention'] / 1e9:,.0f} | "
                     f"{rate['matmul']:.1f} | {rate['attention']:.1f} |")
    lines += ["", f"Against {names[0]} (its time / the mode's; FLOP ratio in brackets):", ""]
    for m, c in out["compare"].items():
        t, f = c["time_ratio"], c["flop_ratio"]
        parts = [f"step {t['step']:.2f}× ({f['step']:.2f}×)",
                 f"matmul {t['matmul']:.2f}× ({f['matmul']:.2f}×)",
                 f"attention {t['attention']:.2f}× ({f['attention']:.2f}×)",
                 f"other {t['other']:.2f}×" if t["other"] else "other –",
                 f"outside {t['outside']:.2f}×" if t["outside"] else "outside –"]
        lines.append(f"- {m}: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    """Seconds per kind of work, one group of bars per mode (linear axis, values shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["modes"])
    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / len(KINDS)
    for j, k in enumerate(KINDS):
        xs = [i + (j - (len(KINDS) - 1) / 2) * width for i in range(len(names))]
        ys = [out["modes"][m]["seconds"][k] for m in names]
        ax.bar(xs, ys, width, label=k)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("seconds in one profiled step")
    ax.set_title(f"Where the time goes: {out['workload']} scale {out['scale']} ({out['date']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    import torch
    from tqdm import tqdm

    from experiments.bench.flops import mode_flop_parts
    from experiments.bench.modes import MODES, run_mode
    from experiments.bench.worker import Context, warmup_batch

    ap = argparse.ArgumentParser(prog="python -m experiments.bench.profile")
    ap.add_argument("--workload", default="tau2-airline")
    ap.add_argument("--scale", default="small")
    ap.add_argument("--modes", default="microbatch,dfs-retain",
                    help="comma-separated; the first is the baseline (default: microbatch,dfs-retain)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-size", default="small")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if len(modes) < 2 or unknown:
        ap.error(f"--modes: at least two of {', '.join(MODES)}" + (f"; unknown {unknown}" if unknown else ""))
    ctx = Context(dict(workload=args.workload, scale=args.scale, family="qwen3",
                       size=args.model_size, threads=args.threads))
    model, batch, loss = ctx.model, ctx.batch, ctx.loss
    rows = {}
    with tqdm(total=2 * len(modes), desc="profile", unit="step") as bar:
        for m in modes:  # warm-up of every mode first, then the profiled steps back to back
            bar.set_postfix_str(f"warm-up {m}")
            run_mode(m, model, warmup_batch(batch), loss)
            bar.update(1)
        for m in modes:
            bar.set_postfix_str(m)
            wall, self_us = profiled_step(m, model, batch, loss, {})
            parts = mode_flop_parts(m, batch, model.config)
            rows[m] = dict(wall_s=wall, seconds=by_kind(self_us, wall),
                           flops=dict(matmul=parts.body + parts.head, attention=parts.attention,
                                      total=parts.total),
                           top_ops_s=dict(sorted(((k, v / 1e6) for k, v in self_us.items()),
                                                 key=lambda kv: -kv[1])[:12]))
            bar.update(1)
    out = dict(date=time.strftime("%Y-%m-%d %H:%M"), workload=args.workload, scale=args.scale,
               model=f"qwen3-{args.model_size}", threads=torch.get_num_threads(), modes=rows,
               compare=compare(rows))
    dest = Path(args.out or f"results/profile-{time.strftime('%Y-%m-%d-%H%M')}")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "results.json").write_text(json.dumps(out, indent=1))
    (dest / "results.md").write_text(markdown(out))
    plot(out, dest / "profile.png")
    print(markdown(out))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

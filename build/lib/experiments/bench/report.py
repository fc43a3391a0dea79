"""Markdown table and matplotlib plots of benchmark results (see :mod:`experiments.bench.run`)."""
from __future__ import annotations

import os
from pathlib import Path

DISTURBED_CORES = 0.1  # a run during which others or the host took more is listed


def _f(x, fmt="{:.2f}", none="–"):
    return none if x is None else fmt.format(x)


def _calls(c) -> str:
    if not c:
        return "–"
    out = "/".join(str(c.get(k, "–")) for k in ("forward_calls", "backward_calls", "head_calls"))
    if "gdn_chunk_steps" in c:  # a hybrid model: the GDN layers' sequential chunk iterations
        out += f" ({c['gdn_chunk_steps']} GDN chunk steps)"
    return out


def _disturbance(point: dict) -> list[str]:
    """What else ran during the timed steps: the worst run, the runs over the threshold, and
    the machine's speed just before each step (experiments.bench.worker records them)."""
    d = point["summary"].get("disturbance")
    if not d or d.get("others_cores_max") is None:
        return []
    hit = [f"{r['mode']} round {r['repeat']} ({r.get('others_cores') or 0:.2f} / "
           f"{r.get('steal_cores') or 0:.2f})" for r in point.get("runs", [])
           if r.get("ok") and max(r.get("others_cores") or 0, r.get("steal_cores") or 0)
           > DISTURBED_CORES]
    text = (f"Disturbance (the most in any timed step, in cores on average over the step, "
            f"beside the run's own {d['threads']} threads): other processes "
            f"{d['others_cores_max']:.2f}, the host's steal {d['steal_cores_max']:.2f}. Per "
            f"mode: column *others*. Disturbed runs (others / steal above {DISTURBED_CORES} "
            f"cores): " + (", ".join(hit) if hit else "none") + ".")
    probes = [x for x in d.get("probe_gflops") or [] if x is not None]
    if probes:
        text += (f" Machine speed just before each timed step (fp32 GEMM probe): "
                 f"{min(probes):.0f}–{max(probes):.0f} GFLOP/s.")
    return ["", text]


def table(point: dict) -> str:
    s, info = point["summary"], point["info"]
    lines = [
        f"**{point['label']}**: {info['sequences']} sequences, {info['total_tokens']:,} tokens, "
        f"{info['unique_tokens']:,} unique (sharing {info['sharing_ratio']:.2f}×), "
        f"{info['trainable_tokens']:,} trainable; ideal speed-up (FLOPs of "
        f"{info['ideal_baseline']} / FLOPs of the tree, every unique token once: dfs-node) "
        f"**{s['ideal_speedup']:.2f}×**"
        + (f" (planning cost model, LM head on every token: "
           f"{info['ideal_speedup_cost_model']:.2f}×)" if "ideal_speedup_cost_model" in info
           else "")
        + f"; best unpacked baseline: {s['best_baseline']}.",
        "",
        "| mode | step s (median) | tokens/s | speed-up | of ideal | GFLOP | GFLOP/s | peak MB "
        "| mem/padded | mem/baseline | calls fwd/bwd/head | packs | user/sys s | others "
        "| grad rel err | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, m in s["modes"].items():
        lines.append("| " + " | ".join([
            mode, _f(m["step_s"]), _f(m["tokens_per_s"], "{:,.0f}"),
            _f(m.get("speedup"), "{:.2f}×"), _f(m.get("speedup_vs_ideal"), "{:.0%}"),
            _f(m["flops"] / 1e9 if m["flops"] else None, "{:,.0f}"),
            _f(m["gflops_per_s"], "{:.1f}"),
            _f(m["peak_mem_mb"], "{:,.0f}"), _f(m.get("mem_ratio_padded"), "{:.2f}"),
            _f(m.get("mem_ratio_baseline"), "{:.2f}"), _calls(m.get("calls")),
            _f((m.get("calls") or {}).get("packs"), "{}"),
            f"{_f(m['user_s'], '{:.0f}')}/{_f(m['sys_s'], '{:.0f}')}",
            _f(m.get("others_cores_max"), "{:.2f}"),
            _f(m["grad_rel_err"], "{:.1e}"),
            m["status"] + (f" ({m['failed']} failed: {m['error'][:60]})" if m["failed"] else ""),
        ]) + " |")
    hl = s.get("headline")
    if hl and hl.get("refused"):  # the fastest DFS mode's gradients are wrong or unchecked
        lines += ["", f"**{hl['refused'][0].upper()}{hl['refused'][1:]}.**"]
    elif hl:
        lines += ["", f"Fastest DFS mode: **{hl['best_dfs']}**, "
                      f"{_f(hl.get('of_ideal'), '{:.2f}')}× the ideal speed-up"
                  + (f"; treemask's step time / its own: {_f(hl.get('over_treemask'), '{:.2f}')}× "
                     f"(median over rounds); peak memory "
                     f"{_f(hl.get('mem_over_treemask'), '{:.2f}')}× the tree mask's"
                     if "over_treemask" in hl else "") + "."]
        if hl.get("best_within_memory"):
            lines += ["", f"Fastest DFS mode within the baseline's peak memory: "
                          f"**{hl['best_within_memory']}**, "
                          f"{_f(hl.get('within_memory_of_ideal'), '{:.2f}')}× the ideal speed-up at "
                          f"{_f(hl.get('within_memory_mem_ratio'), '{:.2f}')}× the memory; "
                          f"{_f(hl.get('within_memory_calls'), '{}')} decoder calls for "
                          f"{_f(hl.get('nodes'), '{}')} tree nodes."]
        elif hl.get("within_memory_refused"):
            lines += ["", f"Within the baseline's peak memory: {hl['within_memory_refused']}."]
    lines += _disturbance(point)
    pol = s.get("policy")
    if pol:
        lines += ["", f"Memory policy: recompute / retain = {pol['recompute_time_over_retain']:.2f}× "
                      f"time, {_f(pol['recompute_mem_over_retain'])}× peak memory."]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    c = results["config"]
    head = [f"# DTA benchmark: {batch_label(results)}", "",
            f"Model {model_label(c)} ({c['dtype']}, {c['attn']}) on {c['device']}, "
            f"{c['threads']} threads, loss {c['loss']} (global token mean); {c['repeats']} "
            f"repeats, modes interleaved, "
            + ("all runs in one process" if c.get("in_process") else "each run in a fresh process")
            + {"small": ", each after a warm-up step on a 2-sequence batch",
               "full": ", each mode after a warm-up step on the full batch"}.get(c["warmup"], "")
            + ". "
            "Speed-up: median over rounds of (best unpacked baseline's step time / the mode's); "
            "peak memory: "
            + ("peak RSS growth over the loaded model and batch (CPU)." if c["device"] == "cpu"
               else "torch.cuda.max_memory_allocated over the loaded model and batch.")
            + " GFLOP: what the mode executes (dense masks count every masked-away pair); "
            "GFLOP/s: that over the step time. Calls: decoder forwards / backward calls / LM-head "
            "calls of the DFS walk (baselines: forwards / backwards)."
            + f" Gradient error: relative L2 against {'microbatch' if 'microbatch' in c['modes'] else c['modes'][0]}"
            f" (tolerance {results['points'][0]['summary']['tolerance']:.0e}; WRONG above it).", ""]
    return "\n".join(head + [table(p) + "\n" for p in results["points"]])


# One colour per mode, the same in every plot (tab10 order), whatever modes a run has.
MODE_COLORS = {"padded": "C0", "microbatch": "C1", "treemask": "C2", "treemask-flex": "C3",
               "dfs-retain": "C4", "dfs-recompute": "C5"}


def mode_color(mode: str) -> str:
    if mode in MODE_COLORS:
        return MODE_COLORS[mode]
    return f"C{6 + sum(map(ord, mode)) % 4}"  # an unknown mode: stable, away from the above


def batch_label(results: dict) -> str:
    """The benchmarked batch: the workload and scale, or the --input file and its cut."""
    c = results["config"]
    if not c.get("input"):
        return f"{c['workload']} (scale {c['scale']}, seed {c['seed']})"
    k = results.get("input_cut") or {}
    cut = (f"{k['kept_sequences']:,} of {k['sequences']:,} sequences, {k['kept_tokens']:,} of "
           f"{k['tokens']:,} tokens" if k else "")
    return f"{os.path.basename(c['input'])} ({cut})" if cut else os.path.basename(c["input"])


def model_label(c: dict) -> str:
    """``family-size (N params)`` or the model directory's name: the parameter count from the
    model config (no weights)."""
    from experiments.bench.inputs import model_config, model_name

    name = model_name(c.get("model_path"), c["family"], c["size"], c.get("vocab_size"))
    try:
        import torch
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                model_config(c.get("model_path"), c["family"], c["size"], c.get("vocab_size")))
        n = sum(p.numel() for p in model.parameters())
        return f"{name} ({n / 1e9:.2f}B params)" if n >= 1e9 else f"{name} ({n / 1e6:.1f}M params)"
    except Exception:
        return name


def _label_bars(ax, bars, values, fmt) -> None:
    for bar, v in zip(bars, values):
        ax.annotate(fmt(v) if v else "–", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")


def plots(results: dict, out: Path) -> list[str]:
    """Bars per mode (one point) or lines over the sweep: throughput and peak memory. Linear
    axes from 0, values written on the bars, one fixed colour per mode, the model (with its
    parameter count) in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts, sweep = results["points"], results["config"]["sweep"]
    modes = list(results["config"]["modes"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    metrics = (("tokens_per_s", "throughput (original tokens / s)"),
               ("peak_mem_mb", "peak memory (MB)"))
    if len(pts) == 1 or not sweep:
        s = pts[0]["summary"]["modes"]
        for ax, (key, label) in zip(axes, metrics):
            vals = [s[m][key] or 0 for m in modes]
            bars = ax.bar(range(len(modes)), vals, color=[mode_color(m) for m in modes])
            _label_bars(ax, bars, vals, lambda v: f"{v:,.0f}")
            ax.set_xticks(range(len(modes)), modes, rotation=30, ha="right")
            ax.set_ylabel(label)
            ax.set_ylim(0, max(vals + [1]) * 1.15)
            ax.grid(axis="y", alpha=0.3)
        name = "modes.png"
    else:
        if sweep == "batch":
            xs, xlabel = [p["info"]["sequences"] for p in pts], "sequences per batch"
        else:
            xs, xlabel = [p["info"]["sharing_ratio"] for p in pts], "sharing ratio (total / unique)"
        order = sorted(range(len(pts)), key=lambda k: xs[k])
        for ax, (key, label) in zip(axes, metrics):
            for m in modes:
                ys = [pts[k]["summary"]["modes"][m][key] for k in order]
                ax.plot([xs[k] for k in order], [y if y else float("nan") for y in ys],
                        "o-", color=mode_color(m), label=m)
                for x, y in zip([xs[k] for k in order], ys):
                    if y:
                        ax.annotate(f"{y:,.0f}", (x, y), fontsize=7, xytext=(0, 3),
                                    textcoords="offset points", ha="center")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        name = f"sweep-{sweep}.png"
    c = results["config"]
    fig.suptitle(f"{batch_label(results)} · {model_label(c)} {c['dtype']} · {c['device']}")
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return [str(out / name)]

"""The benchmark harness: every (mode, repeat) in a fresh process, modes interleaved.

    python -m experiments.bench.run --workload tau2-airline --scale small     (or `dta bench`)

Runs go ``a b c d e a b c d e ...`` (one round per repeat), so a slow phase of a noisy
machine hits every mode alike; the table reports medians, and the speed-up of a mode over
the best unpacked baseline is the median of the per-round ratios. Each child saves its
flattened gradient; the parent compares it with the reference mode's (``microbatch``,
one sequence at a time) and flags a mode whose relative L2 error exceeds the tolerance.
Output, under ``--out``: ``results.json`` (config, workload stats, FLOPs, every run, the
summary), ``results.md`` and plots (see :mod:`experiments.bench.report`).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from experiments.bench.config import TOLERANCE, BenchConfig  # noqa: F401 (re-exported)
from experiments.bench.modes import MODES

ROOT = Path(__file__).resolve().parents[2]


def sweep_points(cfg: BenchConfig) -> list[tuple[str, dict]]:
    """(label, workload overrides) per point. batch: task (group) counts; sharing: group
    sizes, ``nothink`` (no thinking: the trunk dominates) or ``nothink@G``."""
    if not cfg.sweep:
        return [("base", dict(cfg.overrides))]
    if cfg.sweep == "batch":
        return [(f"B{v}", {**cfg.overrides, "tasks": int(v)})
                for v in (cfg.sweep_values or "1,2,4").split(",")]
    if cfg.sweep == "sharing":
        points = []
        for v in (cfg.sweep_values or "2,4,nothink@4").split(","):
            kw = dict(cfg.overrides)
            if v.startswith("nothink"):
                kw["thinking"] = False
                v = v.partition("@")[2]
            if v:
                kw["group_size"] = int(v)
            points.append(("nothink" if kw.get("thinking") is False else "think")
                          + (f"-G{v}" if v else ""))
            points[-1] = (points[-1], kw)
        return points
    raise ValueError(f"unknown sweep {cfg.sweep!r}; choose batch or sharing")


def point_info(cfg: BenchConfig, overrides: dict) -> dict:
    """Workload statistics and FLOPs of one point (computed in the parent, cheaply)."""
    from dta.tree import PrefixTree
    from experiments.bench.flops import summary
    from experiments.bench.inputs import model_config
    from experiments.bench.worker import load_batch

    config = model_config(cfg.model_path, cfg.family, cfg.size, cfg.vocab_size)
    batch, wl = load_batch(dict(workload=cfg.workload, scale=cfg.scale, seed=cfg.seed,
                                overrides=overrides, input=cfg.input), config.vocab_size)
    st = PrefixTree(batch.input_ids).stats()
    info = dict(sequences=st.sequences, total_tokens=st.total_tokens,
                unique_tokens=st.unique_tokens, sharing_ratio=st.sharing_ratio,
                max_length=st.max_length, tree_nodes=st.nodes, tree_depth=st.depth,
                trainable_tokens=int(sum(batch.loss_mask(i).sum() for i in range(len(batch)))),
                workload_params=wl.params)
    info.update(summary(batch, config, list(cfg.modes), cfg.opts()))
    return info


def _spawn(cfg: BenchConfig, spec: dict, tmp: str, tag: str, timeout: float) -> list[dict]:
    """Run a worker on ``spec`` (one run, or ``runs``); its results, failures included."""
    runs = spec.get("runs") or [dict(mode=spec["mode"], repeat=spec["repeat"],
                                     grad_path=spec["grad_path"])]
    spec = dict(spec, result_path=os.path.join(tmp, f"{tag}.json"))
    spec_path = os.path.join(tmp, f"{tag}.spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), MKL_NUM_THREADS=str(cfg.threads),
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t, why = time.perf_counter(), None
    try:
        proc = subprocess.run([sys.executable, "-m", "experiments.bench.worker", spec_path],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        why = f"worker exited {proc.returncode}: {proc.stderr[-600:]}"
    except subprocess.TimeoutExpired:
        why = f"timed out after {timeout:.0f} s"
    done = []
    if os.path.exists(spec["result_path"]):
        with open(spec["result_path"]) as f:
            done = json.load(f)
        done = done if isinstance(done, list) else [done]
    wall = (time.perf_counter() - t) / max(len(done), 1)
    out = []
    for k, r in enumerate(runs):  # a killed worker (memory, timeout) leaves runs undone
        res = done[k] if k < len(done) else dict(ok=False, error=why)
        res.update(mode=r["mode"], repeat=r["repeat"], wall_s=wall)
        res["grad_path"] = r["grad_path"] if res.get("ok") else None
        out.append(res)
    return out


def _rel_err(path: str, ref: np.ndarray) -> float:
    g = np.load(path).astype(np.float64)
    return float(np.linalg.norm(g - ref) / max(np.linalg.norm(ref), 1e-300))


def run_point(cfg: BenchConfig, label: str, overrides: dict, tmp: str, bar) -> list[dict]:
    """All (repeat, mode) runs of one point, interleaved; gradient errors vs the reference."""
    ref_mode = "microbatch" if "microbatch" in cfg.modes else cfg.modes[0]
    base = dict(workload=cfg.workload, scale=cfg.scale, seed=cfg.seed, overrides=overrides,
                family=cfg.family, size=cfg.size, model_path=cfg.model_path, input=cfg.input,
                vocab_size=cfg.vocab_size,
                dtype=cfg.dtype, device=cfg.device,
                attn=cfg.attn, loss=cfg.loss, threads=cfg.threads, warmup=cfg.warmup,
                opts=cfg.opts(), sample_ms=cfg.sample_ms, grad_full_max=cfg.grad_full_max)
    order = [dict(mode=m, repeat=r, grad_path=os.path.join(tmp, f"{label}-{m}-{r}.npy"))
             for r in range(cfg.repeats) for m in cfg.modes]
    if cfg.in_process:
        bar.set_postfix_str(f"{label}: {len(order)} runs in one process")
        batches = [_spawn(cfg, dict(base, runs=order), tmp, f"{label}-all", cfg.timeout)]
    else:
        batches = (_spawn(cfg, dict(base, **o), tmp, f"{label}-{o['mode']}-{o['repeat']}",
                          cfg.timeout) for o in order)
    runs, ref = [], None
    for batch in batches:
        for res in batch:
            res["point"] = label
            runs.append(res)
            bar.update(1)
            bar.set_postfix_str(f"{label} {res['mode']} #{res['repeat']} "
                                f"{res.get('step_s', float('nan')):.1f}s")
            if ref is None and res["mode"] == ref_mode and res["ok"]:
                ref = np.load(res["grad_path"]).astype(np.float64)
            if ref is not None:  # compare every pending gradient, then drop its file
                for x in runs:
                    if x.get("grad_path"):
                        x["grad_rel_err"] = _rel_err(x["grad_path"], ref)
                        os.remove(x["grad_path"])
                        x["grad_path"] = None
    for x in runs:
        x["grad_reference"] = ref_mode
        if x.get("grad_path") and os.path.exists(x["grad_path"]):
            os.remove(x["grad_path"])
        x.pop("grad_path", None)
    return runs


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def summarize(cfg: BenchConfig, runs: list[dict], info: dict) -> dict:
    """Per mode: medians, speed-up over the best unpacked baseline (median of per-round
    ratios), memory ratios, gradient error and its verdict."""
    modes = {}
    for mode in cfg.modes:
        ok = [x for x in runs if x["mode"] == mode and x["ok"]]
        failed = [x for x in runs if x["mode"] == mode and not x["ok"]]
        step = _median([x["step_s"] for x in ok])
        errs = [x["grad_rel_err"] for x in ok if x.get("grad_rel_err") is not None]
        flops = info["flops"].get(mode)
        modes[mode] = dict(
            runs=len(ok), failed=len(failed), error=failed[0]["error"] if failed else None,
            step_s=step, tokens_per_s=info["total_tokens"] / step if step else None,
            step_s_all=[x["step_s"] for x in ok],
            peak_mem_mb=_median([x["peak_mem_mb"] for x in ok]),
            peak_mem_mb_max=max((x["peak_mem_mb"] for x in ok), default=None),
            user_s=_median([x.get("user_s") for x in ok]), sys_s=_median([x.get("sys_s") for x in ok]),
            grad_rel_err=max(errs) if errs else None, flops=flops,
            gflops_per_s=flops / step / 1e9 if flops and step else None,
            calls=ok[0].get("calls") if ok else None,
            others_cores_max=_max([x.get("others_cores") for x in ok]),
            steal_cores_max=_max([x.get("steal_cores") for x in ok]))
        m = modes[mode]
        m["grad_ok"] = None if m["grad_rel_err"] is None else m["grad_rel_err"] <= cfg.tol
        m["status"] = ("FAILED" if not ok else "WRONG" if m["grad_ok"] is False
                       else "ok" if m["grad_ok"] else "unchecked")
    baselines = [m for m in cfg.modes if MODES[m].unpacked and modes[m]["step_s"]]
    best = min(baselines, key=lambda m: modes[m]["step_s"]) if baselines else None
    pad_mem = modes.get("padded", {}).get("peak_mem_mb")
    best_mem = modes[best]["peak_mem_mb"] if best else None
    for mode, m in modes.items():
        if best and m["step_s"]:
            ratios = [a["step_s"] / b["step_s"] for a in runs for b in runs
                      if a["mode"] == best and b["mode"] == mode and a["ok"] and b["ok"]
                      and a["repeat"] == b["repeat"]]
            m["speedup"] = _median(ratios)
            m["speedup_of_medians"] = modes[best]["step_s"] / m["step_s"]
            m["speedup_vs_ideal"] = m["speedup"] / info["ideal_speedup"] if m["speedup"] else None
        if m["peak_mem_mb"] is not None:
            m["mem_ratio_padded"] = m["peak_mem_mb"] / pad_mem if pad_mem else None
            m["mem_ratio_baseline"] = m["peak_mem_mb"] / best_mem if best_mem else None
    out = dict(best_baseline=best, sharing_ratio=info["sharing_ratio"],
               ideal_speedup=info["ideal_speedup"], tolerance=cfg.tol, modes=modes)
    out["headline"] = headline(runs, modes)
    out["disturbance"] = dict(
        others_cores_max=_max([x.get("others_cores") for x in runs if x["ok"]]),
        steal_cores_max=_max([x.get("steal_cores") for x in runs if x["ok"]]),
        probe_gflops=[x.get("probe_gflops") for x in runs if x["ok"]],
        threads=cfg.threads)
    r, c = modes.get("dfs-retain"), modes.get("dfs-recompute")
    if r and c and r["step_s"] and c["step_s"]:
        out["policy"] = dict(recompute_time_over_retain=c["step_s"] / r["step_s"],
                             recompute_mem_over_retain=(c["peak_mem_mb"] / r["peak_mem_mb"]
                                                        if r["peak_mem_mb"] else None))
    return out


def _round_ratio(runs, num: str, den: str):
    """Median over rounds of step(num) / step(den)."""
    return _median([a["step_s"] / b["step_s"] for a in runs for b in runs
                    if a["mode"] == num and b["mode"] == den and a["ok"] and b["ok"]
                    and a["repeat"] == b["repeat"]])


def headline(runs: list[dict], modes: dict) -> dict | None:
    """The fastest DFS mode: its fraction of the ideal speed-up over the best unpacked mode,
    how much faster than the dense tree mask it is (median of per-round ratios), and its peak
    memory over the tree mask's. Only a mode whose gradients were checked against the
    reference and found within the tolerance (status ``ok``) is headlined: when the fastest DFS
    mode is WRONG or unchecked, the headline names it, its status, and no figure
    (``best_dfs`` None, ``refused`` says why)."""
    dfs = [m for m, v in modes.items() if m.startswith("dfs") and v["step_s"]]
    if not dfs:
        return None
    best = min(dfs, key=lambda m: modes[m]["step_s"])
    # the gradient reference is compared with itself only: a DFS reference is unchecked
    ref = next((x.get("grad_reference") for x in runs if x.get("grad_reference")), None)
    status = {m: "unchecked" if m == ref else modes[m].get("status") for m in dfs}
    if status[best] != "ok":
        return dict(best_dfs=None, fastest_dfs=best, fastest_status=status[best],
                    refused=_refusal("the fastest DFS mode", best, status[best]))
    out = dict(best_dfs=best, speedup=modes[best].get("speedup"),
               of_ideal=modes[best].get("speedup_vs_ideal"))
    # the fastest DFS mode whose peak memory is within the best unpacked baseline's, with its
    # decoder calls against the tree's nodes (the issue-25 targets: calls <= nodes / 4)
    fits = [m for m in dfs if (modes[m].get("mem_ratio_baseline") or float("inf")) <= 1.0]
    if fits:
        lean = min(fits, key=lambda m: modes[m]["step_s"])
        if status[lean] != "ok":
            out.update(within_memory_refused=_refusal(
                "the fastest DFS mode within the baseline's memory", lean, status[lean]))
        else:
            calls = modes[lean].get("calls") or {}
            out.update(best_within_memory=lean,
                       within_memory_of_ideal=modes[lean].get("speedup_vs_ideal"),
                       within_memory_mem_ratio=modes[lean].get("mem_ratio_baseline"),
                       within_memory_calls=calls.get("forward_calls"), nodes=calls.get("nodes"))
    tm = modes.get("treemask")
    if tm and tm["step_s"]:
        out["over_treemask"] = _round_ratio(runs, "treemask", best)
        if tm["peak_mem_mb"] and modes[best]["peak_mem_mb"] is not None:
            out["mem_over_treemask"] = modes[best]["peak_mem_mb"] / tm["peak_mem_mb"]
    return out


def _refusal(what: str, mode: str, status: str | None) -> str:
    """Why a mode gets no headline figure: its gradients are wrong, or were never checked."""
    why = ("its gradients are WRONG (over the tolerance)" if status == "WRONG"
           else "its gradients were not checked against a reference mode")
    return f"no DFS mode with checked gradients to headline: {what}, {mode}, {why}"


def run(cfg: BenchConfig, *, progress: bool = True, log=print) -> dict:
    unknown = [m for m in cfg.modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    from experiments.bench.inputs import model_config, model_name
    from experiments.bench.modes import refuse_recurrent

    config = model_config(cfg.model_path, cfg.family, cfg.size, cfg.vocab_size)
    for mode in cfg.modes:
        if mode.startswith("treemask"):
            refuse_recurrent(config, mode)  # before any process is spawned
    if not cfg.input and (cfg.max_sequences is not None or cfg.max_tokens is not None):
        raise ValueError("--max-sequences / --max-tokens cut an --input file; a generated "
                         "workload is sized by --scale / --tasks")
    if cfg.input and cfg.sweep:
        raise ValueError("--sweep varies a generated workload; it does not apply to --input")
    with tempfile.TemporaryDirectory(prefix="dta-bench-") as tmp:
        kept = None
        if cfg.input:  # read, check and cut once; every worker reads the cut batch
            from dta.records.jsonl import write_jsonl
            from experiments.bench.inputs import load_input

            name = model_name(cfg.model_path, cfg.family, cfg.size, cfg.vocab_size)
            records, kept, loss = load_input(
                cfg.input, config.vocab_size, name,
                max_sequences=cfg.max_sequences, max_tokens=cfg.max_tokens, loss=cfg.loss,
                max_positions=getattr(config, "max_position_embeddings", None))
            write_jsonl(os.path.join(tmp, "input.jsonl"), records)
            cfg = replace(cfg, loss=loss)
        cfg = replace(cfg, loss=cfg.loss or "ppo")
        return _run(cfg, config, tmp, kept, progress)


def _run(cfg: BenchConfig, config, tmp: str, kept: dict | None, progress: bool) -> dict:
    from tqdm import tqdm

    from experiments.bench import report

    out = Path(cfg.out or f"results/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    points = sweep_points(cfg)
    results = dict(config=asdict(cfg), points=[], input_cut=kept)
    run_cfg = replace(cfg, input=os.path.join(tmp, "input.jsonl")) if cfg.input else cfg
    with tqdm(total=len(points) * cfg.repeats * len(cfg.modes), desc="bench", unit="run",
              disable=not progress, file=sys.stderr) as bar:
        for label, overrides in points:
            info = point_info(run_cfg, overrides)
            runs = run_point(run_cfg, label, overrides, tmp, bar)
            results["points"].append(dict(label=label, overrides=overrides, info=info,
                                           runs=runs, summary=summarize(cfg, runs, info)))
            with open(out / "results.json", "w") as f:  # partial results survive a crash
                json.dump(results, f, indent=1, default=str)
    results["out"] = str(out)
    (out / "results.md").write_text(report.markdown(results))
    results["plots"] = report.plots(results, out)
    with open(out / "results.json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    return results


def compact(results: dict) -> dict:
    """The one-line JSON of `dta bench --json`: per mode the headline figures."""
    keys = ("tokens_per_s", "step_s", "peak_mem_mb", "grad_rel_err", "speedup",
            "speedup_vs_ideal", "gflops_per_s", "mem_ratio_padded", "mem_ratio_baseline",
            "status", "calls")

    def point(p):
        s = p["summary"]
        return dict(label=p["label"], sharing_ratio=s["sharing_ratio"],
                    ideal_speedup=s["ideal_speedup"], best_baseline=s["best_baseline"],
                    total_tokens=p["info"]["total_tokens"], sequences=p["info"]["sequences"],
                    policy=s.get("policy"), headline=s.get("headline"),
                    disturbance=s.get("disturbance"),
                    modes={m: {k: v.get(k) for k in keys} for m, v in s["modes"].items()})

    pts = [point(p) for p in results["points"]]
    head = dict(pts[0]) if len(pts) == 1 else dict(points=pts)
    c = results["config"]
    from experiments.bench.inputs import model_name

    if c.get("input"):
        head.update(input=c["input"], input_cut=results.get("input_cut"), loss=c["loss"])
    head.update(workload=None if c.get("input") else c["workload"],
                scale=None if c.get("input") else c["scale"],
                model=model_name(c.get("model_path"), c["family"], c["size"], c.get("vocab_size")),
                dtype=c["dtype"], device=c["device"], repeats=c["repeats"], out=results["out"])
    return head


def main(argv=None) -> int:
    import argparse

    from experiments.bench.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser(prog="python -m experiments.bench.run")
    add_arguments(parser)
    args = parser.parse_args(argv)
    results = run(config_from_args(args), progress=not args.json)
    print(json.dumps(compact(results)) if args.json else
          (Path(results["out"]) / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

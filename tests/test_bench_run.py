"""The benchmark harness end to end: `dta bench` (slow), the GPU script's CPU path, and the
FlexAttention tree mask (forward only: no FlexAttention backward on CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODE_KEYS = {"tokens_per_s", "step_s", "peak_mem_mb", "grad_rel_err", "speedup",
             "gflops_per_s", "mem_ratio_padded", "mem_ratio_baseline", "status", "calls"}


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def check_summary(d: dict, modes):
    assert set(d["modes"]) == set(modes)
    assert d["sharing_ratio"] > 1 and d["ideal_speedup"] > 1
    assert d["best_baseline"] in ("padded", "microbatch")
    for m, v in d["modes"].items():
        assert MODE_KEYS <= set(v), m
        assert v["status"] == "ok", (m, v)
        assert v["step_s"] > 0 and v["tokens_per_s"] > 0 and v["peak_mem_mb"] >= 0
        assert v["grad_rel_err"] <= 1e-4, (m, v["grad_rel_err"])


@pytest.mark.slow
def test_dta_bench_small_end_to_end(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "dta_cli.main", "bench", "--workload", "tau2-airline", "--scale",
         "small", "--model-size", "small", "--repeats", "1", "--threads", "2", "--out", str(out),
         "--json"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    check_summary(d, ["padded", "microbatch", "treemask", "dfs-node", "dfs-retain", "dfs-recompute"])
    assert d["headline"]["best_dfs"].startswith("dfs")
    assert d["modes"]["dfs-retain"]["calls"]["packs"] < d["modes"]["dfs-node"]["calls"]["packs"]
    assert d["sequences"] > 20 and 5 < d["sharing_ratio"] < 15
    assert d["policy"]["recompute_time_over_retain"] > 0
    assert (out / "results.json").exists() and (out / "results.md").exists()
    assert (out / "modes.png").exists()
    full = json.loads((out / "results.json").read_text())
    assert len(full["points"][0]["runs"]) == 6


# the GPU script's CPU dry run: tests/test_bench_gpu_script.py


@pytest.mark.slow
def test_flex_block_mask_forward_matches_dense():
    import torch

    from dta import build_model
    from experiments.bench.modes import attention, pack_tree
    from tests.test_bench_modes import tree_batch

    model = build_model("qwen3", "tiny", seed=0)
    batch = tree_batch()
    packed = pack_tree(batch, list(range(len(batch))))
    ids, pos = torch.as_tensor(packed.ids)[None], torch.as_tensor(packed.pos)[None]
    with torch.no_grad():
        dense = model(input_ids=ids, position_ids=pos, attention_mask=packed.dense_mask("cpu")).logits
        with attention(model, "flex_attention"):
            flex = model(input_ids=ids, position_ids=pos,
                         attention_mask=packed.block_mask("cpu")).logits
    assert model.config._attn_implementation == "sdpa"  # restored
    assert (dense - flex).abs().max() < 1e-5


def test_summary_flags_wrong_and_failed_modes():
    """A fast mode with a wrong gradient is WRONG; a crashed one FAILED; ratios per round."""
    from experiments.bench.run import BenchConfig, summarize

    cfg = BenchConfig(modes=("padded", "microbatch", "treemask", "dfs-retain"), repeats=2)
    info = dict(total_tokens=1000, sharing_ratio=4.0, ideal_speedup=3.0,
                flops={m: 1e9 for m in cfg.modes})

    def run(mode, r, step, err, mem=100.0):
        return dict(mode=mode, repeat=r, ok=True, step_s=step, peak_mem_mb=mem, grad_rel_err=err)

    runs = [run("padded", 0, 4.0, 1e-7, 400), run("microbatch", 0, 2.0, 0.0, 100),
            run("treemask", 0, 0.5, 0.3), run("padded", 1, 8.0, 1e-7, 400),
            run("microbatch", 1, 4.0, 0.0, 100), run("treemask", 1, 1.0, 0.3),
            dict(mode="dfs-retain", repeat=0, ok=False, error="RuntimeError: boom")]
    s = summarize(cfg, runs, info)
    m = s["modes"]
    assert s["best_baseline"] == "microbatch"
    assert m["treemask"]["status"] == "WRONG" and m["treemask"]["speedup"] == 4.0
    assert m["dfs-retain"]["status"] == "FAILED" and "boom" in m["dfs-retain"]["error"]
    assert m["microbatch"]["status"] == "ok" and m["microbatch"]["tokens_per_s"] == 1000 / 3.0
    assert m["padded"]["mem_ratio_baseline"] == 4.0 and m["microbatch"]["mem_ratio_padded"] == 0.25
    from experiments.bench.report import table

    md = table(dict(label="x", summary=s, info=dict(info, sequences=3, unique_tokens=250,
                                                     trainable_tokens=10,
                                                     ideal_baseline="microbatch")))
    assert "WRONG" in md and "FAILED" in md


def test_disturbance_counts_other_processes_and_steal():
    """What else ran during a step: the machine's busy CPU less the step's own, per second;
    the summary keeps the worst run and the table shows it."""
    from experiments.bench.worker import cpu_times, disturbance

    got = cpu_times()
    assert got is not None and got[0] > 0 and got[1] >= 0  # Linux: /proc/stat is there
    d = disturbance((100.0, 5.0), (130.0, 6.0), own_cpu_s=20.0, step_s=10.0)
    assert d == dict(others_cores=1.0, steal_cores=0.1)
    assert disturbance((100.0, 5.0), (110.0, 5.0), own_cpu_s=12.0, step_s=10.0)["others_cores"] == 0.0
    assert disturbance(None, got, 1.0, 1.0) == dict(others_cores=None, steal_cores=None)

    from experiments.bench.report import table
    from experiments.bench.run import BenchConfig, summarize

    cfg = BenchConfig(modes=("microbatch", "dfs-retain"), repeats=2, threads=2)
    info = dict(total_tokens=1000, sharing_ratio=4.0, ideal_speedup=3.0,
                flops={m: 1e9 for m in cfg.modes}, sequences=3, unique_tokens=250,
                trainable_tokens=10, ideal_baseline="microbatch")
    runs = [dict(mode=m, repeat=r, ok=True, step_s=1.0, peak_mem_mb=1.0, grad_rel_err=0.0,
                 others_cores=o, steal_cores=0.01 * r, probe_gflops=100.0 + 50 * r)
            for r, o in ((0, 0.05), (1, 0.75)) for m in cfg.modes]
    s = summarize(cfg, runs, info)
    assert s["disturbance"] == dict(others_cores_max=0.75, steal_cores_max=0.01, threads=2,
                                    probe_gflops=[100.0, 100.0, 150.0, 150.0])
    assert s["modes"]["dfs-retain"]["others_cores_max"] == 0.75
    md = table(dict(label="x", summary=s, info=info, runs=runs))
    assert "other processes 0.75" in md and "100–150 GFLOP/s" in md
    assert "dfs-retain round 1 (0.75 / 0.01)" in md and "round 0" not in md
    from experiments.bench.worker import probe_gflops

    assert probe_gflops(0.02, n=64) > 0


def test_chain_bench_tiny(tmp_path):
    """The chain bench end to end on a tiny model: every mode timed at every turn count,
    FLOP growth beside it, the copy share of each mode, the disturbance, the plot."""
    out = tmp_path / "chain"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.chain", "--turns", "2,4", "--repeats", "1",
         "--model-size", "tiny", "--out", str(out), "--json"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["turns"] for r in d["rows"]] == [2, 4]
    big = d["rows"][1]
    assert big["tokens"] > d["rows"][0]["tokens"] and big["growth_flops_microbatch"] > big["growth_flops_dfs"] > 1
    assert set(big["step_s"]) == set(d["copy"]) and all(v > 0 for v in big["step_s"].values())
    assert all(0 < c["copy_share"] < 1 for c in d["copy"].values())
    assert d["disturbance"]["others_cores"] >= 0 and d["disturbance"]["steal_cores"] >= 0
    assert (out / "chain.png").exists() and "Disturbance" in (out / "results.md").read_text()


def test_headline_names_the_fastest_dfs_mode_within_the_baselines_memory():
    """The fastest DFS mode overall, and the fastest whose peak is within the baseline's, with
    its decoder calls against the tree's nodes."""
    from experiments.bench.report import table
    from experiments.bench.run import BenchConfig, summarize

    cfg = BenchConfig(modes=("microbatch", "dfs-retain", "dfs-recompute"), repeats=1)
    info = dict(total_tokens=1000, sharing_ratio=4.0, ideal_speedup=3.0,
                flops={m: 1e9 for m in cfg.modes})
    calls = lambda fwd: dict(forward_calls=fwd, backward_calls=2, head_calls=1, packs=3, nodes=40)
    runs = [dict(mode="microbatch", repeat=0, ok=True, step_s=3.0, peak_mem_mb=100.0, grad_rel_err=0.0),
            dict(mode="dfs-retain", repeat=0, ok=True, step_s=1.0, peak_mem_mb=150.0,
                 grad_rel_err=1e-7, calls=calls(3)),
            dict(mode="dfs-recompute", repeat=0, ok=True, step_s=1.2, peak_mem_mb=80.0,
                 grad_rel_err=1e-7, calls=calls(5))]
    hl = summarize(cfg, runs, info)["headline"]
    assert hl["best_dfs"] == "dfs-retain" and hl["best_within_memory"] == "dfs-recompute"
    assert hl["within_memory_calls"] == 5 and hl["nodes"] == 40
    assert abs(hl["within_memory_mem_ratio"] - 0.8) < 1e-12
    md = table(dict(label="x", summary=summarize(cfg, runs, info),
                    info=dict(info, sequences=3, unique_tokens=250, trainable_tokens=10,
                              ideal_baseline="microbatch")))
    assert "within the baseline's peak memory: **dfs-recompute**" in md and "5 decoder calls for 40" in md

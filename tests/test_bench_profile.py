"""The profile tool (experiments.bench.profile): operators sorted into kinds of work, the
ratios against the baseline, and one real run on the tiny workload."""
from __future__ import annotations

import json

import pytest

from experiments.bench import profile as P
from experiments.bench.flops import Flops, mode_flop_parts, mode_flops


def test_operators_sorted_into_kinds_and_outside_is_the_rest_of_the_wall():
    self_us = {"aten::mm": 2e6, "aten::addmm_": 1e6,
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward": 3e6,
               "aten::mul": 0.5e6, "SplitAttentionBackward": 0.25e6}
    s = P.by_kind(self_us, wall_s=8.0)
    assert s == {"matmul": 3.0, "attention": 3.0, "other": 0.75, "outside": 1.25}
    assert P.by_kind(self_us, wall_s=1.0)["outside"] == 0.0  # never negative


def test_compare_gives_baseline_over_mode_per_kind():
    rows = {"base": dict(wall_s=10.0, seconds=dict(matmul=4.0, attention=4.0, other=1.0, outside=1.0),
                         flops=dict(matmul=400.0, attention=800.0, total=1200.0)),
            "dfs": dict(wall_s=2.5, seconds=dict(matmul=1.0, attention=1.0, other=0.25, outside=0.0),
                        flops=dict(matmul=100.0, attention=100.0, total=200.0))}
    c = P.compare(rows)["dfs"]
    assert c["time_ratio"] == {"matmul": 4.0, "attention": 4.0, "other": 4.0, "outside": None, "step": 4.0}
    assert c["flop_ratio"] == {"matmul": 4.0, "attention": 8.0, "step": 6.0}
    assert "attention 4.00× (8.00×)" in P.markdown(dict(
        date="d", workload="w", scale="s", model="m", threads=2, modes=rows, compare={"dfs": c}))


def test_flop_parts_add_up_to_each_modes_total():
    from dta.model.models import build_config
    from experiments.bench.worker import load_batch

    cfg = build_config("qwen3", "small")
    batch, _ = load_batch(dict(workload="tau2-airline", scale="small"), cfg.vocab_size)
    for mode in ("padded", "microbatch", "treemask", "dfs-node", "dfs-retain", "dfs-recompute"):
        parts = mode_flop_parts(mode, batch, cfg)
        assert isinstance(parts, Flops) and min(parts.body, parts.attention, parts.head) > 0
        assert mode_flops(mode, batch, cfg) == pytest.approx(parts.body + parts.attention + parts.head)
    retain, recompute = (mode_flop_parts(m, batch, cfg) for m in ("dfs-retain", "dfs-recompute"))
    assert recompute.head == retain.head and recompute.body > retain.body


def test_profile_runs_and_prints_json_last(tmp_path, capsys):
    rc = P.main(["--scale", "tiny", "--modes", "microbatch,dfs-retain", "--model-size", "tiny",
                 "--out", str(tmp_path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["modes"]) == {"microbatch", "dfs-retain"}
    for r in out["modes"].values():
        assert r["seconds"]["matmul"] > 0 and r["seconds"]["attention"] > 0
        assert sum(r["seconds"].values()) >= r["wall_s"] - 1e-9
    assert set(out["compare"]) == {"dfs-retain"}
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md", "profile.png"}


def test_profile_refuses_unknown_or_single_modes():
    for modes in ("microbatch", "microbatch,nope"):
        with pytest.raises(SystemExit):
            P.main(["--modes", modes])

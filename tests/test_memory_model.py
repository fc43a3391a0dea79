"""dta.planning.memory: the per-rank memory model of the sharding modes, and `dta plan
--memory` printing it and picking the mode that fits a budget."""
from __future__ import annotations

import json

import pytest

from dta.planning.memory import GIB, MODES, SHAPES, ModelShape, estimate, pick_mode


def test_qwen3_8b_shape_has_8b_parameters_and_sharding_shrinks_the_state():
    shape = ModelShape.of(SHAPES["qwen3-8b"])
    assert 8.1e9 < shape.params < 8.3e9  # Qwen3-8B: 8.19B
    kw = dict(path_tokens=8000, call_tokens=2000, policy="recompute")
    rep = estimate(SHAPES["qwen3-8b"], 8, "replicate", compute_dtype="float32", **kw)
    assert rep.state == 16 * shape.params  # fp32 params + grads + 2 AdamW states
    z1 = estimate(SHAPES["qwen3-8b"], 8, "zero1", **kw)
    fs = estimate(SHAPES["qwen3-8b"], 8, "fsdp", **kw)
    assert z1.optimizer == pytest.approx(8 * shape.params / 8, rel=1e-6)
    assert fs.params < z1.params < rep.params and fs.state < z1.state < rep.state
    one = estimate(SHAPES["qwen3-8b"], 1, "fsdp", **kw)
    assert one.mode == "replicate"  # nothing to shard on one rank


def test_retain_holds_the_path_and_pick_mode_takes_the_cheapest_that_fits():
    kw = dict(path_tokens=16000, call_tokens=500)
    retain = estimate(SHAPES["qwen3-8b"], 8, "zero1", policy="retain", **kw)
    recompute = estimate(SHAPES["qwen3-8b"], 8, "zero1", policy="recompute", **kw)
    assert retain.activations > recompute.activations
    mode, rows = pick_mode(SHAPES["qwen3-8b"], 8, 80 * GIB, policy="recompute", **kw)
    assert [r.mode for r in rows] == list(MODES)
    assert mode == next(r.mode for r in rows if r.total <= 80 * GIB)
    assert pick_mode(SHAPES["qwen3-32b"], 8, 1 * GIB, policy="recompute", **kw)[0] is None
    with pytest.raises(ValueError, match="sharding mode"):
        estimate(SHAPES["qwen3-8b"], 8, "zero3", **kw)


def test_dta_plan_prints_memory_and_the_fitting_mode(capsys):
    from dta_cli.main import main

    assert main(["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "8",
                 "--memory", "--model", "qwen3-14b", "--budget-gib", "80", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])["memory"]
    assert "memory per rank" in out and "budget 80 GiB" in out
    totals = {r["mode"]: r["total"] for r in result["modes"]}
    assert result["usable_bytes"] == pytest.approx(0.9 * 80 * GIB)  # 10 % headroom
    fitting = [m for m in MODES if totals[m] <= result["usable_bytes"]]
    assert result["chosen"] == (fitting[0] if fitting else None)
    assert result["path_tokens"] > 0 and result["call_tokens"] > 0


def test_auto_sharding_is_resolved_on_the_driver_before_workers_start():
    from dta.config import load_config
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime import Trainer, TrainingError

    cfg = load_config(None, ["workload.scale=tiny", "train.sharding=auto",
                             "walker.policy=recompute", "train.memory_budget_gib=64"])
    trainer = Trainer(cfg)  # not started: no Ray, no workers
    batch = BatchSource(cfg, trainer.vocab_size).batch(0)
    assert trainer.resolve_sharding(batch) == "replicate"  # a tiny model fits anywhere
    assert trainer.cfg.train.sharding == "replicate"
    report = trainer.sharding_report
    assert report["chosen"] == "replicate" and report["path_tokens"] > 0
    tight = load_config(None, ["workload.scale=tiny", "train.sharding=auto",
                               "train.memory_budget_gib=0.000001"])
    with pytest.raises(TrainingError, match="no mode fits"):
        Trainer(tight).resolve_sharding(batch)


def test_dta_plan_prices_fsdp_under_retain_with_the_whole_path(capsys):
    """fsdp trains under both memory policies: `dta plan --memory --policy retain` prices it,
    with retain's activations (every pack graph on the longest path alive) as the other
    modes'."""
    from dta_cli.main import main

    args = ["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "8",
            "--memory", "--model", "qwen3-14b", "--json", "--policy"]
    rows = {}
    for policy in ("retain", "recompute"):
        assert main(args + [policy]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
        rows[policy] = {r["mode"]: r for r in out["modes"]}
    assert list(rows["retain"]) == list(MODES)
    retain, recompute = rows["retain"]["fsdp"], rows["recompute"]["fsdp"]
    assert retain["activations"] == rows["retain"]["zero1"]["activations"]
    assert retain["activations"] > recompute["activations"]
    assert retain["state"] == recompute["state"]

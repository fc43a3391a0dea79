"""dta.planning.memory: the per-rank memory model of the sharding modes, and `dta plan
--memory` printing it and picking the mode that fits a budget."""
from __future__ import annotations

import json

import pytest

from dta.planning.memory import GIB, SHAPES, SHARDINGS, ModelShape, estimate, pick_sharding


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
    assert one.sharding == "replicate"  # nothing to shard on one rank


def test_retain_holds_the_path_and_pick_mode_takes_the_cheapest_that_fits():
    kw = dict(path_tokens=16000, call_tokens=500)
    retain = estimate(SHAPES["qwen3-8b"], 8, "zero1", policy="retain", **kw)
    recompute = estimate(SHAPES["qwen3-8b"], 8, "zero1", policy="recompute", **kw)
    assert retain.activations > recompute.activations
    mode, rows = pick_sharding(SHAPES["qwen3-8b"], 8, 80 * GIB, policy="recompute", **kw)
    assert [r.sharding for r in rows] == list(SHARDINGS)
    assert mode == next(r.sharding for r in rows if r.total <= 80 * GIB)
    assert pick_sharding(SHAPES["qwen3-32b"], 8, 1 * GIB, policy="recompute", **kw)[0] is None
    with pytest.raises(ValueError, match="sharding mode"):
        estimate(SHAPES["qwen3-8b"], 8, "zero3", **kw)


def test_dta_plan_prints_memory_and_the_fitting_mode(capsys):
    from dta_cli.main import main

    assert main(["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "8",
                 "--memory", "--model", "qwen3-14b", "--budget-gib", "80", "--json"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])["memory"]
    assert "memory per rank" in out and "budget 80 GiB" in out
    totals = {r["sharding"]: r["total"] for r in result["shardings"]}
    assert result["usable_bytes"] == pytest.approx(0.9 * 80 * GIB)  # 10 % headroom
    fitting = [m for m in SHARDINGS if totals[m] <= result["usable_bytes"]]
    assert result["chosen"] == (fitting[0] if fitting else None)
    assert result["path_tokens"] > 0 and result["call_tokens"] > 0


def test_auto_sharding_is_resolved_on_the_driver_before_workers_start():
    from dta.config.schema import load_config
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime import Trainer, TrainingError

    cfg = load_config(None, ["workload.scale=tiny", "train.sharding=auto",
                             "walker.policy=recompute", "train.memory_budget_gib=64"])
    trainer = Trainer(cfg)  # not started: no Ray, no workers
    batch = BatchSource(cfg, trainer.vocab_size).batch(0)
    assert trainer.resolve_sharding(batch) == "replicate"  # a tiny model fits anywhere
    assert trainer.settings.layout.sharding == "replicate"
    assert trainer.cfg.train.sharding == "auto"  # the config stays as written
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
        rows[policy] = {r["sharding"]: r for r in out["shardings"]}
    assert list(rows["retain"]) == list(SHARDINGS)
    retain, recompute = rows["retain"]["fsdp"], rows["recompute"]["fsdp"]
    assert retain["activations"] == rows["retain"]["zero1"]["activations"]
    assert retain["activations"] > recompute["activations"]
    assert retain["state"] == recompute["state"]


# ------------------------------------------------------------------------ blocks --
def test_blocks_bound_recompute_activations_not_retain():
    from dta.planning.memory import activation_split
    shape = ModelShape.of(SHAPES["qwen3-14b"])
    kw = dict(path_tokens=16000, call_tokens=6000, compute_bytes=2, logits_chunk=1024)
    whole = activation_split(shape, policy="recompute", **kw)
    block = activation_split(shape, policy="recompute", block_tokens=1024, **kw)
    assert block["graphs"] * 5 < whole["graphs"]  # one block's graph, not a 6,000-token node
    assert block["path_kv"] == whole["path_kv"]  # the path's K/V are the path's either way
    retain = activation_split(shape, policy="retain", block_tokens=1024, **kw)
    assert retain["graphs"] == activation_split(shape, policy="retain", **kw)["graphs"]
    assert retain["graphs"] > 10 * block["graphs"]


def test_plan_memory_order_and_shortfall():
    from dta.planning.memory import plan_memory
    kw = dict(path_tokens=15562, call_tokens=5534)
    roomy = plan_memory(SHAPES["qwen3-8b"], 8, 1000 * GIB, **kw)
    assert roomy.chosen.label() == "replicate/retain/block none"
    plan = plan_memory(SHAPES["qwen3-14b"], 8, 80 * GIB, **kw)
    assert plan.chosen is not None and plan.chosen.total <= 0.9 * 80 * GIB
    # every earlier (mode, policy, block) in the order tried did not fit
    assert all(e.total > plan.budget for e in plan.tried[:-1]) and plan.tried[-1] is plan.chosen
    assert plan.chosen.policy == "recompute" and plan.chosen.block_tokens
    none = plan_memory(SHAPES["qwen3-32b"], 8, 80 * GIB, **kw)
    assert none.chosen is None and none.shortfall > 0
    assert "GiB over" in none.message() and none.cheapest.total == min(e.total for e in none.tried)


@pytest.mark.slow  # ~6-12 s: the full-scale workload and its tree
def test_dta_plan_full_scale_qwen3_14b_on_8x80_chooses_a_block_that_fits(capsys):
    """The issue's command: at τ² full scale (paths of 15.5K tokens, nodes of 5.5K) no mode
    fit 8 x 80 GB without blocks; with them the memory model chooses one."""
    from dta_cli.main import main

    assert main(["plan", "--workload", "tau2-airline", "--scale", "full", "--workers", "8",
                 "--memory", "--model", "qwen3-14b", "--budget-gib", "80", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert mem["chosen"] in SHARDINGS and mem["block_tokens"] > 0
    assert mem["node_tokens"] > mem["block_tokens"] == mem["call_tokens"]
    chosen = next(r for r in mem["shardings"] if r["sharding"] == mem["chosen"])
    assert chosen["total"] <= mem["usable_bytes"] and chosen["block_tokens"] == mem["block_tokens"]
    assert set(mem["activation_split"]) == {"path_kv", "graphs", "head"}
    assert sum(mem["activation_split"].values()) == chosen["activations"]


def test_block_tokens_config_key():
    from dta.config.schema import ConfigError, load_config
    from runtime.engine import resolve_run_config

    assert load_config(None, []).walker.block_tokens == "auto"
    assert load_config(None, ["walker.block_tokens=0"]).walker.block_tokens == 0
    for bad in ("-3", "big", "true"):
        with pytest.raises(ConfigError, match="walker.block_tokens"):
            load_config(None, [f"walker.block_tokens={bad}"])
    cfg = load_config(None, ["walker.block_tokens=auto"])
    settings = resolve_run_config(cfg, SHAPES["qwen3-8b"])
    mode, walk = settings.layout.sharding, settings.walk
    assert (mode, walk.block_tokens) == ("replicate", 2048)  # no budget: the walker's default
    cfg = load_config(None, ["train.sharding=fsdp", "train.memory_budget_gib=80",
                             "ray.num_workers=8", "walker.policy=recompute",
                             "model.dtype=bfloat16"])

    import numpy as np

    from dta.planning.memory import batch_extent
    from dta.tree import PrefixTree

    # a τ²-like batch: a 15,562-token path whose nodes are at most 5,534 tokens
    x, y, z1, z2, w = (np.full(n, t) for n, t in ((5534, 1), (5534, 2), (4494, 3), (4494, 4),
                                                   (3000, 5)))
    tree = PrefixTree([np.r_[x, y, z1], np.r_[x, y, z2], np.r_[x, w]])
    assert batch_extent(tree) == (15562, 5534)
    settings = resolve_run_config(cfg, SHAPES["qwen3-14b"], tree)
    mode, walk, report = settings.layout.sharding, settings.walk, settings.report
    block = walk.block_tokens
    assert mode == "fsdp" and 0 < block < 5534 and report["block_tokens"] == block
    assert walk.policy == "recompute"  # the config's other walk settings, in the same object


def test_hybrid_shape_prices_gdn_states_instead_of_their_kv():
    from dta.model.models import build_config
    from dta.planning.memory import activation_split

    cfg = build_config("qwen3_5", "tiny").to_dict()
    hybrid = ModelShape.of(cfg)
    dense = ModelShape.of({k: v for k, v in cfg.items() if k != "layer_types"})
    assert hybrid.gdn_layers == cfg["layer_types"].count("linear_attention") > 0
    assert hybrid.attention_layers == dense.layers - hybrid.gdn_layers and hybrid.gdn_state > 0
    kw = dict(path_tokens=4000, call_tokens=1000, policy="recompute", compute_bytes=2,
              logits_chunk=1024)
    h, d = activation_split(hybrid, **kw), activation_split(dense, **kw)
    assert h["graphs"] == d["graphs"] and h["path_kv"] != d["path_kv"]
    more = activation_split(hybrid, **{**kw, "block_tokens": 100})  # more pieces, more states
    assert more["path_kv"] > h["path_kv"]

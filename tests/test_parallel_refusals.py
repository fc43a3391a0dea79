"""Every parallel setting is checked against the model's config before Ray starts (issue 55).

One rule (``runtime.engine.layout.check_model_fit``), read from the model's config without
weights: the driver calls it before Ray (``ray.init`` is made to fail the test here) and
before the checkpoint folder is claimed; every rank's engine core calls it on its layout,
whose errors name the front door's keys (``dta train``'s, AReaL's, verl's).
"""
from __future__ import annotations

import pytest

from dta.config.schema import load_config
from dta.model.models import build_config, build_model
from runtime.engine import EngineCore, settle
from runtime.engine.layout import LayoutError, ParallelLayout, check_model_fit
from runtime.errors import TrainingError

BASE = ["workload.scale=tiny", "ray.object_store_memory=104857600", "train.steps=2"]


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray fails the test: what is refused must be refused before it."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("ray.init was called: the setting was not refused before Ray")

    monkeypatch.setattr(ray, "init", refuse)
    yield
    assert not ray.is_initialized()


def _train(tmp_path, *overrides):
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime.run import run_training

    d = tmp_path / "ck"
    cfg = load_config(None, BASE + [f"train.checkpoint_dir={d}", *overrides])
    with pytest.raises(TrainingError) as info:
        run_training(cfg, BatchSource(cfg, 512), progress=False, log=lambda m: None)
    assert not d.exists()  # refused before the checkpoint folder was claimed
    return str(info.value)


@pytest.mark.parametrize("overrides, line", [
    (["model.family=qwen3_moe", "ray.num_workers=3", "train.expert_parallel=3"],
     "bad value for config key 'train.expert_parallel': 3 does not divide qwen3_moe's 4 "
     "experts"),
    (["ray.num_workers=2", "train.expert_parallel=2"],
     "bad value for config key 'train.expert_parallel': 2 needs routed experts: qwen3 has "
     "none"),
    (["model.family=qwen3_moe", "ray.num_workers=2", "train.expert_parallel=2",
      "model.lora.r=4"],
     "bad value for config key 'train.expert_parallel': 2 needs every weight trained"),
])
def test_dta_train_refuses_before_ray(tmp_path, no_ray, overrides, line):
    message = _train(tmp_path, *overrides)
    assert message.startswith(line), message
    assert "\n" not in message and "gloo" not in message


def test_context_parallel_over_more_ranks_than_value_heads(tmp_path, no_ray):
    """qwen3_5 (hybrid) tiny: a Gated DeltaNet layer of 4 value heads cannot be split over
    8 ranks."""
    message = _train(tmp_path, "model.family=qwen3_5", "ray.num_workers=8",
                     "train.context_parallel=8")
    assert message.startswith("bad value for config key 'train.context_parallel': 8 splits "
                              "each Gated DeltaNet layer's value heads: qwen3_5_text has 4"), message


def test_the_rule_reads_the_model_config():
    """The rule itself: heads and experts read from the config, unchecked values pass."""
    dense, moe = build_config("qwen3", "tiny"), build_config("qwen3_moe", "tiny")
    check_model_fit(moe, expert_parallel=4, context_parallel=2, sharding="zero1")
    check_model_fit(moe, expert_parallel="auto", context_parallel="auto")  # not decided yet
    check_model_fit(dense, expert_parallel=1, context_parallel=4)
    with pytest.raises(LayoutError, match=r"^bad expert-parallel size 8: does not divide "
                                          r"qwen3_moe's 4 experts$"):
        check_model_fit(moe, expert_parallel=8)
    odd = build_config("qwen3", "tiny", num_attention_heads=6, num_key_value_heads=4,
                       head_dim=16)
    with pytest.raises(LayoutError, match="qwen3's 6 query heads are not grouped evenly "
                                          "over its 4 K/V heads"):
        check_model_fit(odd, context_parallel=2, keys={"context_parallel": "K"})
    with pytest.raises(LayoutError, match="^sharding=fsdp trains every weight"):
        check_model_fit(dense, sharding="fsdp", frozen=True, keys={"sharding": "K"})


def _core(layout):
    """An engine core on one process: the check runs at construction, before any group."""
    import torch

    from dta.options import WalkOptions

    walk = settle(WalkOptions(), layout).walk

    return EngineCore(lambda dtype: build_model("qwen3", "tiny", dtype=dtype), layout=layout,
                      walk=walk, make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                      compute_dtype="float32")


def test_areal_door_names_its_key():
    from runtime.areal.parallel import layout_of

    layout = layout_of(None, world=2, expert_parallel=2)
    with pytest.raises(LayoutError, match=r"^bad value for the allocation's expert-parallel "
                                          r"size \(e\): 2 needs routed experts: qwen3 has none"):
        _core(layout)


def test_verl_door_names_its_key():
    pytest.importorskip("verl")
    from types import SimpleNamespace

    from runtime.verl.config import layout_of

    engine = SimpleNamespace(fsdp_size=-1, dta_sharding="zero1", ulysses_sequence_parallel_size=1,
                             expert_parallel_size=2, optimizer_offload=False)
    layout = layout_of(engine, world=2, rank=0)
    with pytest.raises(LayoutError, match=r"^bad value for engine_config.expert_parallel_size: "
                                          r"2 needs routed experts: qwen3 has none"):
        _core(layout)


def test_layout_keys_travel_to_each_rank():
    layout = ParallelLayout.make(world=2, expert_parallel=2, spelling={"expert_parallel": "E!"})
    assert dict(layout.at(1).keys) == {"expert_parallel": "E!"}
    assert layout == ParallelLayout(world=2, expert_parallel=2)  # the keys are no setting

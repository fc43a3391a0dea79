"""ParallelLayout: the expert-parallel, HSDP and offload fields are validated once, naming the
front door's key, and their groups are the documented ones."""
from __future__ import annotations

import pytest

from runtime.engine.layout import LayoutError, ParallelLayout


def test_defaults_are_todays_layout():
    layout = ParallelLayout.make(world=4, sharding="fsdp")
    assert (layout.expert_parallel, layout.shard_size, layout.offload) == (1, 4, "none")
    assert layout.replicas == 1
    assert layout.record()["shard_size"] == 4


def test_groups():
    layout = ParallelLayout.make(world=8, context_parallel=2, sharding="fsdp",
                                 expert_parallel=4, shard_size=4, rank=5)
    assert layout.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.expert_replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.shard_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.expert_rank == 1 and layout.replicas == 2


@pytest.mark.parametrize("kwargs, culprit", [
    (dict(world=4, expert_parallel=3), "expert_parallel"),
    (dict(world=4, sharding="fsdp", shard_size=3), "shard_size"),
    (dict(world=4, sharding="replicate", shard_size=2), "shard_size"),
    (dict(world=4, sharding="zero1", offload="disk"), "offload"),
    (dict(world=4, expert_parallel=0), "expert_parallel"),
])
def test_bad_values_name_the_key(kwargs, culprit):
    spelling = {culprit: f"config key 'train.{culprit}'"}
    with pytest.raises(LayoutError, match=f"config key 'train.{culprit}'"):
        ParallelLayout.make(spelling=spelling, **kwargs)


def test_run_config_reaches_the_layout():
    from dta.config.schema import load_config
    from runtime.engine.resolve import resolve_run_config

    cfg = load_config(None, ["ray.num_workers=4", "train.sharding=zero1",
                             "train.expert_parallel=2", "train.shard_size=2",
                             "train.offload=optimizer"])
    layout = resolve_run_config(cfg, None).layout
    assert (layout.expert_parallel, layout.shard_size, layout.offload) == (2, 2, "optimizer")
    with pytest.raises(Exception, match="train.offload"):
        load_config(None, ["train.offload=disk"])


def test_auto_layout_keys_are_priced_once():
    """train.expert_parallel / shard_size / offload = auto: the memory model's choice, among
    the values the world and the model allow, reaches the layout."""
    from dta.config.schema import load_config
    from dta.model.models import build_model
    from runtime.engine.resolve import needs_budget, resolve_run_config

    hf = build_model("qwen3_moe", "tiny").config
    cfg = load_config(None, ["ray.num_workers=4", "train.sharding=zero1",
                             "train.expert_parallel=auto", "train.shard_size=auto",
                             "train.offload=auto", "train.memory_budget_gib=4"])
    assert needs_budget(cfg)
    settings = resolve_run_config(cfg, hf)
    layout, report = settings.layout, settings.report
    assert layout.expert_parallel in report["priced_expert_parallel"]
    assert report["priced_expert_parallel"] == [e for e in (1, 2, 4)
                                                if hf.num_experts % e == 0]
    assert layout.offload in ("none", "optimizer") and layout.shard_size == 4
    assert (layout.expert_parallel, layout.offload) == (report["expert_parallel"],
                                                        report["offload"])

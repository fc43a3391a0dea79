"""A ``dta`` run config into AReaL's actor (``runtime.areal.config.actor_config_from_dta``) takes
``train.shard_size``, ``train.offload`` and ``train.expert_parallel`` as ``dta train`` does: an
``auto`` priced by the memory model on the allocation's world (``resolve_run_config``, the
same answer ``dta train`` gets for that many workers), a given value passed on, expert
parallelism put into the allocation. And the doors recognise the engine core's refusal by its
type (``runtime.errors.ShardingRefused``), never by its text."""
from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from dta.config.schema import load_config  # noqa: E402
from runtime.areal.config import actor_config_from_dta  # noqa: E402
from runtime.areal.parallel import strategy_of  # noqa: E402
from runtime.engine import resolve_run_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = os.path.join(ROOT, "configs", "tau2-airline-grpo.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from runtime.areal.examples.tau2_grpo import make_smoke_model

    return make_smoke_model(str(tmp_path_factory.mktemp("keys") / "model"), vocab_size=128)


def _cfg(model_dir, *extra):
    return load_config(PRESET, [f"model.path={model_dir}", *extra])


def _dta_train(cfg, world: int):
    """The layout ``dta train`` resolves for ``cfg`` on ``world`` workers."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
    return resolve_run_config(OmegaConf.merge(cfg, {"ray": {"num_workers": world}}), hf).layout


def test_shard_size_auto_is_priced_as_dta_train_prices_it(model_dir):
    cfg = _cfg(model_dir, "train.shard_size=auto", "train.sharding=zero1")
    config, options = actor_config_from_dta(cfg, backend="fsdp:d4")
    layout = _dta_train(cfg, 4)
    assert options.shard_size == layout.shard_size and isinstance(options.shard_size, int)
    assert options.sharding == "zero1" == layout.sharding and config.backend == "fsdp:d4"
    given = actor_config_from_dta(_cfg(model_dir, "train.shard_size=2",
                                       "train.sharding=zero1"), backend="fsdp:d4")[1]
    assert given.shard_size == 2


def test_offload_auto_is_priced_as_dta_train_prices_it(model_dir):
    cfg = _cfg(model_dir, "train.offload=auto", "train.sharding=fsdp")
    _, options = actor_config_from_dta(cfg, backend="fsdp:d2")
    layout = _dta_train(cfg, 2)
    assert options.offload == layout.offload and options.offload in ("none", "optimizer")
    _, given = actor_config_from_dta(_cfg(model_dir, "train.offload=optimizer",
                                          "train.sharding=auto"), backend="fsdp:d2")
    assert given.offload == "optimizer" and given.sharding is None  # sharding=auto: unset


def test_expert_parallel_goes_into_the_allocation(model_dir):
    config, _ = actor_config_from_dta(_cfg(model_dir, "train.expert_parallel=2"),
                                      backend="fsdp:d4")
    assert config.backend == "archon:d4e2"
    strategy = strategy_of(config.backend)
    assert (strategy.data_parallel_size, strategy.expert_parallel_size) == (4, 2)
    same, _ = actor_config_from_dta(_cfg(model_dir, "train.expert_parallel=2"),
                                    backend="archon:d4e2")
    assert same.backend == "archon:d4e2"
    kept, _ = actor_config_from_dta(_cfg(model_dir), backend="archon:d4e2")  # default 1
    assert kept.backend == "archon:d4e2"
    with pytest.raises(ValueError, match=r"train.expert_parallel' is 4.*e2"):
        actor_config_from_dta(_cfg(model_dir, "train.expert_parallel=4"), backend="archon:d4e2")


def test_the_doors_translate_the_cores_refusal_by_type(monkeypatch):
    import torch

    import runtime.areal.translate as translate
    from runtime.engine import ParallelLayout, RunSettings
    from runtime.errors import ShardingRefused
    from runtime.sharding import sharding_class

    with pytest.raises(ShardingRefused, match=r"^sharding=zero1 keeps torch.float32"):
        sharding_class("zero1").storage_dtype(torch.bfloat16, torch.bfloat16)

    class Config:
        optimizer, dtype, optimizer_dtype = None, "float32", "float32"
        path, attn_impl, init_from_scratch, use_lora = "x", "sdpa", False, False

    class Dta:
        dtype = None

    settings = RunSettings(ParallelLayout.make(world=1, sharding="replicate"), None, None)
    raised = []

    class Core:
        def __init__(self, *args, **kwargs):
            raise raised[0]

    monkeypatch.setattr(translate, "EngineCore", Core)
    raised[:] = [ShardingRefused("sharding=replicate cannot hold this")]
    with pytest.raises(ShardingRefused, match=r"^actor.dta.sharding=replicate \(dtype=float32, "
                       r"optimizer_dtype=float32\): sharding=replicate cannot hold this$"):
        translate.make_core(Config(), Dta(), settings, None, "cpu")
    raised[:] = [ValueError("sharding=looks like a refusal but is another error")]
    with pytest.raises(ValueError, match=r"^sharding=looks like a refusal") as info:
        translate.make_core(Config(), Dta(), settings, None, "cpu")
    assert not isinstance(info.value, ShardingRefused)  # passed on as raised, not rewritten


@pytest.mark.parametrize("key", ["node_resident", "prefetch"])
def test_node_resident_and_prefetch_reach_the_engines_layout(model_dir, key):
    """``train.node_resident`` / ``train.prefetch`` (fsdp's hpZ gathers under HSDP, its
    next-layer all-gather) become ``actor.dta.<key>`` and reach the layout the engine builds
    (``parallel.layout_of`` with ``DTAOptions.layout_settings()``), the one ``dta train``
    resolves; ``auto`` is priced as ``dta train`` prices it; under zero2 the layout refuses
    the key naming AReaL's spelling."""
    from runtime.areal.parallel import layout_of

    def engine_layout(options, config):
        return layout_of(options.sharding, world=4, where=config.backend,
                         **options.layout_settings())

    hsdp = ("train.sharding=fsdp", "train.shard_size=2")
    cfg = _cfg(model_dir, *hsdp, f"train.{key}=true")
    config, options = actor_config_from_dta(cfg, backend="fsdp:d4")
    assert getattr(options, key) is True
    layout = engine_layout(options, config)
    assert getattr(layout, key) is True and layout == _dta_train(cfg, 4)
    config, unset = actor_config_from_dta(_cfg(model_dir, *hsdp), backend="fsdp:d4")
    assert getattr(unset, key) is False and getattr(engine_layout(unset, config), key) is False
    cfg = _cfg(model_dir, *hsdp, f"train.{key}=auto")
    _, priced = actor_config_from_dta(cfg, backend="fsdp:d4")
    assert getattr(priced, key) is getattr(_dta_train(cfg, 4), key)
    config, bad = actor_config_from_dta(_cfg(model_dir, "train.sharding=zero2",
                                             "train.shard_size=2", f"train.{key}=true"),
                                        backend="fsdp:d4")
    with pytest.raises(ValueError, match=rf"^bad value for actor\.dta\.{key}: True must be "
                                         r"false under sharding=zero2.*\(from 'fsdp:d4'\)$"):
        engine_layout(bad, config)

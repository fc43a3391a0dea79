"""DTATrainEngine with LoRA (use_lora=True, lora_rank, lora_alpha, target_modules as AReaL's
FSDPEngine reads them): two train_batch steps with AReaL's grpo_loss_fn against FSDPEngine's
own LoRA run in float32 (the same adapters to start: FSDPEngine's, copied) -- gradients and
adapters agree after each step (relative L2 <= 1e-4, as tests/test_areal.py), every base
weight stays bit-identical; the hf save is a PEFT adapter folder (FSDPEngine's layout: the
adapter and the base config, no tokenizer) that a fresh PEFT model loads."""
from __future__ import annotations

import copy
import os

import pytest
import torch

pytest.importorskip("areal")
pytest.importorskip("peft")
pytestmark = pytest.mark.areal

from areal.api.io_struct import SaveLoadMeta  # noqa: E402

from runtime.areal import DTAOptions, convert  # noqa: E402
from tests.test_areal import (  # noqa: E402,F401
    FT_SPEC,
    eager_areal,
    engine_config,
    gloo_world1,
    grads_of,
    grpo,
    ids_only,
    loss_weight_fn,
    make_train_batch,
    max_rel,
    model_dir,
    new_engine,
    params_of,
    records,
)

LORA = dict(use_lora=True, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                       "down_proj"])


def test_lora_train_batch_matches_fsdp_engine(model_dir, records, gloo_world1, tmp_path):
    from areal.engine.fsdp_engine import FSDPEngine

    n = len(records)
    cfg = engine_config(model_dir, n, eps=1e-5, **LORA)
    fsdp = FSDPEngine(cfg)
    fsdp.create_process_group()
    try:
        fsdp.initialize(None, FT_SPEC)
        eng = new_engine(copy.deepcopy(cfg), DTAOptions(policy="retain"))
        start = params_of(fsdp.model)
        adapters = {k for k, p in eng.model.named_parameters() if p.requires_grad}
        assert adapters and all("lora_" in k for k in adapters)
        assert adapters == {k for k, p in fsdp.model.named_parameters() if p.requires_grad}
        with torch.no_grad():  # FSDPEngine's adapters (A random, B = 0) on both sides
            for k, p in eng.model.named_parameters():
                if k in adapters:
                    p.copy_(start[k])
        base = {k: v for k, v in params_of(eng.model).items() if k not in adapters}
        assert max_rel(base, {k: start[k] for k in base}) == 0.0  # the same base model

        batch = make_train_batch(records, fsdp.forward_batch(ids_only(convert.from_records(
            records))))
        for step in range(2):  # step 1: B = 0, only B moves; step 2: A's gradient too
            st_fsdp = fsdp.train_batch(dict(batch), grpo(), loss_weight_fn)
            st_dta = eng.train_batch(dict(batch), grpo(), loss_weight_fn)
            assert st_dta["update_successful"] == st_fsdp["update_successful"] == 1.0
            assert abs(st_dta["grad_norm"] / st_fsdp["grad_norm"] - 1) < 1e-4
            g_fsdp, g_dta = grads_of(fsdp.model), grads_of(eng.model)
            assert all(float(g_dta[k].norm()) == 0 for k in g_dta if k not in adapters)
            assert max_rel({k: g_dta[k] for k in adapters}, {k: g_fsdp[k] for k in adapters}) < 1e-4
            assert max_rel(params_of(eng.model), params_of(fsdp.model)) < 1e-4
        assert all(float(g_dta[k].norm()) > 0 for k in adapters)  # A and B both trained
        after = params_of(eng.model)
        assert all(not torch.equal(after[k], start[k]) for k in adapters)
        assert all(torch.equal(after[k], v) for k, v in base.items())  # base bit-identical

        # hf save: the adapter in PEFT format, as FSDPEngine writes it
        path = str(tmp_path / "adapter")
        eng.save(SaveLoadMeta(path=path, weight_format="hf", with_optim=False,
                              tokenizer=eng.tokenizer))
        files = set(os.listdir(path))
        assert {"adapter_model.safetensors", "adapter_config.json", "config.json"} <= files
        assert "tokenizer.json" not in files
        from peft import PeftModel

        from dta.model.models import load_model

        loaded = PeftModel.from_pretrained(load_model(model_dir, dtype="float32"), path)
        got = {k: v for k, v in params_of(loaded).items() if "lora_" in k}
        assert max_rel(got, {k: after[k] for k in got}) == 0.0 and len(got) == len(adapters)
        # and back into an engine (hf load of an adapter folder)
        other = new_engine(copy.deepcopy(cfg), DTAOptions(policy="retain"))
        other.load(SaveLoadMeta(path=path, weight_format="hf", with_optim=False))
        assert max_rel(params_of(other.model), after) == 0.0
        other.destroy()
        eng.destroy()
    finally:
        fsdp.destroy()


def test_lora_refusals(model_dir):
    from runtime.areal import DTATrainEngine

    cfg = engine_config(model_dir, 2, **LORA)
    cfg.peft_type = "ia3"
    with pytest.raises(NotImplementedError, match="LoRA adapters only"):
        DTATrainEngine(cfg)


def test_ppo_trainer_with_lora_serves_the_adapters(tmp_path):
    """AReaL's RL loop (DTAPPOTrainer, GRPO, the smoke inference engine) with use_lora: the
    initial adapter is served, each step's adapter reaches the engine by disk, the served
    model's adapters equal the trained ones, and the base stays as loaded (cast to the
    smoke config's bf16 compute dtype)."""
    from runtime.areal.examples.tau2_grpo import make_smoke_model
    from tests.test_areal_trainer import config, run

    model = make_smoke_model(str(tmp_path / "model"), vocab_size=256)
    mp = pytest.MonkeyPatch()
    mp.setenv("AREAL_SPMD_MODE", "1")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        mp.setenv(key, value)
    try:
        with torch._dynamo.config.patch(disable=True):
            out = run(config(tmp_path, model, "lora", "+actor.use_lora=true",
                             "+actor.lora_rank=4", "+actor.lora_alpha=8",
                             "+actor.target_modules=[q_proj,v_proj]", "+gconfig.lora_name=dta"))
    finally:
        mp.undo()
    assert [u["version"] for u in out["updates"]] == [1, 2]
    trained = {n: p for n, p in out["trained"].items() if "lora_" in n}
    assert trained and all(torch.equal(out["served"][n], p) for n, p in trained.items())
    base = {n: p for n, p in out["trained"].items() if "lora_" not in n}
    from dta.model.models import load_model
    fresh = dict(load_model(model, dtype="float32").named_parameters())
    for n, p in base.items():
        key = n.replace("base_model.model.", "").replace(".base_layer", "")
        assert torch.equal(p, fresh[key].to(torch.bfloat16).float()), n  # bf16 compute
    assert any(not torch.equal(a, b) for a, b in zip(out["before"], out["after"]))


def test_dta_config_maps_lora_onto_the_actor():
    from dta.config.schema import load_config
    from runtime.areal.config import actor_config_from_dta

    cfg, _ = actor_config_from_dta(load_config(None, [
        "model.path=/nonexistent", "model.lora.r=8", "model.lora.alpha=4",
        "model.lora.target_modules=[q_proj,down_proj]"]))
    assert (cfg.use_lora, cfg.lora_rank, cfg.lora_alpha, cfg.target_modules) == \
        (True, 8, 4.0, ["q_proj", "down_proj"])
    assert not actor_config_from_dta(load_config(None, ["model.path=/x"]))[0].use_lora
    with pytest.raises(ValueError, match="model.lora.rslora"):
        actor_config_from_dta(load_config(None, ["model.path=/x", "model.lora.r=2",
                                                 "model.lora.rslora=true"]))

"""`dta train` with LoRA (model.lora.*): the worker as Ray runs it, in this process. Two steps
change the adapters only (every base weight bit-identical), the state counts the adapters'
gradients and optimizer only, the checkpoint holds the adapters only and resumes, and the
PEFT export loaded by ``PeftModel.from_pretrained`` into a fresh base gives the trained
model's log-probs (float32 <= 1e-6); the merged export too."""
from __future__ import annotations

import os

import pytest
import torch

peft = pytest.importorskip("peft", reason="the optional lora extra: pip install -e '.[lora]'")

from dta.config.keys import check_dta_train  # noqa: E402
from dta.config.schema import ConfigError, load_config  # noqa: E402
from dta.reference import sequence_logprobs  # noqa: E402
from tests.workers import state

LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj,down_proj]"]


def _cfg(*extra):
    return load_config(None, ["workload.scale=tiny", "optimizer.lr=1e-2", *LORA, *extra])


def _logprobs(model, batch):
    with torch.no_grad():
        return torch.cat([sequence_logprobs(model, ids)[0] for ids in batch.input_ids[:4]])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime.worker import build_replica
    from tests.workers import local_worker

    tmp = tmp_path_factory.mktemp("lora")
    cfg = _cfg()
    threads = torch.get_num_threads()
    try:
        w = local_worker(cfg)
        before = {k: v.clone() for k, v in w.model.state_dict().items()}
        source = BatchSource(cfg, 512)
        stats = [w.step(k, source.batch(k), None) for k in range(2)]
        ckpt = w.save_checkpoint(str(tmp / "ckpt"), 2, {})
        export = w.export_hf(str(tmp / "adapter"))
    finally:
        torch.set_num_threads(threads)
    plain = load_config(None, ["workload.scale=tiny"])
    return dict(cfg=cfg, worker=w, before=before, stats=stats, ckpt=ckpt, export=export,
                base=lambda: build_replica(plain), batch=source.batch(0), tmp=tmp)


def test_two_steps_change_the_adapters_only(trained):
    w, before = trained["worker"], trained["before"]
    after = w.model.state_dict()
    trainable = {n for n, p in w.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for k, v in after.items():
        if k in trainable:
            assert not torch.equal(v, before[k]), k
        else:
            assert torch.equal(v, before[k]), k  # bit-identical base
    fresh = trained["base"]().state_dict()  # the base is the configured model's, unchanged
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
            for k, v in after.items() if k not in trainable}
    assert set(base) == set(fresh) and all(torch.equal(base[k], fresh[k]) for k in fresh)


def test_state_bytes_count_the_adapters(trained):
    w, sb = trained["worker"], trained["stats"][-1]["state_bytes"]
    adapters = sum(p.numel() * p.element_size() for p in w.model.parameters() if p.requires_grad)
    every = sum(p.numel() * p.element_size() for p in w.model.parameters())
    assert sb["grads"] == adapters and sb["optimizer"] == 2 * adapters + 4 * len(
        [p for p in w.model.parameters() if p.requires_grad])  # exp_avg, exp_avg_sq, step
    assert sb["params"] == every and adapters < every / 10


def test_checkpoint_holds_the_adapters_and_resumes(trained):
    from runtime.checkpoints.files import read_dcp_metadata
    from tests.workers import local_worker

    w = trained["worker"]
    held = read_dcp_metadata(trained["ckpt"]).state_dict_metadata  # the one format's index
    saved = {k[len("logical.model."):]: tuple(m.size) for k, m in held.items()
             if k.startswith("logical.model.")}
    trainable = {n: p for n, p in w.model.named_parameters() if p.requires_grad}
    assert saved == {n: tuple(p.shape) for n, p in trainable.items()}  # the adapters only
    assert not any(k.startswith("logical.model.") and "lora_" not in k for k in held)
    threads = torch.get_num_threads()
    try:
        fresh = local_worker(trained["cfg"])
    finally:
        torch.set_num_threads(threads)
    assert fresh.load_checkpoint(trained["ckpt"])["step"] == 2
    for n, p in fresh.model.named_parameters():
        assert torch.equal(p, w.model.get_parameter(n)), n


def test_exported_adapter_loads_with_peft(trained):
    files = sorted(os.listdir(trained["export"]))
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    loaded = peft.PeftModel.from_pretrained(trained["base"](), trained["export"])
    batch = trained["batch"]
    want = _logprobs(trained["worker"].model, batch)
    got = _logprobs(loaded, batch)
    assert float((got - want).abs().max()) <= 1e-6
    base = _logprobs(trained["base"](), batch)
    assert float((base - want).abs().max()) > 1e-4  # the adapters changed the model


def test_merged_export(trained):
    from transformers import AutoModelForCausalLM

    w = trained["worker"]
    w.cfg.train.export_merged = True
    try:
        path = w.export_hf(str(trained["tmp"] / "merged"))
    finally:
        w.cfg.train.export_merged = False
    assert "adapter_config.json" not in os.listdir(path)
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = trained["batch"]
    assert float((_logprobs(merged, batch) - _logprobs(w.model, batch)).abs().max()) <= 1e-5
    assert hasattr(w.model, "peft_config")  # the trained model is left a PEFT model
    assert any(p.requires_grad for p in w.model.parameters())


@pytest.mark.parametrize("override, match", [
    ("model.lora.dropout=0.1", "model.lora.dropout.*dropout mask"),
])
def test_lora_settings_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        check_dta_train(_cfg(override))


def test_fsdp_refuses_a_lora_base_naming_the_key():
    """fsdp holds no frozen weights: refused by the one model-fit rule
    (runtime.engine.layout.check_model_fit), which dta train runs before Ray starts; the
    config alone is valid (the rule needs the model)."""
    from runtime.errors import TrainingError
    from runtime.ray_runtime.driver import Trainer

    cfg = _cfg("train.sharding=fsdp")
    check_dta_train(cfg)
    with pytest.raises(TrainingError, match=r"^bad value for config key 'train.sharding': "
                                            r"sharding=fsdp trains every weight; this model "
                                            r"has frozen ones \(a LoRA base\)"):
        Trainer(cfg)


def test_lora_keys_need_a_rank():
    with pytest.raises(ConfigError, match="model.lora.alpha' has no effect without LoRA"):
        check_dta_train(load_config(None, ["model.lora.alpha=4"]))
    check_dta_train(_cfg())  # with r > 0 they are used


def test_unknown_target_named():
    from dta.model.lora import LoraError
    from runtime.ray_runtime.worker import build_replica

    with pytest.raises(LoraError, match="model.lora.target_modules=\\['nope_proj'\\]"):
        build_replica(load_config(None, ["model.lora.r=2", "model.lora.target_modules=[nope_proj]"]))


def _zero1_ranks(rank, world, extra):
    from tests.test_sharding import _step
    from tests.workers import local_worker

    cfg = _cfg(*extra)
    w = local_worker(cfg, rank, world)
    stats = [_step(w, cfg, k, rank, world) for k in range(2)]
    return {"state": state(w)["model"], "state_bytes": stats[-1]["state_bytes"],
            "sharding": stats[-1]["sharding"]}


@pytest.mark.slow  # two spawned gloo ranks: ~100 s on the loaded 2-core machine
def test_zero1_lora_equals_one_process():
    """zero1 on 2 gloo ranks shards the adapters' masters and AdamW state; after 2 steps the
    model equals one process's (float32 <= 1e-6), the base untouched."""
    from experiments.local_ranks import run_ranks
    from tests.test_sharding import rel_l2

    extra = ("train.sharding=zero1", "optimizer.max_grad_norm=0.5")
    one = run_ranks(_zero1_ranks, 1, extra)[0]
    two = run_ranks(_zero1_ranks, 2, extra)
    assert [r["sharding"] for r in two] == ["zero1", "zero1"]
    assert rel_l2(two[0]["state"], one["state"]) <= 1e-6
    assert all(torch.equal(two[0]["state"][k], two[1]["state"][k]) for k in one["state"])
    adapters = {k for k in one["state"] if "lora_" in k}
    sb = two[0]["state_bytes"]
    adapter_bytes = sum(one["state"][k].numel() * 4 for k in adapters)
    assert sb["optimizer"] <= 2 * adapter_bytes // 2 + 4 * len(adapters) + 64  # half: sharded


def test_memory_model_prices_the_adapters():
    """dta.planning.memory.lora_params counts what peft adds; with_lora keeps the frozen base
    as params and prices grads/optimizer for the adapters only."""
    from dta.model.lora import apply_lora
    from dta.model.models import build_model
    from dta.planning.memory import estimate, lora_params, with_lora

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "lm_head"]
    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    config = model.config
    n_base = sum(p.numel() for p in model.parameters())
    pm = apply_lora(model, r=4, alpha=8, target_modules=targets)
    adapters = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    assert lora_params(config, 4, targets) == adapters
    full = estimate(config, 1, "replicate", path_tokens=64, call_tokens=16,
                    compute_dtype="float32")
    lora = with_lora(full, config, adapters, compute_dtype="float32")
    assert lora.grads == 4 * adapters and lora.optimizer == 8 * adapters
    assert full.grads == 4 * (full.params // 4)  # the full run: every weight's gradient
    assert lora.params >= 4 * n_base and lora.state < full.state
    with pytest.raises(ValueError, match="fsdp is not offered with LoRA"):
        with_lora(estimate(config, 2, "fsdp", path_tokens=64, call_tokens=16), config, adapters)

"""The dta verl engine with LoRA (``lora_rank > 0``), float64, against verl's own FSDP engine
with the same adapters: the adapters' gradients (rel. <= 1e-10), ``disable_adapter`` giving
the base model's log-probs (verl's reference policy), and ``get_per_tensor_param``'s export
equal to verl's merged-LoRA export (``lora.merge``) by name and value; and bad batches
refused before anything is walked."""
from __future__ import annotations

import pytest
import torch

from tests.test_verl import (  # noqa: F401
    HFModelConfig,
    assert_close_dicts,
    assert_close_rows,
    fp64_verl,
    grads,
    grpo,
    log_probs,
    make_engine,
    model_dir,
    records,
    verl_batch,
    world1,
)

pytestmark = pytest.mark.verl

LORA = dict(lora_rank=4, lora_alpha=8, target_modules="all-linear", lora={"merge": True})


def _set_adapters(engine, seed: int = 3):
    """The same nonzero adapters on both engines (peft starts B at 0, and the two engines'
    random A differ), by parameter name."""
    g = torch.Generator().manual_seed(seed)
    named = sorted((n.replace("_fsdp_wrapped_module.", ""), p)
                   for n, p in engine.module.named_parameters() if "lora_" in n)
    assert named, "no LoRA parameters"
    with torch.no_grad():
        for _, p in named:
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(0.05 * torch.randn(local.shape, generator=g, dtype=torch.float64))
    return [n for n, _ in named]


def _lora_engine(backend, path, monkeypatch):
    original = HFModelConfig.__init__

    def with_lora(self, *a, **kw):
        original(self, *a, **{**LORA, **kw})

    with monkeypatch.context() as m:
        m.setattr(HFModelConfig, "__init__", with_lora)
        return make_engine(backend, path, "fp64")


def test_lora_gradients_reference_policy_and_export_match_verl(model_dir, records, world1,
                                                               fp64_verl, monkeypatch):
    fsdp = _lora_engine("fsdp2", model_dir, monkeypatch)
    dta = _lora_engine("dta", model_dir, monkeypatch)
    base = make_engine("dta", model_dir, "fp64")
    names_f, names_d = _set_adapters(fsdp), _set_adapters(dta)
    assert [n.replace("base_model.model.", "") for n in names_f] == \
        [n.replace("base_model.model.", "") for n in names_d]
    td = verl_batch(records, dtype=torch.float64)
    loss = grpo("token-mean")
    for engine in (fsdp, dta):
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(td.clone(), loss)
    gf, gd = grads(fsdp), grads(dta)
    assert gd and all("lora_" in k for k in gd)  # the base is frozen
    assert_close_dicts(gd, gf, 1e-10, "LoRA gradients")

    # the reference policy: adapters off = the base model
    lp_base, _ = log_probs(base, td)
    with dta.disable_adapter():
        lp_off, _ = log_probs(dta, td)
    lp_on, _ = log_probs(dta, td)
    assert_close_rows(lp_off, lp_base, 1e-12, "log_probs with the adapters disabled")
    assert max(float((a - b).abs().max()) for a, b in zip(lp_on, lp_base)) > 1e-6

    # the rollout's weights: merged, by Hugging Face name, as verl's lora.merge exports them
    exp_f, cfg_f = fsdp.get_per_tensor_param()
    exp_f = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in exp_f}
    exp_d, cfg_d = dta.get_per_tensor_param()
    exp_d = dict(exp_d)
    assert cfg_f is None and cfg_d is None
    assert set(exp_d) == set(exp_f) == set(base.module.state_dict())
    assert all(v.dtype == torch.float64 for v in exp_d.values())
    # verl sends its sharded weights to the rollout in bfloat16: the same values once cast
    for k, v in exp_f.items():
        assert torch.equal(exp_d[k].to(v.dtype), v), f"merged LoRA export: {k}"
    assert any(v.dtype == torch.bfloat16 for v in exp_f.values())
    # exporting left the adapters unmerged
    lp_again, _ = log_probs(dta, td)
    assert_close_rows(lp_again, lp_on, 0.0, "log_probs after the export")


def test_bad_batches_are_refused_naming_the_row(model_dir, records, world1):
    from verl.utils import tensordict_utils as tu

    from runtime.verl import DTAEngineConfig

    with pytest.raises(ValueError, match="unknown walk setting engine_config.dta.bogus"):
        DTAEngineConfig(dta={"bogus": 1})
    with pytest.raises(ValueError, match="engine_config.dta.block_tokens"):
        DTAEngineConfig(dta={"block_tokens": -1})
    with pytest.raises(NotImplementedError, match="mixed_precision.param_dtype='fp16' with "
                                                  "model_dtype='bf16'"):
        make_engine("dta", model_dir, "bf16", mixed_precision=dict(param_dtype="fp16"))
    from runtime.verl.config import check_engine_config

    with pytest.warns(UserWarning, match="mixed_precision.param_dtype is unset"):  # not silent
        check_engine_config(DTAEngineConfig(model_dtype="fp32", mixed_precision=None))

    engine = make_engine("dta", model_dir, "fp32")
    td = verl_batch(records, rows=[0, 1, 2])
    shifted = td.clone()
    pos = [p.clone() for p in shifted["position_ids"].unbind()]
    pos[1] = pos[1] + 3
    shifted["position_ids"] = torch.nested.as_nested_tensor(pos, layout=torch.jagged)
    with pytest.raises(ValueError, match="sequence 1: position_ids must be 0"):
        engine.infer_batch(shifted)
    per_row = td.clone()
    tu.assign_non_tensor(per_row, temperature=torch.tensor([0.8, 0.8, 1.0]))
    with pytest.raises(NotImplementedError, match="per-row temperatures"):
        engine.infer_batch(per_row)
    pi2 = td.clone()
    tu.assign_non_tensor(pi2, calculate_sum_pi_squared=True)
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared"):
        engine.infer_batch(pi2)

"""LoRA under the walk (dta/model/lora.py): a peft LoRA model trained by DFS equals the same PEFT
model trained one sequence at a time -- float64 <= 1e-10 on log-probs, loss, every adapter
gradient and one AdamW update (dta.verify) -- with no gradient into a frozen base weight,
on a deep tree of 1-4-token segments (the tree that crashed the walk before per-layer states
that need no gradient stopped being autograd leaves) plus the hard batch."""
import warnings

import numpy as np
import pytest

peft = pytest.importorskip("peft", reason="the optional lora extra: pip install -e '.[lora]'")

from dta.batch import Batch  # noqa: E402
from dta.losses import PPO  # noqa: E402
from dta.model.lora import LoraError, check_peft_model  # noqa: E402
from dta.model.modeling import ModelInterface  # noqa: E402
from dta.model.models import build_model, make_truly_float64  # noqa: E402
from dta.selfcheck import self_check  # noqa: E402
from dta.train import accumulate_gradients  # noqa: E402
from dta.verify import verify  # noqa: E402
from tests.cases import hard_sequences, make_records  # noqa: E402

LOSS = PPO(eps_clip=0.2, dual_clip=3.0)


def deep_sequences(vocab: int = 512, seed: int = 0, depth: int = 12) -> list[np.ndarray]:
    """A chain of 1-4-token segments to depth 12, a 1-3-token leaf off every level."""
    rng = np.random.default_rng(seed)
    seqs, cur = [], rng.integers(3, vocab, 2)
    for _ in range(depth):
        seqs.append(np.concatenate([cur, rng.integers(3, vocab, rng.integers(1, 4))]))
        cur = np.concatenate([cur, rng.integers(3, vocab, rng.integers(1, 5))])
    return seqs + [cur]


def lora_model(family: str, targets: list[str], *, rslora: bool = False, seed: int = 0,
               dtype: str = "float64", **overrides):
    """A tiny matrix model, frozen, with random A and B (peft's default B = 0 would make
    every A gradient exactly zero and the comparison of A vacuous)."""
    model = build_model(family, "tiny", dtype=dtype, seed=seed, matrix=True, **overrides)
    if dtype == "float64":
        make_truly_float64(model)
    modules = [t for t in targets if "experts" not in t]
    params = [t for t in targets if "experts" in t] or None  # MoE: fused expert weights
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules, target_parameters=params,
                             use_rslora=rslora, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def lora_batch(model, hard: int = 8, depth: int = 12) -> Batch:
    from dta.train import forward_logprobs

    seqs = deep_sequences(depth=depth) + hard_sequences(seed=3)[:hard]
    lp = forward_logprobs(model, Batch.from_records([{"input_ids": s} for s in seqs])).logprobs
    return Batch.from_records(make_records(seqs, prompt=3,
                                           old_logprobs=[x.double().numpy() for x in lp]))


# family, targets, policy, packing, extras: attention only, MLP only, the LM head (tied to
# a scaled embedding), a hybrid's recurrent and attention layers, MoE experts with rsLoRA
CASES = {
    "llama-attention": ("llama", ["q_proj", "k_proj", "v_proj", "o_proj"], "retain", "tree", {}),
    "qwen3-mlp": ("qwen3", ["gate_proj", "up_proj", "down_proj"], "recompute", "node", {}),
    "gemma3-tied-lm_head": ("gemma3", ["lm_head", "v_proj"], "retain", "auto",
                            dict(overrides=dict(tie_word_embeddings=True), temperature=0.7)),
    "qwen3_5-hybrid": ("qwen3_5", ["in_proj_qkv", "out_proj", "q_proj", "down_proj"],
                       "recompute", "node", dict(hard=0, depth=6)),  # node by node: a shorter chain
    "qwen3_moe-experts-rslora": ("qwen3_moe", ["v_proj", "mlp.experts.gate_up_proj",
                                               "mlp.experts.down_proj"], "retain", "auto",
                                 dict(rslora=True)),
}


def _check(report, model):
    for err in ("logprobs", "loss", "grad", "params", "update"):
        assert getattr(report, f"{err}_rel_err") <= 1e-10, (err, report)
    assert report.frozen_with_grad == 0, report
    assert 0 < report.trainable_parameters < report.parameters / 2
    assert report.passed(1e-10)


def _run(case, policy=None):
    family, targets, pol, packing, extra = CASES[case]
    model = lora_model(family, targets, rslora=extra.get("rslora", False),
                       **extra.get("overrides", {}))
    batch = lora_batch(model, extra.get("hard", 8), extra.get("depth", 12))
    report = verify(model, batch, LOSS, policy=policy or pol, packing=packing, logits_chunk=7,
                    temperature=extra.get("temperature", 1.0))
    _check(report, model)
    return model, report


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_float64_exact(case):
    _run(case)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["retain", "recompute"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_float64_exact_both_policies(case, policy):
    _run(case, policy)


def test_frozen_base_gets_no_gradient_and_frozen_states_are_no_leaves():
    """q/v adapters: layer 0's keys depend on no trainable weight (no leaf for them), its
    values do, and every layer above sees trainable weights below it. A walk leaves every
    base .grad None -- the hand-derived head and embedding paths included -- and gives
    every adapter a nonzero gradient."""
    model = lora_model("llama", ["q_proj", "v_proj"])
    io = ModelInterface(model)
    flags = io.state_needs_grad()
    assert flags[0] == (False, True)
    assert all(f == (True, True) for f in flags[1:])
    accumulate_gradients(model, Batch.from_records(make_records(deep_sequences(), prompt=1)),
                         LOSS, packing="node")
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and float(p.grad.norm()) > 0, name
        else:
            assert p.grad is None, name
    # freezing the adapters too: the fact is recomputed (nothing needs a gradient)
    for p in model.parameters():
        p.requires_grad_(False)
    assert all(f == (False, False) for f in io.state_needs_grad())


def test_lm_head_only_trains_without_decoder_backward():
    model = lora_model("qwen3", ["lm_head"])
    batch = Batch.from_records(make_records(deep_sequences(), prompt=1))
    res = accumulate_gradients(model, batch, LOSS)
    assert res.walk.backward_calls == 0  # nothing trainable below the head
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 and all(g is not None and float(g.norm()) > 0 for g in grads.values())


def test_self_check_probes_the_wrapped_model():
    model = lora_model("llama", ["q_proj", "lm_head"], dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the wrapped class is in the matrix: no warning
        report = self_check(model, raise_on_failure=True)
    assert report.model_class == "LlamaForCausalLM (LoRA)" and report.tested_class
    assert "LM head gradient (hand-derived)" in report.errors  # the LoRA head's A and B


@pytest.mark.parametrize("change, match", [
    (dict(lora_dropout=0.1), "lora_dropout=0.1 is refused .*dropout mask"),
    (dict(use_dora=True), "use_dora=True is refused"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_unsupported_lora_settings_refused_before_any_gradient(change, match):
    model = build_model("llama", "tiny", dtype="float32", seed=0)
    cfg = peft.LoraConfig(r=2, target_modules=["q_proj"], **change)
    pm = peft.get_peft_model(model, cfg)
    with pytest.raises(LoraError, match=match):
        accumulate_gradients(pm, Batch.from_records(make_records(deep_sequences()[:3])), LOSS)
    assert all(p.grad is None for p in pm.parameters())


def test_other_peft_types_refused():
    model = build_model("llama", "tiny", dtype="float32", seed=0)
    pm = peft.get_peft_model(model, peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                   feedforward_modules=["down_proj"]))
    with pytest.raises(LoraError, match="is IA3: DTA trains LoRA adapters only"):
        check_peft_model(pm)


def test_plain_model_unchanged_by_the_state_fact():
    """A fully trainable model: every state is a leaf, as before."""
    model = build_model("llama", "tiny", dtype="float32", seed=0)
    assert all(f == (True, True) for f in ModelInterface(model).state_needs_grad())
    assert all(p.grad is None for p in model.parameters())  # the probe trains nothing


def test_cli_verify_lora(capsys):
    import json

    from dta_cli.main import main

    code = main(["verify", "--family", "qwen3", "--dtype", "float64", "--lora", "2",
                 "--lora-targets", "k_proj,up_proj,lm_head", "--rslora", "--max-sequences", "6",
                 "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["passed"] and report["max_rel_err"] <= 1e-10
    assert report["lora_r"] == 2 and report["frozen_with_grad"] == 0
    assert 0 < report["trainable_parameters"] < report["parameters"] / 4

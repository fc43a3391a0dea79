"""The verl backend (runtime/verl): the dta engine against verl 0.9.1's own FSDP engine
(``FSDPEngineWithLMHead``, FSDP2, on CPU through runtime.verl's cpu platform), on the same
batch and verl's own GRPO loss (``verl.workers.utils.losses.ppo_loss``), in every loss
aggregation mode: log-probs, entropy, loss and every gradient, in float64 (rel. <= 1e-10) and
float32 (<= 1e-4), on τ²-airline multi-turn rows whose prompts are other rows' conversations
(prefixes shared across rows), and one optimizer update.

Runs where the ``verl`` extra is installed (``scripts/setup.sh --verl``); elsewhere the module
is skipped with its reason, and tests/test_verl_extra.py fails when CI requires the extra.
The helpers here are shared by tests/test_verl_*.py.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="the optional verl extra is not installed "
                                   "(bash scripts/setup.sh --verl)")
pytestmark = pytest.mark.verl

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # first: registers the cpu platform (before verl's first device query) and the dta engine
    from tensordict import TensorDict  # noqa: E402
    from verl.trainer.config import CheckpointConfig  # noqa: E402
    from verl.workers.config import ActorConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
    from verl.workers.engine.base import EngineRegistry  # noqa: E402
    from verl.workers.utils.losses import ppo_loss  # noqa: E402

    import runtime.verl  # noqa: E402,F401
    from runtime.verl import DTAEngineConfig, use_cpu_platform  # noqa: E402
    from runtime.verl.records import records_to_verl  # noqa: E402

from dta.model.models import build_model, make_truly_float64, save_word_tokenizer  # noqa: E402
from experiments.workloads import make_workload  # noqa: E402

VOCAB = 512
TEMPERATURE = 0.8
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LR = 1e-3


# ------------------------------------------------------------------------ fixtures --
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 (vocab 512) with a word-level tokenizer, as verl's configs load."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    build_model("qwen3", "tiny", dtype="float32", seed=0).save_pretrained(path)
    return save_word_tokenizer(path, VOCAB)


@pytest.fixture(scope="module")
def records():
    """τ²-airline at tiny scale: 9 rows, each a later call of a conversation whose earlier
    calls are other rows (3.3x sharing); the last assistant reply is trained."""
    return make_workload("tau2-airline", scale="tiny", seed=0, vocab_size=VOCAB).records


@pytest.fixture
def world1(tmp_path, monkeypatch):
    """verl on CPU in a world-size-1 gloo group (file rendezvous: nothing listens)."""
    import torch.distributed as dist

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    use_cpu_platform()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fp64_verl(monkeypatch):
    """verl's dtype table with ``fp64`` (verl has none), so its FSDP engine runs in float64."""
    from verl.utils import torch_dtypes

    original = torch_dtypes.PrecisionType.to_dtype

    def to_dtype(precision):
        return torch.float64 if precision in ("fp64", "float64", torch.float64) else \
            original(precision)

    monkeypatch.setattr(torch_dtypes.PrecisionType, "to_dtype", staticmethod(to_dtype))


# ------------------------------------------------------------------------- helpers --
def engine_kw(dtype: str, **extra) -> dict:
    return dict(model_dtype=dtype, fsdp_size=1, use_torch_compile=False,
                mixed_precision=dict(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype),
                **extra)


def make_engine(backend: str, path: str, dtype: str, *, clip_grad: float = 1.0, lr: float = LR,
                weight_decay: float = 0.01, dta: dict | None = None, remove_padding: bool = True,
                model: dict | None = None, **engine):
    """verl's engine for ``backend`` from the registry (``fsdp2``: verl's own FSDP engine, built
    directly: verl registers it for cuda / npu only), initialized; ``model``: more
    ``HFModelConfig`` keys."""
    from verl.workers.config import FSDPEngineConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model = HFModelConfig(path=path, use_remove_padding=remove_padding,
                          override_config={"attn_implementation": "sdpa"}, **(model or {}))
    optim = FSDPOptimizerConfig(lr=lr, clip_grad=clip_grad, weight_decay=weight_decay,
                                lr_warmup_steps=0, total_training_steps=10)
    if backend == "dta":
        cfg = DTAEngineConfig(**{**engine_kw(dtype), **engine}, dta=dict(dta or {}))
        engine = EngineRegistry.new("language_model", "dta", model_config=model,
                                    engine_config=cfg, optimizer_config=optim,
                                    checkpoint_config=CheckpointConfig())
    else:
        cfg = FSDPEngineConfig(strategy=backend, **{**engine_kw(dtype), **engine})
        engine = FSDPEngineWithLMHead(model_config=model, engine_config=cfg,
                                      optimizer_config=optim, checkpoint_config=CheckpointConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.initialize()
    if dtype == "fp64":  # HF's norms round to float32 inside a float64 model: not on either side
        make_truly_float64(engine.module)
    return engine


def verl_batch(records, *, old_logprobs=None, noise_seed: int = 0, dtype=torch.float32,
               rows=None, micro_batch_size: int | None = None) -> TensorDict:
    """The records as verl's trainer hands them to an engine (``records_to_verl``), with
    ``old_log_probs`` given or drawn around the tiny model's log-probs (-6.2 +- 0.3), so the
    clipped ratios differ from 1 both ways."""
    recs = [records[i] for i in (rows if rows is not None else range(len(records)))]
    if old_logprobs is None:
        R = max(len(r["input_ids"]) - int(np.argmax(np.asarray(r["loss_mask"]) > 0))
                for r in recs)
        g = torch.Generator().manual_seed(noise_seed)
        old_logprobs = -6.0 + 0.3 * torch.randn(len(recs), R, generator=g, dtype=torch.float64)
    return records_to_verl(recs, temperature=TEMPERATURE, old_logprobs=old_logprobs,
                           dtype=dtype, micro_batch_size=micro_batch_size)


def grpo(agg_mode: str, *, entropy_coeff: float = 0.01):
    """verl's actor loss as its trainer binds it: ``ppo_loss`` with a GRPO actor config
    (vanilla clipped objective, dual clip, entropy bonus)."""
    config = ActorConfig(strategy="fsdp", rollout_n=3, ppo_micro_batch_size_per_gpu=1,
                         loss_agg_mode=agg_mode, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         entropy_coeff=entropy_coeff)
    return functools.partial(ppo_loss, config)


def loss_fn(config):
    return lambda model_output, data, dp_group=None: ppo_loss(config, model_output, data, dp_group)


def clone(td: TensorDict) -> TensorDict:
    return td.clone()


def log_probs(engine, td) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    out = engine.infer_batch(clone(td))["model_output"]
    return list(out["log_probs"].unbind()), list(out["entropy"].unbind())


def grads(engine) -> dict[str, torch.Tensor]:
    module = engine.module
    out = {}
    for name, p in module.named_parameters():
        g = p.grad
        if g is None:
            continue
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        out[name.replace("_fsdp_wrapped_module.", "")] = g.detach().double().clone()
    return out


def params(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = p.detach().double().clone()
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_close_rows(got, want, tol, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what} row {i}: {tuple(g.shape)} vs {tuple(w.shape)}"
        assert rel(g, w) <= tol, f"{what} row {i}: rel. error {rel(g, w):.3e} > {tol}"


def assert_close_dicts(got, want, tol, what):
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    worst = max((rel(got[k], want[k]), k) for k in want)
    assert worst[0] <= tol, f"{what}: {worst[1]} rel. error {worst[0]:.3e} > {tol}"


def forward_backward(engine, td, loss):
    engine.optimizer_zero_grad()
    out = engine.forward_backward_batch(clone(td), loss, forward_only=False)
    return float(sum(out["loss"])), grads(engine)


# --------------------------------------------------------------------------- tests --
TOLERANCE = {"fp64": 1e-10, "fp32": 1e-4}


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
def test_dta_matches_verl_fsdp_every_agg_mode(model_dir, records, world1, fp64_verl, dtype):
    """verl's FSDP engine (the whole batch as one micro-batch) vs the dta engine (the batch
    as one prefix tree, verl's loss once per row): log-probs and entropy at every position,
    then for each aggregation mode the loss and every gradient, then one optimizer update."""
    tol = TOLERANCE[dtype]
    fsdp = make_engine("fsdp2", model_dir, dtype)
    dta = make_engine("dta", model_dir, dtype)
    td = verl_batch(records, dtype=torch.float64 if dtype == "fp64" else torch.float32)
    lp_f, ent_f = log_probs(fsdp, td)
    lp_d, ent_d = log_probs(dta, td)
    assert_close_rows(lp_d, lp_f, tol, "log_probs")
    assert_close_rows(ent_d, ent_f, tol, "entropy")
    assert dta.last["tree_token_ratio"] > 2.0  # the rows do share prefixes
    for mode in AGG_MODES:
        loss = grpo(mode)
        lf, gf = forward_backward(fsdp, td, loss)
        ld, gd = forward_backward(dta, td, loss)
        assert abs(ld - lf) <= tol * abs(lf), f"{mode}: loss {ld} vs {lf}"
        assert len(gf) == len(list(fsdp.module.parameters()))
        assert_close_dicts(gd, gf, tol, f"{mode}: gradients")
    # the walk's options from the engine config: recompute, nodes cut into blocks of 16 tokens
    if dtype == "fp64":
        cut = make_engine("dta", model_dir, dtype,
                          dta=dict(policy="recompute", block_tokens=16, packing="node"))
        assert (cut.options.policy, cut.options.block_tokens) == ("recompute", 16)
        lf, gf = forward_backward(fsdp, td, grpo("token-mean"))
        lc, gc = forward_backward(cut, td, grpo("token-mean"))
        assert abs(lc - lf) <= tol * abs(lf)
        assert_close_dicts(gc, gf, tol, "recompute, blocks of 16: gradients")
        assert cut.last["dta_forwarded_tokens"] > dta.last["dta_forwarded_tokens"]  # re-forwards
    # normalizers the caller left unset: verl takes them from each micro-batch (here the whole
    # batch), the dta engine from the whole batch before splitting it into rows
    from verl.utils import tensordict_utils as tu

    unset = td.clone()
    tu.assign_non_tensor(unset, global_batch_size=None)
    del unset["max_response_len"]
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum-norm"):
        lf, gf = forward_backward(fsdp, unset, grpo(mode))
        ld, gd = forward_backward(dta, unset, grpo(mode))
        assert abs(ld - lf) <= tol * abs(lf), f"{mode}, normalizers unset: loss {ld} vs {lf}"
        assert_close_dicts(gd, gf, tol, f"{mode}, normalizers unset: gradients")
    # one update (the last mode's gradients): AdamW + clipping, same parameters after
    for engine in (fsdp, dta):
        engine.optimizer_step()
    assert_close_dicts(params(dta), params(fsdp), tol, "parameters after one update")


def test_mixed_precision_keeps_fp32_masters(model_dir, records, world1):
    """verl's mixed precision (``model_dtype: fp32``, ``mixed_precision.param_dtype: bf16``):
    the model computes in bfloat16, the optimizer steps fp32 master weights (the engine
    core's ``master_dtype``); the gradient is the fp32 engine's to bfloat16 rounding, and the
    step moves the masters by the fp32 engine's step to that rounding. A narrower
    ``model_dtype`` than ``param_dtype`` is refused naming both keys."""
    mp = dict(param_dtype="bf16", reduce_dtype="fp32", buffer_dtype="fp32")
    mixed = make_engine("dta", model_dir, "fp32", mixed_precision=mp)
    full = make_engine("dta", model_dir, "fp32")
    assert mixed.core.compute_dtype == torch.bfloat16
    assert {p.dtype for p in mixed.module.parameters()} == {torch.bfloat16}
    masters = [p for g in mixed.optimizer.param_groups for p in g["params"]]
    assert masters and {p.dtype for p in masters} == {torch.float32}
    before = [p.detach().clone() for p in masters]
    td = verl_batch(records)
    # a forward-only engine (verl's reference policy) holds the bf16 weights alone: the same
    # log-probs as the trained engine's bf16 copy
    ref = make_engine("dta", model_dir, "fp32", mixed_precision=mp, forward_only=True)
    assert ref.lr_scheduler is None
    assert {p.dtype for p in ref.module.parameters()} == {torch.bfloat16}
    assert_close_rows(log_probs(ref, td)[0], log_probs(mixed, td)[0], 0.0, "reference log_probs")
    loss = grpo("token-mean")
    lm, gm = forward_backward(mixed, td, loss)
    lf, gf = forward_backward(full, td, loss)
    assert abs(lm - lf) <= 0.05 * abs(lf)
    worst = max(rel(gm[k], gf[k]) for k in gf)
    assert worst <= 0.05, f"bf16 gradient vs fp32: {worst:.3g}"
    mixed.optimizer_step()
    assert all(not torch.equal(m, b) for m, b in zip(masters, before))  # the masters stepped
    for (name, p), m in zip(mixed.module.named_parameters(), masters):  # the model: their cast
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), name
    with pytest.raises(NotImplementedError, match="param_dtype='fp32' with model_dtype='bf16'"):
        make_engine("dta", model_dir, "bf16", mixed_precision=dict(param_dtype="fp32"))

"""The AReaL backend (runtime/areal): DTATrainEngine against AReaL 1.0.4 itself.

Runs in the areal venv (see runtime/areal/README.md):
    .venv-areal/bin/python -m pytest tests/test_areal.py -m areal
and is skipped where areal is not installed.

* float32: AReaL's own FSDPEngine (CPU, gloo, world size 1, one sequence per micro-batch:
  sdpa ignores packed-sequence boundaries) and DTATrainEngine run the same step with AReaL's
  grpo_loss_fn (decoupled loss, eps_clip 0.4, rejection sampling {metric: ratio, upper: 5.0}
  as in AReaL's tau2 example) on a τ²-shaped batch: same log-probs, gradients, updated
  parameters, returned stats and loss statistics.
* float64: FSDPEngine cannot run float64 (AReaL's config and its log-prob kernel are float32),
  so a per-sequence reference of FSDPEngine.train_batch — AReaL's own micro-batching, packing,
  padding and loss_fn, a plain HF forward per micro-batch, the same clip and AdamW — is checked
  against FSDPEngine in float32 above and against DTATrainEngine here, on a truly float64
  model: relative error <= 1e-10.
* AReaL's PPOActor (compute_logp, compute_advantages, ppo_update) for 2 steps on the engine;
  a skipped update on a non-finite gradient norm; HF save/load with the optimizer state;
  tree statistics; every abstract member of TrainEngine defined.

FSDPEngine's log-prob kernel is wrapped in torch.compile (about 34 s to compile on 2 cores);
the tests run it eagerly (torch._dynamo disabled while they run): the same Python function.
"""
from __future__ import annotations

import copy
import functools
import inspect
import math
import os
import socket

import numpy as np
import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from areal.api.cli_args import (  # noqa: E402
    MicroBatchSpec,
    OptimizerConfig,
    RejectionSamplingConfig,
    TrainEngineConfig,
)
from areal.api.engine_api import TrainEngine  # noqa: E402
from areal.api.io_struct import FinetuneSpec  # noqa: E402
from areal.trainer.ppo.actor import grpo_loss_fn  # noqa: E402
from areal.utils import stats_tracker  # noqa: E402
from areal.utils.data import (  # noqa: E402
    amend_position_ids,
    pack_tensor_dict,
    pad_mb_list,
    split_padded_tensor_dict_into_mb_list,
    unsqueeze_mb_list,
)

from dta.model.models import build_model, load_model, make_truly_float64, save_word_tokenizer  # noqa: E402
from experiments.workloads import make_workload  # noqa: E402
from runtime.areal import (  # noqa: E402
    DTAOptions,
    DTAPPOActor,
    DTATrainEngine,
    convert,  # noqa: E402
)

VOCAB = 512
TEMPERATURE = 0.8
FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=64, train_batch_size=8)
# AReaL's tau2 example (examples/tau2/dta/config_1.7b_airline_dta.yaml): the 1.0.4 keys
RS = dict(metric="ratio", upper=5.0)
LOSS_KW = dict(eps_clip=0.4, eps_clip_higher=None, c_clip=None, use_decoupled_loss=True)


def loss_weight_fn(mb):  # PPOActor's
    return mb["loss_mask"].count_nonzero()


def grpo(current_version: int = 0):
    return functools.partial(grpo_loss_fn, **LOSS_KW, current_version=current_version,
                             rejection_sampling=RejectionSamplingConfig(**RS))


# ------------------------------------------------------------------------ fixtures --
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen3 (vocab 512) with a word-level tokenizer, as FSDPEngine needs."""
    path = str(tmp_path_factory.mktemp("tiny-qwen3"))
    build_model("qwen3", "tiny", dtype="float32", seed=0).save_pretrained(path)
    return save_word_tokenizer(path, VOCAB)


@pytest.fixture(scope="module")
def records():
    return make_workload("tau2-airline", scale="tiny", seed=0, vocab_size=VOCAB).records


@pytest.fixture
def eager_areal(monkeypatch):
    """AReaL's log-prob kernel without the 34 s torch.compile, world-size-1 settings, and no
    listening socket left behind beyond loopback (tests/test_runtime.py checks that Ray's
    processes, this one included, listen on loopback only)."""
    import torch._dynamo

    from runtime.ray_runtime.cluster import listening_addresses

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME="lo").items():
        monkeypatch.setenv(key, value)
    stats_tracker.export_all()  # start from an empty tracker
    with torch._dynamo.config.patch(disable=True):
        yield
    stats_tracker.export_all()
    wide = [x for x in listening_addresses([os.getpid()]) if not x.loopback]
    assert not wide, f"a test left a socket listening beyond loopback: {wide}"


@pytest.fixture
def gloo_world1(eager_areal, tmp_path):
    """A world-size-1 gloo group for FSDPEngine, rendezvous through a file (env:// would start
    a TCPStore listening on every interface, which outlives the group in this process)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def engine_config(path, n_seqs, cls=TrainEngineConfig, **kw):
    optim = kw.pop("optimizer", None) or OptimizerConfig(
        lr=1e-3, eps=kw.pop("eps", 1e-8), weight_decay=0.01, gradient_clipping=1.0,
        lr_scheduler_type="constant", warmup_steps_proportion=0.0)
    kw.setdefault("backend", "fsdp:d1")
    kw.setdefault("dtype", "float32")
    return cls(experiment_name="dta", trial_name="test", path=path, attn_impl="sdpa",
               optimizer=optim, temperature=TEMPERATURE,
               mb_spec=MicroBatchSpec(n_mbs=n_seqs), **kw)


def ids_only(batch):
    return {k: batch[k].clone() for k in ("input_ids", "attention_mask")}


def make_train_batch(records, current_logp: torch.Tensor, seed: int = 0):
    """AReaL's training form (what PPOActor hands to train_batch): rolled fields; prox_logp
    near the model's own log-probs (ratios straddle the clip range 1 ± 0.4) and behaviour
    log-probs whose importance weight exp(prox - old) exceeds the rejection bound 5 on some
    tokens."""
    batch = convert.from_records(records, rolled=True)
    g = torch.Generator().manual_seed(seed)
    mask = batch["loss_mask"].bool()
    prox = current_logp.float() + 0.3 * torch.randn(mask.shape, generator=g)
    delta = -0.8 + 3.0 * torch.rand(mask.shape, generator=g)  # log weight in [-0.8, 2.2]
    prox = prox.clamp_max(0.0)  # log-probs are <= 0 (dta.records.fields rejects positive ones)
    batch["prox_logp"] = torch.where(mask, prox, 0.0)
    batch["logprobs"] = torch.where(mask, (prox - delta).clamp_max(0.0), 0.0)
    batch["versions"] = torch.where(mask, 0, -1).to(torch.int32)
    return batch


def params_of(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def grads_of(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            g = torch.zeros_like(p.full_tensor() if hasattr(p, "full_tensor") else p)
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def max_rel(a: dict, b: dict) -> float:
    """max over tensors of ||a - b|| / ||b|| (relative L2 per tensor, as dta.verify)."""
    worst = 0.0
    for name, ref in b.items():
        diff = float((a[name].to(ref.dtype) - ref).norm())
        denom = float(ref.norm())
        worst = max(worst, diff / denom if denom > 0 else diff)
    return worst


# ----------------------------------------- a per-sequence reference of FSDPEngine --
def _reference_micro_batches(batch):
    """FSDPEngine._prepare_mb_list with MicroBatchSpec(n_mbs=B): one sequence per micro-batch,
    packed and padded by AReaL's own functions."""
    data = amend_position_ids(dict(batch))
    n = data["attention_mask"].shape[0]
    mb_list = split_padded_tensor_dict_into_mb_list(data, MicroBatchSpec(n_mbs=n))
    assert len(mb_list.mbs) == n, "expected one sequence per micro-batch"
    mb_list.mbs = [pack_tensor_dict(mb) for mb in mb_list.mbs]
    return unsqueeze_mb_list(pad_mb_list(mb_list, pad_value=0.0))


def _reference_logits(model, padded):
    return model(input_ids=padded["input_ids"], position_ids=padded["position_ids"]).logits[0]


def _gather(logits, labels, temperature):
    """AReaL's _gather_logprobs_entropy, kept in float64 for a float64 model (AReaL casts
    logits to float32: exactly this in float32)."""
    z = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    lsm = torch.log_softmax(z, dim=-1)
    return lsm.gather(-1, labels[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)


@torch.no_grad()
def reference_forward(model, batch, temperature):
    mb_list = _reference_micro_batches(batch)
    outs = []
    for item in mb_list:
        padded = item.padded_mb
        labels = torch.roll(padded["input_ids"][0], -1)
        lp, _ = _gather(_reference_logits(model, padded), labels, temperature)
        outs.append(lp[:len(lp) - item.padding_length])
    lens = [len(o) for o in outs]
    ordered = [outs[mb_list.backward_indices[i]] for i in range(len(outs))]
    assert [len(o) for o in ordered] == [lens[mb_list.backward_indices[i]] for i in range(len(outs))]
    return torch.nn.utils.rnn.pad_sequence(ordered, batch_first=True)


def reference_train_batch(model, optimizer, batch, loss_fn, temperature, clip):
    """FSDPEngine.train_batch at world size 1 with one sequence per micro-batch
    (fsdp_engine.py:760-798, 2052-2120, 682-713)."""
    optimizer.zero_grad()
    mb_list = _reference_micro_batches(batch)
    total = torch.stack([loss_weight_fn(mb) for mb in mb_list.mbs]).sum().to(torch.float32)
    losses = []
    for item in mb_list:
        padded, mb = item.padded_mb, item.orig_mb
        logits = _reference_logits(model, padded)
        labels = torch.roll(padded["input_ids"][0], -1)
        logp, ent = _gather(logits, labels, temperature)
        vmin = logits.detach().min(-1).values.float()
        vmax = logits.detach().max(-1).values.float()
        n = len(logp) - item.padding_length
        w = loss_weight_fn(mb)
        if w == 0:
            continue
        # FSDPEngine's ratio, in the model's dtype (float32: FSDPEngine's own; float64: the
        # exact weight, as DTA takes it -- a float32 ratio would round each weight)
        loss = loss_fn(logp[:n], ent[:n], mb, vocab_min_logits=vmin[:n],
                       vocab_max_logits=vmax[:n]) * (w / total.to(logits.dtype))
        loss.backward()
        losses.append(float(loss.detach()))
    params = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
    if not math.isfinite(norm):
        optimizer.zero_grad()
        return dict(update_successful=0.0, grad_norm=norm, loss=sum(losses))
    optimizer.step()
    return dict(update_successful=1.0, grad_norm=norm, loss=sum(losses))


def reference_optimizer(model, oc):
    return torch.optim.AdamW(model.parameters(), lr=oc.lr, weight_decay=oc.weight_decay,
                             betas=(oc.beta1, oc.beta2), eps=oc.eps, fused=True)


def new_engine(config, dta=None, cls=DTATrainEngine):
    engine = cls(config, dta)
    engine.create_process_group()
    engine.initialize(None, FT_SPEC)
    return engine


# --------------------------------------------------------------------------- tests --
def test_every_abstract_member_is_defined():
    names = TrainEngine.__abstractmethods__
    assert len(names) == 30
    assert not inspect.isabstract(DTATrainEngine)
    assert not inspect.isabstract(DTAPPOActor)
    missing = sorted(n for n in names if getattr(DTATrainEngine, n) is getattr(TrainEngine, n))
    assert not missing, f"inherited from TrainEngine, not defined: {missing}"


def test_record_conversion_round_trip(records):
    rolled = convert.from_records(records, rolled=True)
    back = convert.to_dta_batch(rolled)
    for i, rec in enumerate(records):
        np.testing.assert_array_equal(back.input_ids[i], rec["input_ids"])
        np.testing.assert_array_equal(back.fields["loss_mask"][i], rec["loss_mask"])
        np.testing.assert_allclose(back.fields["advantages"][i][1:], rec["advantages"][1:])
        np.testing.assert_allclose(back.fields["old_logprobs"][i][1:], rec["logprobs"][1:],
                                   rtol=1e-6)
    plain = convert.from_records(records, rolled=False)
    assert torch.equal(torch.roll(plain["loss_mask"], -1, -1), rolled["loss_mask"])


def test_train_batch_matches_fsdp_engine_float32(model_dir, records, gloo_world1):
    """FSDPEngine itself vs DTATrainEngine, float32, one grpo step (AdamW eps 1e-5: Adam's
    first step amplifies float32 rounding near |g| ~ eps, see dta/verify.py)."""
    from areal.engine.fsdp_engine import FSDPEngine

    n = len(records)
    cfg = engine_config(model_dir, n, eps=1e-5)
    fsdp = FSDPEngine(cfg)
    fsdp.create_process_group()
    try:
        fsdp.initialize(None, FT_SPEC)
        eng = new_engine(copy.deepcopy(cfg), DTAOptions(policy="retain"))
        ref_model = load_model(model_dir, dtype="float32")
        ref_opt = reference_optimizer(ref_model, cfg.optimizer)
        base = convert.from_records(records)

        lp_fsdp = fsdp.forward_batch(ids_only(base))
        lp_dta = eng.forward_batch(ids_only(base))
        lp_ref = reference_forward(ref_model, ids_only(base), TEMPERATURE)
        assert lp_dta.shape == lp_fsdp.shape == lp_ref.shape
        # every position: the wrap label's log-prob at L-1 and the zero padding included
        assert float((lp_dta - lp_fsdp).abs().max()) < 2e-5
        assert float((lp_ref - lp_fsdp).abs().max()) < 2e-5
        # list input (one trajectory per sequence): a list of per-trajectory tensors
        trajs = [{k: v[i:i + 1, :len(r["input_ids"])] for k, v in ids_only(base).items()}
                 for i, r in enumerate(records)]
        out_fsdp, out_dta = fsdp.forward_batch(trajs), eng.forward_batch(trajs)
        assert len(out_dta) == len(out_fsdp) == n
        for a, b in zip(out_dta, out_fsdp):
            assert a.shape == b.shape and float((a - b).abs().max()) < 2e-5

        batch = make_train_batch(records, lp_fsdp)
        fsdp.train()
        st_fsdp = fsdp.train_batch(dict(batch), grpo(), loss_weight_fn)
        ex_fsdp = fsdp.export_stats()
        st_dta = eng.train()  # returns the engine, as FSDPEngine.train does
        assert st_dta is eng
        st_dta = eng.train_batch(dict(batch), grpo(), loss_weight_fn)
        ex_dta = eng.export_stats()
        st_ref = reference_train_batch(ref_model, ref_opt, batch, grpo(), TEMPERATURE,
                                       cfg.optimizer.gradient_clipping)

        assert set(st_dta) == set(st_fsdp) == {"update_successful", "grad_norm", "lr",
                                               "num_micro_batches"}
        assert st_dta["update_successful"] == st_fsdp["update_successful"] == 1.0
        assert st_dta["num_micro_batches"] == st_fsdp["num_micro_batches"] == n
        assert st_dta["lr"] == st_fsdp["lr"]
        assert st_fsdp["grad_norm"] > cfg.optimizer.gradient_clipping  # clipping is active
        assert abs(st_dta["grad_norm"] / st_fsdp["grad_norm"] - 1) < 1e-4
        assert abs(st_ref["grad_norm"] / st_fsdp["grad_norm"] - 1) < 1e-4

        p_fsdp, g_fsdp = params_of(fsdp.model), grads_of(fsdp.model)
        assert max_rel(grads_of(eng.model), g_fsdp) < 1e-4
        assert max_rel(params_of(eng.model), p_fsdp) < 1e-4
        assert max_rel(grads_of(ref_model), g_fsdp) < 1e-4  # the float64 test's reference
        assert max_rel(params_of(ref_model), p_fsdp) < 1e-4

        # what AReaL's loss recorded (ratios, clipping, rejection, entropy, vocab min/max...)
        areal_keys = {k for k in ex_dta if not k.startswith(("tree_", "dta_"))}
        assert areal_keys == set(ex_fsdp)
        assert 0 < ex_fsdp["clip_ratio/avg"] < 1  # ratios straddle the clip range
        assert 0 < ex_fsdp["behave_imp_weight/max"] <= 5.0  # some tokens rejected, none kept > 5
        for key, value in ex_fsdp.items():
            assert ex_dta[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
        assert ex_dta["tree_token_ratio"] > 1.0
        eng.destroy()
    finally:
        fsdp.destroy()


def test_train_batch_matches_reference_float64(model_dir, records, eager_areal, monkeypatch):
    """DTATrainEngine (recompute policy) vs the per-sequence FSDPEngine reference on a truly
    float64 model: log-probs, eval loss, gradients, the AdamW update, relative error <= 1e-10.
    AReaL's stats tracker takes float32 tensors only: what grpo_loss_fn logs is cast to
    float32 on both sides (logging only; the loss itself stays float64)."""
    stat = stats_tracker.stat

    def stat_float32(*args, **kwargs):
        return stat(*args, **{k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                              for k, v in kwargs.items()})

    monkeypatch.setattr(stats_tracker, "stat", stat_float32)
    n = len(records)
    cfg = engine_config(model_dir, n)
    # blocks of 7 tokens (actor.dta.block_tokens): every longer node is walked in pieces
    eng = new_engine(cfg, DTAOptions(policy="recompute", dtype="float64", block_tokens=7))
    assert eng.core.walker().options.block_tokens == 7
    assert next(eng.model.parameters()).dtype == torch.float64
    make_truly_float64(eng.model)
    ref_model = load_model(model_dir, dtype="float64")
    make_truly_float64(ref_model)
    ref_opt = reference_optimizer(ref_model, cfg.optimizer)
    base = convert.from_records(records)

    lp_dta = eng.forward_batch(ids_only(base))
    lp_ref = reference_forward(ref_model, ids_only(base), TEMPERATURE)
    assert lp_dta.dtype == torch.float64 and lp_dta.shape == lp_ref.shape
    assert float((lp_dta - lp_ref).abs().max()) < 1e-12

    batch = make_train_batch(records, lp_ref)
    before = params_of(eng.model)
    ev = eng.eval_batch(dict(batch), grpo(), loss_weight_fn)
    st_dta = eng.train_batch(dict(batch), grpo(), loss_weight_fn)
    st_ref = reference_train_batch(ref_model, ref_opt, batch, grpo(), TEMPERATURE,
                                   cfg.optimizer.gradient_clipping)
    assert st_dta["update_successful"] == st_ref["update_successful"] == 1.0
    assert abs(st_dta["grad_norm"] / st_ref["grad_norm"] - 1) < 1e-10
    assert abs(eng.export_stats()["dta_loss"] / st_ref["loss"] - 1) < 1e-10
    assert abs(float(ev) / st_ref["loss"] - 1) < 1e-6  # eval_batch sums in float32, as AReaL
    assert max_rel(grads_of(eng.model), grads_of(ref_model)) < 1e-10
    after_dta, after_ref = params_of(eng.model), params_of(ref_model)
    assert max_rel(after_dta, after_ref) < 1e-10
    update_dta = {k: after_dta[k] - before[k] for k in before}
    update_ref = {k: after_ref[k] - before[k] for k in before}
    assert max_rel(update_dta, update_ref) < 1e-10
    eng.destroy()

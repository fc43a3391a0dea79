"""The train-engine contract of AReaL's own tests, for DTA, on CPU.

AReaL describes what a train engine must do in ``tests/test_train_engine.py`` and
``tests/test_tree_training.py`` (its repository; they need GPUs and Qwen3-0.6B). Every check
there that can run on a CPU is re-stated here for ``DTATrainEngine`` on a tiny random Qwen3,
with AReaL's default precision (bf16 compute, fp32 master weights) and AReaL's own tolerances:

test_train_engine.py
* the engine built from a ``TrainEngineConfig`` and by ``from_pretrained`` (same config);
* ``forward`` with 2 micro-batches equals 1 micro-batch on the valid positions (atol 1e-4,
  rtol 1e-3); ``eval_batch`` returns a tensor on the engine's device; ``train_batch`` returns
  ``grad_norm`` and ``lr``;
* HF and DCP save/load (with the optimizer): save, zero every parameter, load, the forward is
  unchanged (``allclose``); ``destroy`` leaves no process group behind.

test_tree_training.py (DTA is the tree engine, AReaL's ``FSDPEngine`` the baseline)
* forward: log-probs within rtol = atol = 0.2;
* forward-backward (one ``train_batch``): the same gradient tensors, no NaN gradients or
  parameters, and per tensor a mean relative difference ``|a-b|/max(|a|,|b|)`` <= 0.25.
  Gradient clipping is active (norm > 1), so this also checks that after ``train_batch`` the
  model parameters' ``.grad`` are the *clipped* gradients, as FSDPEngine's.

FSDPEngine runs with one sequence per micro-batch: on CPU its packed sdpa forward lets packed
sequences attend to each other (docs/areal-notes.md §5).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig  # noqa: E402
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta  # noqa: E402

from runtime.areal import DTATrainEngine  # noqa: E402
from runtime.areal.examples.tau2_grpo import make_smoke_model  # noqa: E402

FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=100, train_batch_size=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_smoke_model(str(tmp_path_factory.mktemp("contract") / "model"), vocab_size=256)


@pytest.fixture
def eager(monkeypatch):
    import torch._dynamo

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    with torch._dynamo.config.patch(disable=True):
        yield


def mock_input(batch_size=5, min_seqlen=10, max_seqlen=20, vocab=100, seed=0):
    """Right-padded random sequences, as AReaL's test_train_engine.mock_input."""
    g = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(min_seqlen, max_seqlen, (batch_size,), generator=g)
    width = int(seqlens.max())
    ids = torch.randint(0, vocab, (batch_size, width), generator=g)
    mask = torch.arange(width)[None] < seqlens[:, None]
    return dict(input_ids=ids.masked_fill(~mask, 0), attention_mask=mask)


def mock_tree_input(batch_size=4, tree_tokens=128, total_tokens=256):
    """Sequences that are prefixes of one 128-token sequence, 256 tokens in all, as AReaL's
    test_tree_training.mock_tree_input."""
    lengths, rest = [tree_tokens], total_tokens - tree_tokens
    for i in range(batch_size - 1):
        left = batch_size - 2 - i
        share = max(1, min(min(tree_tokens, rest - left), rest // (left + 1)))
        lengths.append(share)
        rest -= share
    lengths[-1] += rest
    ids = torch.zeros(batch_size, max(lengths), dtype=torch.long)
    mask = torch.zeros(batch_size, max(lengths), dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1)
        mask[i, :n] = True
    return dict(input_ids=ids, attention_mask=mask, loss_mask=mask.clone())


def mean_logprob_loss(logprobs, entropy, input_data, **kwargs):  # test_train_engine's
    return torch.mean(logprobs)


def masked_mean_loss(logprobs, entropy, input_data, **kwargs):  # test_tree_training's
    mask = input_data["loss_mask"].to(logprobs.dtype)
    return (logprobs * mask).sum() / mask.count_nonzero().clamp_min(1)


def engine_config(path, **kw):
    kw.setdefault("optimizer", OptimizerConfig())
    return TrainEngineConfig(backend="fsdp:d1", experiment_name="test-dta-engine",
                             trial_name="test0", path=path, attn_impl="sdpa", **kw)


def new_engine(config):
    engine = DTATrainEngine(config)
    engine.create_process_group()
    engine.initialize(None, FT_SPEC)
    return engine


# ------------------------------------------------------------- test_train_engine.py --
@pytest.mark.parametrize("construction", ["config", "from_pretrained"])
def test_train_engine_contract(model_dir, eager, tmp_path, construction):
    import torch.distributed as dist

    if construction == "config":
        engine = new_engine(engine_config(model_dir))
    else:
        engine = DTATrainEngine.from_pretrained(model=model_dir, experiment_name="test_exp",
                                                trial_name="test_trial", dp_size=1, tp_size=1,
                                                learning_rate=1e-5, attn_impl="sdpa")
        engine.create_process_group()
        engine.initialize(None, FT_SPEC)
    assert next(engine.model.parameters()).dtype == torch.bfloat16  # AReaL's default
    assert engine.model.config._attn_implementation == "sdpa"
    data = mock_input()
    # forward with 2 micro-batches == 1 micro-batch on the valid positions
    engine.eval()
    engine.config.mb_spec = MicroBatchSpec(n_mbs=2, max_tokens_per_mb=100)
    x2 = engine.forward(input_=data)
    engine.config.mb_spec = MicroBatchSpec(n_mbs=1, max_tokens_per_mb=100)
    x1 = engine.forward(input_=data)
    attn = data["attention_mask"]
    valid = attn.clone()
    valid[:, :-1] = attn[:, :-1] & attn[:, 1:]
    valid[:, -1] = False
    assert torch.allclose(x1[valid], x2[valid], atol=1e-4, rtol=1e-3)
    # eval_batch: a tensor on the engine's device
    engine.config.mb_spec = MicroBatchSpec(n_mbs=2, max_tokens_per_mb=100)
    loss = engine.eval_batch(input_=data, loss_fn=mean_logprob_loss,
                             loss_weight_fn=lambda x: x["cu_seqlens"][-1])
    assert isinstance(loss, torch.Tensor) and loss.device.type == engine.device.type
    assert math.isfinite(float(loss))
    # train_batch: grad_norm and lr
    engine.train()
    stats = engine.train_batch(input_=data, loss_fn=mean_logprob_loss,
                               loss_weight_fn=lambda x: x["cu_seqlens"][-1])
    assert isinstance(stats, dict) and stats["grad_norm"] is not None and stats["lr"] is not None
    assert stats["update_successful"] == 1.0
    # HF and DCP save/load with the optimizer: zero the weights, load, same forward
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    engine.config.mb_spec = MicroBatchSpec(n_mbs=1, max_tokens_per_mb=100)
    for fmt in ("hf", "dcp"):
        meta = SaveLoadMeta(path=str(tmp_path / fmt), weight_format=fmt, tokenizer=tokenizer,
                            with_optim=True, base_model_path=None)
        old = engine.forward(input_=data)
        engine.save(meta)
        with torch.no_grad():
            for p in engine.model.parameters():
                p.zero_()
            if fmt == "dcp":  # DCP holds the fp32 masters: zero those too
                for m in engine.core.sharding.masters:
                    m.zero_()
        engine.load(meta)
        new = engine.forward(input_=data)
        assert torch.allclose(old, new), fmt
    engine.destroy()
    assert not dist.is_initialized()


def test_from_pretrained_builds_the_config_fsdp_engine_builds(model_dir):
    engine = DTATrainEngine.from_pretrained(model=model_dir, experiment_name="test_exp",
                                            trial_name="test_trial", dp_size=1,
                                            learning_rate=1e-5)
    config = TrainEngineConfig(path=model_dir, backend="fsdp:d1t1",
                               optimizer=OptimizerConfig(lr=1e-5))
    assert engine.config.path == config.path and engine.config.backend == config.backend
    assert engine.config.optimizer.lr == config.optimizer.lr
    assert DTATrainEngine.from_pretrained(model=model_dir, experiment_name="e",
                                          trial_name="t").config.optimizer is None
    lora = DTATrainEngine.from_pretrained(model=model_dir, experiment_name="e", trial_name="t",
                                          use_lora=True, lora_rank=8, lora_alpha=16)
    assert (lora.config.use_lora, lora.config.lora_rank, lora.config.lora_alpha) == (True, 8, 16)


# ------------------------------------------------------------ test_tree_training.py --
@pytest.fixture
def fsdp_baseline(model_dir, eager, tmp_path):
    """AReaL's FSDPEngine (the test's baseline engine), one sequence per micro-batch."""
    import torch.distributed as dist
    from areal.engine import FSDPEngine

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    engine = FSDPEngine(engine_config(model_dir, pad_to_maximum=True,
                                      mb_spec=MicroBatchSpec(n_mbs=4, max_tokens_per_mb=256)))
    engine.create_process_group()
    engine.initialize(addr=None, ft_spec=FT_SPEC)
    yield engine
    engine.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def test_tree_training_forward_and_gradients_match_fsdp_engine(model_dir, fsdp_baseline):
    data = mock_tree_input()
    config = engine_config(model_dir, pad_to_maximum=True,
                           mb_spec=MicroBatchSpec(max_tokens_per_mb=256))
    tree = new_engine(config)
    assert tree.core.sharding.masters is not None  # bf16 compute, fp32 masters
    # forward
    fsdp_baseline.eval()
    tree.eval()
    base = fsdp_baseline.forward_batch(input_=data, aggregate_fn=lambda xs: torch.cat(xs, -1))
    mine = tree.forward_batch(input_=data)
    assert torch.isclose(mine, base, rtol=0.2, atol=0.2).all()
    # forward-backward: one train_batch each
    weight = lambda x: x["loss_mask"].count_nonzero()  # noqa: E731
    fsdp_baseline.train()
    base_stats = fsdp_baseline.train_batch(data, masked_mean_loss, weight)
    tree.train()
    stats = tree.train_batch(data, masked_mean_loss, weight)
    assert stats["grad_norm"] > config.optimizer.gradient_clipping  # the clip is active
    assert math.isclose(stats["grad_norm"], base_stats["grad_norm"], rel_tol=0.05)
    base_grads = {n: _full(p.grad) for n, p in fsdp_baseline.model.named_parameters()
                  if p.grad is not None}
    grads = {n: _full(p.grad) for n, p in tree.model.named_parameters() if p.grad is not None}
    assert set(grads) == set(base_grads)
    for name, b in base_grads.items():
        g = grads[name]
        assert not torch.isnan(g).any() and not torch.isnan(b).any(), name
        diff = (g - b).abs()
        top = torch.maximum(g.abs(), b.abs())
        rel = torch.where(top > 0, diff / top, torch.zeros_like(diff))
        assert float(rel.mean()) <= 0.25, (name, float(rel.mean()))
    for _, p in tree.model.named_parameters():
        assert not torch.isnan(p).any()
    # the model's .grad are the clipped gradients: the optimizer's, cast to bf16
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    assert math.isclose(total, config.optimizer.gradient_clipping, rel_tol=1e-2)
    for m, p in zip(tree.core.sharding.masters, tree.core.sharding.params):
        assert torch.equal(p.grad, m.grad.to(p.dtype))
    tree.destroy()

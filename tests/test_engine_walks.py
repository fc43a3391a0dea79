"""The engine core's one walk step for any loss (issue 47): ``EngineCore.walk_sequences`` (on
``dta.train.walk_batch``, what DTA's own step runs) against the per-sequence reference and the
library, with the tree built once per batch; and the one checkpoint scheme's ``extra_state``
(a front door's LR scheduler in the core's checkpoint), in the replicated and the DCP format.
float64, the tiny Qwen3, one rank."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch

import dta.train
from dta import build_model
from dta.losses import PPO, SequenceLoss
from dta.model.models import make_truly_float64
from dta.options import WalkOptions
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients, forward_logprobs
from runtime.engine import EngineCore, ParallelLayout
from tests.cases import SEQUENCE_LOSS, hard_batch

TOL = 1e-10


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _core(model, **walk):
    core = EngineCore(lambda dtype: copy.deepcopy(model), layout=ParallelLayout(),
                      walk=WalkOptions(block_tokens=16, **walk),
                      make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      compute_dtype="float64")
    return core.parallelize()


@pytest.fixture(scope="module")
def model():
    model = build_model("qwen3", "tiny", dtype="float64")
    make_truly_float64(model)  # rotary tables and all: float64 end to end
    return model


@pytest.fixture
def trees(monkeypatch):
    """How many prefix trees dta.train builds while the test runs."""
    built = []

    class Counting(dta.train.PrefixTree):
        def __init__(self, *a, **kw):
            built.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(dta.train, "PrefixTree", Counting)
    return built


@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_a_host_loss_is_walked_on_one_tree_and_trains_exactly(model, trees, policy):
    """An opaque per-sequence loss through walk_sequences: one tree for the forward walk,
    the loss and the training walk; the gradient and the loss equal the per-sequence
    reference's; log-probs equal the forward-only walk's; the forwarded tokens are both
    walks'; the forward-only evaluation gives the same loss."""
    batch = hard_batch(model)
    core = _core(model, policy=policy)
    trees.clear()  # hard_batch's own forward walk
    res = core.walk_sequences(batch, SEQUENCE_LOSS, train=True, reduction="seq_mean")
    assert len(trees) == 1
    ref_model = copy.deepcopy(model)
    ref = unpacked_gradients(ref_model, batch, SEQUENCE_LOSS, reduction="seq_mean")
    grads = {n: p.grad for n, p in core.model.named_parameters()}
    assert all(g is not None for g in grads.values())
    for n, p in ref_model.named_parameters():
        assert _rel(grads[n], p.grad) <= TOL, n
    assert res.loss == pytest.approx(ref.loss, rel=TOL)
    for got, want in zip(res.logprobs, ref.logprobs):
        assert float((got - want.detach()).abs().max()) <= 1e-10
    assert res.tree.sequences == len(batch) and res.tree.sharing_ratio > 1.0
    assert res.forwarded_tokens == res.walk.tokens + res.walk.recomputed_tokens + \
        res.tree.unique_tokens  # the forward walk forwards every unique token once
    assert (res.walk.recomputed_tokens > 0) == (policy == "recompute")
    assert res.sent_bytes == 0  # no context-parallel group

    trees.clear()
    evaluated = core.walk_sequences(batch, SEQUENCE_LOSS, train=False, reduction="seq_mean")
    assert len(trees) == 1 and evaluated.walk.tokens == res.tree.unique_tokens
    assert evaluated.loss == pytest.approx(res.loss, rel=TOL)
    assert all(p.grad is None or torch.equal(p.grad, grads[n])
               for n, p in core.model.named_parameters())  # evaluation adds nothing


def test_one_heart_for_every_loss(model, trees):
    """DTA's own step (accumulate_gradients), its forward-only walk and the core's walks are
    one function: a token loss through walk_sequences equals accumulate_gradients, and a
    walk records the logits' min / max, handed to a host's loss beside its fields."""
    batch = hard_batch(model)
    core = _core(model)
    trees.clear()  # hard_batch's own forward walk
    res = core.walk_sequences(batch, PPO(eps_clip=0.2), train=True)
    lib = copy.deepcopy(model)
    want = accumulate_gradients(lib, batch, PPO(eps_clip=0.2), options=core.walk)
    assert len(trees) == 2 and res.loss == pytest.approx(want.loss, rel=TOL)
    assert res.tree == want.tree and res.forwarded_tokens == want.forwarded_tokens
    for (n, p), q in zip(core.model.named_parameters(), lib.parameters()):
        assert torch.equal(p.grad, q.grad), n

    seen = {}

    def spy(lp, ent, fields):
        i = int(np.asarray(fields["seq"])[0])
        seen[i] = (fields["vocab_min"], fields["vocab_max"])
        return lp.sum() * 0.0

    batch.fields["seq"] = [np.full(len(s), float(i)) for i, s in enumerate(batch.input_ids)]
    trees.clear()
    out = core.walk_sequences(batch, SequenceLoss(spy, ("seq",)), train=False, minmax=True,
                              counted=[len(s) - 1 for s in batch.input_ids])
    assert len(trees) == 1 and sorted(seen) == list(range(len(batch)))
    plain = forward_logprobs(model, batch, options=core.walk, minmax=True)
    for i in range(len(batch)):
        assert torch.equal(out.logprobs[i], plain.logprobs[i])
        assert torch.equal(seen[i][0], plain.vocab_min[i]) and torch.equal(seen[i][1],
                                                                         plain.vocab_max[i])
        assert bool((seen[i][0] <= seen[i][1]).all())
    assert out.tree.total_tokens == sum(len(s) - 1 for s in batch.input_ids)
    with pytest.raises(ValueError, match="adapters=False"):
        core.walk_sequences(batch, SEQUENCE_LOSS, train=True, adapters=False)


class _Plain:
    """A front door's own state that is not JSON (a tensor inside)."""

    def state_dict(self):
        return {"t": torch.ones(2)}

    def load_state_dict(self, state):
        raise AssertionError("never loaded")


@pytest.mark.parametrize("every_rank", [False, True], ids=["one-process", "every-rank"])
def test_extra_state_travels_in_the_core_checkpoint(model, tmp_path, every_rank):
    """The one checkpoint scheme: an LR scheduler as ``extra_state`` in the core's checkpoint
    (its meta.json, checksummed), restored with the weights and the optimizer, the
    optimizer's learning rate set from it; a state JSON would not give back equal is refused
    before anything is written; a checkpoint without an entry asked for is refused before
    anything is loaded."""
    batch = hard_batch(model)
    core = _core(model)
    sched = torch.optim.lr_scheduler.LambdaLR(core.optimizer, lambda k: 1.0 / (k + 1))
    for _ in range(2):
        core.zero_grad()
        core.walk_sequences(batch, PPO(), train=True)
        core.optimizer_step(1.0)
        sched.step()
    folder = str(tmp_path / "ckpt")
    path = core.save(folder, 2, {"kind": "test"}, extra_state={"lr_scheduler": sched},
                     every_rank=every_rank)
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    assert meta["extra_state"]["lr_scheduler"]["last_epoch"] == 2
    assert meta["format"] == "dcp" and meta["logical"] == 1  # the one format, either way
    with open(os.path.join(path, "manifest.json")) as f:
        assert "meta.json" in json.load(f)["files"]
    with pytest.raises(TypeError, match="extra_state 'plain'"):
        core.save(str(tmp_path / "other"), 2, {}, extra_state={"plain": _Plain()},
                  every_rank=every_rank)
    assert not os.path.exists(tmp_path / "other" / "step-000002")

    other = build_model("qwen3", "tiny", dtype="float64", seed=1)
    make_truly_float64(other)
    fresh = _core(other)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(fresh.optimizer, lambda k: 1.0 / (k + 1))
    before = {n: p.detach().clone() for n, p in fresh.model.named_parameters()}
    with pytest.raises(ValueError, match=r"holds no \['other'\]"):
        fresh.load(folder, extra_state={"lr_scheduler": lr_sched, "other": sched})
    assert all(torch.equal(p, before[n]) for n, p in fresh.model.named_parameters())
    fresh.load(folder, extra_state={"lr_scheduler": lr_sched})  # the run's folder: its newest
    assert lr_sched.last_epoch == 2 and lr_sched.get_last_lr() == sched.get_last_lr()
    assert [g["lr"] for g in fresh.optimizer.param_groups] == sched.get_last_lr()
    for (n, p), q in zip(fresh.model.named_parameters(), core.model.parameters()):
        assert torch.equal(p, q), n
    for core_ in (core, fresh):  # one more step each: bit-identical
        core_.zero_grad()
        core_.walk_sequences(batch, PPO(), train=True)
        core_.optimizer_step(1.0)
    for (n, p), q in zip(fresh.model.named_parameters(), core.model.parameters()):
        assert torch.equal(p, q), n

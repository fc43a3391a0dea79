"""The Ray worker's step with recomputed log-probs (a decoupled loss's ``prox_logprobs``, AReaL's
``recompute_logprob``) walks one prefix tree for both walks: the recompute's forward walk and
the training walk (``EngineCore.train_step(recompute=...)`` -> ``walk_sequences`` ->
``dta.train.walk_batch``). Counted: one tree per step (the recompute through
``dta.train.forward_logprobs`` before the step built a second one). Unchanged: the loss, the
gradient norm and the parameters after two steps equal, bit for bit, those of the same step
with the log-probs recomputed by a separate forward walk first."""
from __future__ import annotations

import os

import pytest
import torch

import dta.train
from dta.config.schema import load_config
from dta.losses import batch_totals
from dta.train import forward_logprobs, with_logprobs
from dta_cli.batches import BatchSource
from tests.workers import local_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(extra=()):
    return load_config(os.path.join(ROOT, "configs", "tau2-airline-grpo.yaml"),
                       ["model.size=tiny", "workload.scale=tiny", "model.dtype=float64",
                        *extra])


def _counting(monkeypatch) -> list[int]:
    built = [0]
    real = dta.train.PrefixTree

    def counted(*args, **kwargs):
        built[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dta.train, "PrefixTree", counted)
    return built


def _params(w) -> dict:
    return {k: v.detach().clone() for k, v in w.core.full_state().items()}


@pytest.mark.parametrize("extra", [(), ("walker.policy=retain",)], ids=["recompute", "retain"])
def test_one_tree_serves_the_recompute_and_the_training_walk(monkeypatch, extra):
    cfg = _cfg(extra)
    source = BatchSource(cfg, 512)
    torch.manual_seed(0)
    new = local_worker(cfg)
    assert new.recompute == ("prox_logprobs",)
    built = _counting(monkeypatch)
    stats = []
    for k in (0, 1):
        before = built[0]
        stats.append(new.step(k, source.batch(k), None))
        assert built[0] - before == 1, f"step {k} built {built[0] - before} prefix trees"

    torch.manual_seed(0)  # the same step, the log-probs recomputed by a separate walk first
    old = local_worker(cfg)
    old_trees = []
    for k in (0, 1):
        before = built[0]
        batch = source.batch(k)
        with torch.no_grad():
            lps = forward_logprobs(old.core.model, batch, options=old.core.walk).logprobs
        out = old.core.train_step(with_logprobs(batch, old.recompute, lps), old.loss,
                                  totals=batch_totals(batch),
                                  reduction=str(cfg.walker.reduction),
                                  max_grad_norm=cfg.optimizer.max_grad_norm)
        old_trees.append(built[0] - before)
        assert out.loss == stats[k]["loss"] and float(out.grad_norm) == stats[k]["grad_norm"]
    assert old_trees == [2, 2]  # what the one tree saves: a second tree per step
    a, b = _params(new), _params(old)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)

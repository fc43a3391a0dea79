"""DTATrainEngine with AReaL's context-parallel allocation (``fsdp:d1c2``: one data-parallel
group of two gloo ranks walking the same trees, their K/V spread over the pair;
docs/context-parallel.md) equals ``fsdp:d1`` on one process after 2 ``train_batch`` steps
(AReaL's grpo_loss_fn, both ranks given the whole batch), float64 <= 1e-10, under both memory
policies, with blocks of 16 tokens so every sequence's path is spread over the group."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from experiments.local_ranks import run_ranks  # noqa: E402
from tests.test_areal import (  # noqa: E402
    FT_SPEC,
    VOCAB,
    engine_config,
    grpo,
    loss_weight_fn,
    make_train_batch,
    model_dir,  # noqa: F401  (a fixture)
)
from tests.test_areal_sharding import _rank_setup  # noqa: E402

POLICIES = ("retain", "recompute")


def _batches(n_steps=2):
    from experiments.workloads import make_workload

    records = make_workload("tau2-airline", scale="tiny", seed=0, vocab_size=VOCAB).records
    return [make_train_batch(records, torch.full((len(records), 1), -6.0), seed=k)
            for k in range(n_steps)]


def run(rank, world, path):
    from dta.model.context_parallel import context_parallel_of
    from runtime.areal import DTAOptions, DTATrainEngine

    out = {}
    with _rank_setup():
        for policy in POLICIES:
            eng = DTATrainEngine(engine_config(path, 1, backend=f"fsdp:d1c{world}"),
                                 DTAOptions(policy=policy, dtype="float64", block_tokens=16))
            eng.create_process_group()
            eng.initialize(None, FT_SPEC)
            cp = context_parallel_of(eng.model)
            sent = cp.sent_bytes if cp is not None else 0
            stats = []
            for batch in _batches():
                stats.append(eng.train_batch(dict(batch), grpo(), loss_weight_fn))
                eng.lr_scheduler_step()
            out[policy] = dict(
                state={n: p.detach().clone() for n, p in eng.model.named_parameters()},
                stats=stats, dp=(eng.data_parallel_rank, eng.data_parallel_world_size),
                head=eng.is_data_parallel_head(), sharding=eng.sharding,
                sent=(cp.sent_bytes - sent) if cp is not None else 0)
            eng.destroy()
    return out


def rel_l2(a, b):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def test_fsdp_d1c2_equals_d1(model_dir):  # noqa: F811
    two = run_ranks(run, 2, model_dir, timeout=900)
    one = run_ranks(run, 1, model_dir, timeout=900)[0]
    for policy in POLICIES:
        ref = one[policy]
        assert ref["sent"] == 0 and ref["dp"] == (0, 1)
        for rank in (0, 1):
            got = two[rank][policy]
            assert got["sharding"] == "replicate" and got["dp"] == (0, 1)
            assert got["head"] == (rank == 0)
            assert got["sent"] > 0  # the path attention was exchanged
            assert all(s["update_successful"] == 1.0 for s in got["stats"])
            err = rel_l2(got["state"], ref["state"])
            print(f"fsdp:d1c2 vs fsdp:d1, {policy}, rank {rank}: relative L2 {err:.2g}, "
                  f"sent {got['sent']} bytes")
            assert err <= 1e-10, (policy, rank, err)
            for s, r in zip(got["stats"], ref["stats"]):
                assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-10)


def test_refusals():
    from runtime.areal.parallel import strategy_of

    assert strategy_of("fsdp:d1c2").context_parallel_size == 2
    with pytest.raises(NotImplementedError, match="tensor_parallel_size=2"):
        strategy_of("fsdp:d1t2")

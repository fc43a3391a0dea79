"""MoE under train.sharding=fsdp on 2 gloo ranks (docs/moe.md): routing replay and the
router's aux loss. The aux surrogate enters the decoder at the routers, and the walk starts
every pack's backward at its output (zeros where only the aux loss reaches the pack), so
FSDP's lockstep sees it; the lockstep's one-token dummy calls, made inside a walk's decoder
call, are not replayed (``dta.model.routing.suspended``). Parameters after 2 steps equal one
process's (float64 <= 1e-12 relative L2), both memory policies, OLMoE tiny, replayed routing
on every sequence, aux coefficient 0.01; fully masked fork tails (packs reached by the aux
loss only) are in the batch."""
from __future__ import annotations

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_sharding import TOL, _step, _worker, rel_l2
from tests.workers import state

CASES = [("fsdp", "float64", "recompute"), ("fsdp", "float64", "retain")]


def overrides(mode, dtype, policy):
    from tests.test_sharding import overrides as base
    return base(mode, dtype, policy) + ["model.family=olmoe", "actor.router_aux_loss_coef=0.01"]


class MaskedTails:
    """The generated batch plus a small tree whose fork tails carry no trained token: their
    leaf packs get no head gradient, only the aux loss's (every sequence still has trained
    tokens above the fork, so its aux term is weighted)."""

    def __init__(self, cfg):
        from dta_cli.batches import BatchSource

        self.source = BatchSource(cfg, 512)

    def batch(self, k):
        from dta.batch import Batch
        from dta.model.models import build_config
        from dta.model.routing import synthetic_routing
        from tests.cases import make_records
        from tests.test_moe import small_sequences

        recs = make_records(small_sequences(seed=k), prompt=4)
        for i, r in enumerate(recs):
            r["logprobs"], r["group_id"] = r.pop("old_logprobs"), 1000 + i
            del r["prox_logprobs"]
            if i < 3:
                r["loss_mask"][-2:] = 0
        records = list(self.source.records(k)) + recs
        cfg = build_config("olmoe", "tiny")  # replayed routing: a function of the prefix
        routed = synthetic_routing([r["input_ids"] for r in records], cfg.num_hidden_layers,
                                   cfg.num_experts_per_tok, cfg.num_experts, seed=k)
        for r, x in zip(records, routed):
            r["routed_experts"] = x
        return Batch.from_records(records)


def step(w, cfg, k, rank, world):
    return _step(w, cfg, k, rank, world, MaskedTails(cfg))


def train_cases(rank, world, cases):
    out = []
    for case in cases:
        cfg = load_config(None, overrides(*case))
        w = _worker(cfg, rank, world)
        stats = [step(w, cfg, k, rank, world) for k in range(2)]
        out.append({"state": state(w)["model"], "param_norm": w.param_norm(),
                    "sharding": stats[-1]["sharding"]})
    return out


def one_process(case, coef: float = 0.01):
    """The same 2 steps in this process (replicated, W = 1)."""
    threads = torch.get_num_threads()
    try:
        cfg = load_config(None, overrides(*case) + [f"actor.router_aux_loss_coef={coef}"])
        w = _worker(cfg, 0, 1)
        for k in range(2):
            step(w, cfg, k, 0, 1)
        return state(w)["model"], w.param_norm()
    finally:
        torch.set_num_threads(threads)


def test_fsdp_with_replay_and_the_router_aux_loss_matches_one_process():
    results = run_ranks(train_cases, 2, CASES)
    without, _ = one_process(CASES[0], coef=0.0)
    for i, case in enumerate(CASES):
        ref, ref_norm = one_process(case)
        assert rel_l2(without, ref) > 1e-6  # the aux loss moved the parameters
        for rank in (0, 1):
            got = results[rank][i]
            assert got["sharding"] == "fsdp"
            err = rel_l2(got["state"], ref)
            assert err <= TOL[case[1]], f"{case} rank {rank}: relative L2 {err:.3g}"
            assert got["param_norm"] == pytest.approx(ref_norm, rel=TOL[case[1]])

"""Context parallelism with sharded state (docs/context-parallel.md): 4 local gloo ranks as the
Ray worker runs them (``DFSWorker`` in spawned processes), ``train.context_parallel=2`` (two
data-parallel groups of two ranks whose path K/V are spread over the pair) with
``train.sharding`` zero1 and fsdp, the model state sharded over all 4 ranks. After 2 steps
the parameters equal one process's replicated run (float64 <= 1e-10 relative L2), so the
reduction counts each group once: zero1 reduces after the walk (the group's other ranks drop
their identical gradient), fsdp reduce-scatters inside the backward (the sum divided by C).
Slow: the other policies and float32, and AReaL's ``fsdp:d1c2`` with ``actor.dta.sharding``
fsdp / zero1 (sharded over both ranks) against ``fsdp:d1`` on one process (float64 <= 1e-10
in the parameters and the gradient norms; a doubled group gradient shows in the norms)."""
from __future__ import annotations

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_sharding import _step, rel_l2
from tests.workers import state

C, WORLD = 2, 4
TOL = {"float64": 1e-10, "float32": 1e-5}


def overrides(mode, dtype, policy, workers=WORLD, cp=C):
    # blocks of 16 tokens: the paths span several packs, so their K/V really are spread
    return ["workload.scale=tiny", f"model.dtype={dtype}", f"walker.policy={policy}",
            f"train.sharding={mode}", "optimizer.lr=1e-3", "optimizer.max_grad_norm=0.5",
            "walker.block_tokens=16", f"ray.num_workers={workers}",
            f"train.context_parallel={cp}"]


def _worker(cfg, rank, world):
    from tests.workers import local_worker

    # as setup_group: the layout's groups, context parallelism, then the sharding mode
    return local_worker(cfg, rank, world, truly_float64=True)


def train_cases(rank, world, cases):
    out = []
    for case in cases:
        cfg = load_config(None, overrides(*case))
        w = _worker(cfg, rank, world)
        stats = [_step(w, cfg, k, rank, world) for k in range(2)]
        out.append({"state": state(w)["model"], "param_norm": w.param_norm(),
                    "state_bytes": stats[-1]["state_bytes"], "sharding": stats[-1]["sharding"],
                    "cp_rank": stats[-1]["context_parallel_rank"],
                    "sent": sum(s["context_parallel_sent_bytes"] for s in stats)})
    return out


def _one_process(case):
    """The same 2 steps in this process: replicated, one rank, no context parallelism."""
    threads = torch.get_num_threads()
    try:
        cfg = load_config(None, overrides(case[0], *case[1:], workers=1, cp=1))
        w = _worker(cfg, 0, 1)
        for k in range(2):
            _step(w, cfg, k, 0, 1)
        return state(w)["model"], w.param_norm()
    finally:
        torch.set_num_threads(threads)


def _check(cases):
    results = run_ranks(train_cases, WORLD, cases, timeout=600.0)
    for i, case in enumerate(cases):
        mode, dtype = case[0], case[1]
        ref, ref_norm = _one_process(case)
        for rank in range(WORLD):
            got = results[rank][i]
            assert got["sharding"] == mode and got["cp_rank"] == rank % C
            assert got["sent"] > 0  # the path attention was exchanged within the group
            err = rel_l2(got["state"], ref)
            assert err <= TOL[dtype], f"{case} rank {rank}: relative L2 {err:.3g}"
            assert got["param_norm"] == pytest.approx(ref_norm, rel=TOL[dtype])
        # the state is sharded over all 4 ranks, not over the 2 data-parallel groups:
        # a quarter of a replica's optimizer state (plus the flat shards' padding)
        opt = results[0][i]["state_bytes"]["optimizer"]
        full = 2 * sum(v.numel() * v.element_size() for v in ref.values())
        assert opt <= 0.3 * full, (case, opt, full)


def test_the_config_takes_context_parallel_with_every_sharding_mode():
    for mode in ("replicate", "zero1", "fsdp"):
        cfg = load_config(None, overrides(mode, "float32", "recompute"))
        assert (cfg.train.sharding, cfg.train.context_parallel) == (mode, C)


def test_context_parallel_zero1_and_fsdp_match_one_process():
    _check([("zero1", "float64", "recompute"), ("fsdp", "float64", "recompute")])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero1", "fsdp"])
def test_context_parallel_sharded_grid(mode):
    _check([(mode, "float64", "retain"), (mode, "float32", "recompute"),
            (mode, "float32", "retain")])


# ---------------------------------------------------------------------------- AReaL --
def run_areal(rank, world, path, sharding):
    """DTATrainEngine ``fsdp:d1c{world}`` (or ``fsdp:d1`` on one rank), 2 ``train_batch``
    steps, recompute, blocks of 16 tokens: the final parameters (gathered) and stats."""
    from dta.model.context_parallel import context_parallel_of
    from runtime.areal import DTAOptions, DTATrainEngine
    from tests.test_areal import FT_SPEC, engine_config, grpo, loss_weight_fn
    from tests.test_areal_sharding import _rank_setup
    from tests.test_context_parallel_areal import _batches

    backend = f"fsdp:d1c{world}" if world > 1 else "fsdp:d1"
    with _rank_setup():
        eng = DTATrainEngine(engine_config(path, 1, backend=backend),
                             DTAOptions(policy="recompute", dtype="float64", block_tokens=16,
                                        sharding=sharding if world > 1 else None))
        eng.create_process_group()
        eng.initialize(None, FT_SPEC)
        cp = context_parallel_of(eng.model)
        stats = []
        for batch in _batches():
            stats.append(eng.train_batch(dict(batch), grpo(), loss_weight_fn))
            eng.lr_scheduler_step()
        state = eng.full_state_dict()  # gathered where sharded (every rank calls it)
        out = dict(state=state, stats=stats, sharding=eng.sharding,
                   sent=cp.sent_bytes if cp is not None else 0)
        eng.destroy()
    return out


@pytest.mark.slow  # ~45 s each on 2 cores
@pytest.mark.areal
@pytest.mark.parametrize("sharding", ["fsdp", "zero1"])
def test_areal_d1c2_sharded_equals_d1(sharding, tmp_path_factory):
    pytest.importorskip("areal")
    from tests.test_areal import model_dir

    path = model_dir.__wrapped__(tmp_path_factory)  # the tiny Qwen3 folder AReaL loads
    two = run_ranks(run_areal, 2, path, sharding, timeout=900)
    one = run_ranks(run_areal, 1, path, sharding, timeout=900)[0]
    assert one["sharding"] == "replicate" and one["sent"] == 0
    for rank in (0, 1):
        got = two[rank]
        assert got["sharding"] == sharding and got["sent"] > 0
        assert all(s["update_successful"] == 1.0 for s in got["stats"])
        keys = [k for k in one["state"] if k in got["state"]]
        assert len(keys) >= len(one["state"]) - 1  # a tied head may be named once
        err = rel_l2({k: got["state"][k] for k in keys}, {k: one["state"][k] for k in keys})
        assert err <= 1e-10, (sharding, rank, err)
        for s, r in zip(got["stats"], one["stats"]):
            assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-10)

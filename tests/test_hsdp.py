"""HSDP (``train.shard_size`` = S < W: the sharded state split within groups of S ranks,
replicated across them) on 4 local gloo ranks (2 x 2), as the Ray worker runs it, against
one process (float64, the tiny Qwen3, τ²-airline "tiny" batches): the log-probs before and
after training, each step's loss and every reduced gradient, and the parameters after one
and two AdamW steps, within 1e-10; the replica groups are crossed by the gradient SUM once
per step (one all-reduce per bucket, at the step, none during the walk); the FSDP2 / flat
shards' collectives stay inside the shard groups; a DCP checkpoint taken under HSDP is
written once (the replicas' identical shards deduplicated) and resumes bit-identically, and
under plain sharding.

``record`` (one rank's run of a case) and the comparisons are shared with
tests/test_offload.py."""
from __future__ import annotations

import os

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.workers import state

TOL = 1e-10
# (mode, policy, shard_size, offload)
FAST = [("fsdp", "retain", 2, "none"), ("zero1", "recompute", 2, "none")]
SLOW = [("fsdp", "recompute", 2, "none"), ("zero1", "retain", 2, "none")]


def overrides(mode, policy, shard=None, offload="none", dtype="float64"):
    out = ["workload.scale=tiny", f"model.dtype={dtype}", f"walker.policy={policy}",
           f"train.sharding={mode}", "optimizer.lr=1e-3", "optimizer.max_grad_norm=0.5",
           f"train.offload={offload}"]
    return out + ([f"train.shard_size={shard}"] if shard is not None else [])


def reference_overrides(case):
    """One process of a case: replicated (the truth), no offload."""
    mode, policy, *_ = case
    return overrides(mode, policy)


# ------------------------------------------------------------ on every rank --
def full_gradients(mode) -> dict:
    """Every reduced gradient, whole (a collective within the shard group: every rank calls
    it), right after ``reduce_gradients`` -- read from the mode's own state."""
    from dta.model.collectives import all_gather_single

    if mode.name == "replicate":
        return {n: g.detach().clone() for n, g in zip(mode.names, mode._reduced)
                if g is not None}
    out = {}
    flats = mode.flats if mode.name == "zero1" else [mode.vocab]
    for f in flats:
        mine = torch.zeros(f.chunk, dtype=f.master_dtype, device=f.device)
        mine[: f.hi - f.lo].copy_(f.grad_shard)
        full = torch.empty(f.chunk * f.world, dtype=f.master_dtype, device=f.device)
        all_gather_single(full, mine, group=f.group)
        has = f.has_gradient()
        for i, (name, p) in enumerate(zip(f.names, f.params)):
            if has[i]:
                out[name] = full[f.offsets[i]:f.offsets[i + 1]].view(p.shape).clone()
    if mode.name in ("fsdp", "zero2"):
        for name, g in zip(mode.names, mode.layer_part.gradients()):
            if g is not None:
                out[name] = g.full_tensor().detach().clone()
    return out


def _logprobs(w, batch) -> torch.Tensor:
    with w.core.walk_session():
        lp = w.core.logprobs(batch).logprobs
    return torch.cat([torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in lp])


def record(rank, world, over, steps=2, counted=True):
    """One rank's run of a case: log-probs of batch 0 before and after training (the whole
    batch, every rank), per step the loss, every reduced gradient (before clipping), the
    parameters after the step, the collectives by group (HSDP: shard / replica) and the
    state bytes."""
    from dta_cli.batches import BatchSource
    from experiments.comm_count import CommCounter
    from tests.test_sharding import _step, _worker

    cfg = load_config(None, over)
    w = _worker(cfg, rank, world)
    mode, layout = w.core.sharding, w.core.layout
    source = BatchSource(cfg, 512)
    out = {"layout": layout, "logprobs": [_logprobs(w, source.batch(0))], "steps": []}
    grads = {}
    reduce = mode.reduce_gradients

    def reduce_and_capture():
        reduce()
        grads["now"] = full_gradients(mode)

    mode.reduce_gradients = reduce_and_capture
    groups = {"shard": tuple(r for g in layout.shard_groups() if rank in g for r in g),
              "replicas": tuple(r for g in layout.replica_groups() if rank in g for r in g)}
    for k in range(steps):
        counter = CommCounter()
        if counted and world > 1:
            with counter:
                stats = _step(w, cfg, k, rank, world, source)
        else:
            stats = _step(w, cfg, k, rank, world, source)
        out["steps"].append({"loss": stats["loss"], "updated": stats["updated"],
                             "grads": grads.pop("now"), "state": state(w)["model"],
                             "state_bytes": stats["state_bytes"],
                             "comm": counter.calls})
    mode.reduce_gradients = reduce
    out["logprobs"].append(_logprobs(w, source.batch(0)))
    out["param_norm"] = w.param_norm()
    out["groups"] = groups
    return out


def run_cases(rank, world, cases):
    torch.set_num_threads(1)
    return [record(rank, world, overrides(*case)) for case in cases]


# ------------------------------------------------------------- comparisons --
def rel(a, b) -> float:
    num = float((a.double() - b.double()).pow(2).sum())
    den = float(b.double().pow(2).sum())
    return (num / den) ** 0.5 if den else num ** 0.5


def rel_state(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def one_process(case, steps=2):
    threads = torch.get_num_threads()
    try:
        return record(0, 1, reference_overrides(case), steps=steps, counted=False)
    finally:
        torch.set_num_threads(threads)


def assert_matches(ranks: list, ref: dict, what: str) -> dict:
    """Every rank's run equals the one process's (module doc); returns the worst errors."""
    worst = {"logprobs": 0.0, "loss": 0.0, "grad": 0.0, "params": 0.0}
    for k, ref_step in enumerate(ref["steps"]):
        loss = sum(r["steps"][k]["loss"] for r in ranks)
        err = abs(loss - ref_step["loss"]) / abs(ref_step["loss"])
        assert err <= TOL, f"{what} step {k}: loss {loss!r} vs {ref_step['loss']!r}"
        worst["loss"] = max(worst["loss"], err)
    for rank, got in enumerate(ranks):
        for i in (0, 1):
            err = rel(got["logprobs"][i], ref["logprobs"][i])
            assert err <= TOL, f"{what} rank {rank}: log-probs ({i}) relative L2 {err:.3g}"
            worst["logprobs"] = max(worst["logprobs"], err)
        for k, ref_step in enumerate(ref["steps"]):
            step = got["steps"][k]
            assert step["updated"]
            assert set(step["grads"]) == set(ref_step["grads"]), (what, rank, k)
            for name, g in ref_step["grads"].items():
                err = rel(step["grads"][name], g)
                assert err <= TOL, f"{what} rank {rank} step {k}: grad {name} {err:.3g}"
                worst["grad"] = max(worst["grad"], err)
            err = rel_state(step["state"], ref_step["state"])
            assert err <= TOL, f"{what} rank {rank} after step {k}: params {err:.3g}"
            worst["params"] = max(worst["params"], err)
        assert got["param_norm"] == pytest.approx(ref["param_norm"], rel=TOL)
    return worst


def replica_all_reduces(got: dict, step: int) -> tuple[int, int]:
    """(all-reduces over this rank's replica group, other collectives over it) in a step."""
    ranks = got["groups"]["replicas"]
    calls = [op for op, r, _ in got["steps"][step]["comm"] if r == ranks]
    return calls.count("all_reduce"), len(calls) - calls.count("all_reduce")


def check_hsdp_traffic(results: list, what: str) -> None:
    """The replica groups see one all-reduce per step (the model is under one bucket), the
    shard groups carry every other collective; nothing spans the world."""
    for rank, got in enumerate(results):
        assert got["layout"].shard_size == 2 and got["layout"].replicas == 2
        groups = {got["groups"]["shard"], got["groups"]["replicas"]}
        for k in range(len(got["steps"])):
            n, others = replica_all_reduces(got, k)
            assert (n, others) == (1, 0), f"{what} rank {rank} step {k}: {n} all-reduces " \
                                          f"and {others} other collectives across replicas"
            spans = {r for _, r, _ in got["steps"][k]["comm"]}
            assert spans <= groups, (what, rank, k, spans)


@pytest.mark.parametrize("cases", [pytest.param(FAST, id="fast"),
                                   pytest.param(SLOW, id="slow", marks=pytest.mark.slow)])
def test_hsdp_2x2_equals_one_process(cases):
    results = run_ranks(run_cases, 4, cases, timeout=900.0)
    for i, case in enumerate(cases):
        ref = one_process(case)
        ranks = [results[r][i] for r in range(4)]
        worst = assert_matches(ranks, ref, f"HSDP 2x2 {case}")
        check_hsdp_traffic(ranks, str(case))
        print(f"HSDP 2x2 {case[0]} {case[1]}: worst relative error vs one process "
              f"{ {k: f'{v:.2g}' for k, v in worst.items()} }")


# ----------------------------------------------------------------- checkpoints --
def resume_hsdp(rank, world, mode, directory):
    """Step 0, save under HSDP 2 x 2, step 1; fresh HSDP workers and fresh plain-sharded
    workers load it and run step 1."""
    from tests.test_sharding import _step, _worker

    torch.set_num_threads(1)
    out = {}
    for name, shard in (("hsdp", 2), ("plain", None)):
        cfg = load_config(None, overrides(mode, "recompute", shard))
        if name == "hsdp":
            w = _worker(cfg, rank, world)
            _step(w, cfg, 0, rank, world)
            path = w.save_checkpoint(os.path.join(directory, mode), 1, {"note": "hsdp"})
            _step(w, cfg, 1, rank, world)
            out["straight"] = state(w)["model"]
            out["files"] = {f: os.path.getsize(os.path.join(path, f))
                            for f in os.listdir(path) if f.endswith(".distcp")}
            out["elements"] = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
        fresh = _worker(cfg, rank, world)
        fresh.load_checkpoint(path)
        _step(fresh, cfg, 1, rank, world)
        out[name] = state(fresh)["model"]
    return out


@pytest.mark.parametrize("mode", [pytest.param("zero1", marks=pytest.mark.slow), "fsdp"])
def test_hsdp_checkpoint_resumes_bit_identically(tmp_path, mode):
    from tests.test_runtime import assert_identical

    results = run_ranks(resume_hsdp, 4, mode, str(tmp_path), timeout=900.0)
    for rank, got in enumerate(results):
        assert_identical(got["hsdp"], got["straight"], f"{mode} HSDP resumed, rank {rank}")
        err = rel_state(got["plain"], got["straight"])  # another cut: the same logical state
        assert err <= 1e-12, f"{mode}: HSDP checkpoint resumed unsharded-HSDP {err:.3g}"
        print(f"{mode} rank {rank}: HSDP checkpoint resumed under plain sharding: {err:.2g}")
    # the replica groups hold the same shards: DCP writes each once (the weights and two
    # AdamW states, float64), not once per replica group
    written, logical = sum(results[0]["files"].values()), 3 * 8 * results[0]["elements"]
    assert logical <= written <= 1.1 * logical, (written, logical)
    print(f"{mode}: HSDP 2x2 checkpoint {written:,} bytes in .distcp files for {logical:,} "
          "logical bytes")


# ------------------------------------------- a shard group that trains nothing --
def one_group_trains(rank, world):
    """fsdp 2 x 2 (or one process): per step every rank walks batch 0 forward (log-probs, in
    the step's session), then only the second shard group trains it (its two ranks a half
    each); the first group's last call was a forward without gradient -- FSDP2 kept its root
    gathered -- while the replica sum hands it the gradient and the update changes its
    shards."""
    from dta.losses import batch_totals
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime.worker import make_training_loss
    from tests.test_sharding import _worker

    torch.set_num_threads(1)
    cfg = load_config(None, overrides("fsdp", "recompute", 2 if world > 1 else None))
    w = _worker(cfg, rank, world)
    core, loss = w.core, make_training_loss(cfg)
    batch = BatchSource(cfg, 512).batch(0)
    totals = batch_totals(batch)
    parts = assign_workers(PrefixTree(batch.input_ids), 2).workers
    logprobs = []
    for _ in range(2):
        core.zero_grad()
        logprobs.append(_logprobs(w, batch))
        if world == 1:
            core.accumulate(batch, loss, totals=totals)
        elif rank >= 2 and parts[rank - 2]:
            core.accumulate(batch.subset(parts[rank - 2]), loss, totals=totals)
        norm, updated = core.optimizer_step(cfg.optimizer.max_grad_norm)
        assert updated
    return {"state": state(w)["model"], "logprobs": logprobs, "norm": w.param_norm()}


def test_a_shard_group_that_trained_nothing_takes_the_update():
    ref = one_group_trains(0, 1)
    for rank, got in enumerate(run_ranks(one_group_trains, 4)):
        err = rel_state(got["state"], ref["state"])
        assert err <= TOL, f"rank {rank}: params {err:.3g}"
        for a, b in zip(got["logprobs"], ref["logprobs"]):
            assert rel(a, b) <= TOL, f"rank {rank}: log-probs {rel(a, b):.3g}"
        assert got["norm"] == pytest.approx(ref["norm"], rel=TOL)

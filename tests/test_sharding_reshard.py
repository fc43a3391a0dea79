"""Re-sharding (runtime.checkpoints.reshard): a DCP checkpoint written by 2 gloo ranks (zero1,
fsdp) resumed by one replica, by 3 ranks, or by 2 ranks of the other mode, and a 1-rank
checkpoint resumed by 2 sharded ranks, hold exactly the saved parameters, and their next
step equals the original run's (float64 <= 1e-12). A checkpoint that is not this run's
(LoRA <-> full, another optimizer, another model size) is refused in one line before any
parameter is touched; one in the sharded format before 2026-12-05 still loads. Layouts with
context parallelism and 4 steps: tests/test_resume_layouts.py."""
from __future__ import annotations

import os

import pytest

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_sharding import _step, _worker, overrides, rel_l2
from tests.workers import state

SHARDINGS = ("zero1", "fsdp")


def save_at_two(rank, world, directory):
    """Per mode: step 0, save, the full state then, step 1, the full state after; then the
    other mode's fresh workers load that checkpoint and run step 1."""
    out = {}
    for mode in SHARDINGS:
        cfg = load_config(None, overrides(mode, "float64", "retain"))
        w = _worker(cfg, rank, world)
        _step(w, cfg, 0, rank, world)
        path = w.save_checkpoint(os.path.join(directory, mode), 1, {"note": "test"})
        saved = state(w)["model"]
        _step(w, cfg, 1, rank, world)
        out[mode] = {"path": path, "saved": saved, "after": state(w)["model"]}
    for mode, other in zip(SHARDINGS, reversed(SHARDINGS)):  # zero1's checkpoint into fsdp, and back
        cfg = load_config(None, overrides(other, "float64", "retain"))
        w = _worker(cfg, rank, world)
        meta = w.load_checkpoint(out[mode]["path"])
        loaded = state(w)["model"]
        _step(w, cfg, 1, rank, world)
        out[f"{mode}->{other}"] = {"meta": meta, "loaded": loaded, "after": state(w)["model"]}
    # two replicas write the logical view with DCP (as AReaL's dcp does): each whole tensor
    # is held by both ranks and written once
    from runtime.checkpoints.sharded import save_sharded

    cfg = load_config(None, overrides("replicate", "float64", "retain"))
    w = _worker(cfg, rank, world)
    _step(w, cfg, 0, rank, world)
    path = save_sharded(os.path.join(directory, "replicas"), 1, w.core.sharding.sharded_state())
    out["replicas"] = {"path": path, "saved": state(w)}
    return out


def test_two_rank_checkpoints_resume_on_one_rank_and_in_the_other_mode(tmp_path):
    two = run_ranks(save_at_two, 2, str(tmp_path))
    for mode in SHARDINGS:
        cfg = load_config(None, overrides(mode, "float64", "retain"))
        one = _worker(cfg, 0, 1)  # ray.num_workers=1: a replica
        assert one.core.layout.sharding == "replicate"
        meta = one.load_checkpoint(two[0][mode]["path"])
        assert meta["world_size"] == 2 and meta["sharding"] == mode and meta["step"] == 1
        loaded = state(one)
        for name, t in two[0][mode]["saved"].items():  # exactly the saved parameters
            assert (loaded["model"][name] == t).all(), f"{mode} {name}"
        moments = [st for st in one.optimizer.state.values() if st]
        assert moments and all(float(st["step"]) == 1 for st in moments)
        _step(one, cfg, 1, 0, 1)
        err = rel_l2(state(one)["model"], two[0][mode]["after"])
        assert err <= 1e-12, f"{mode}: resumed on 1 rank vs 2 ranks, relative L2 {err:.3g}"
        print(f"{mode}: W=2 -> W=1 resume, step 2 vs the 2-rank run {err:.2g}")
    cfg = load_config(None, overrides("replicate", "float64", "retain"))
    one = _worker(cfg, 0, 1)
    one.load_checkpoint(two[0]["replicas"]["path"])
    got, want = state(one), two[0]["replicas"]["saved"]
    assert all((got["model"][k] == v).all() for k, v in want["model"].items())
    for i, st in want["optimizer"]["state"].items():  # AdamW's state, parameter by parameter
        assert all((got["optimizer"]["state"][i][k] == v).all() for k, v in st.items()), i
    for mode, other in zip(SHARDINGS, reversed(SHARDINGS)):
        for rank in (0, 1):
            got = two[rank][f"{mode}->{other}"]
            assert got["meta"]["sharding"] == mode and got["meta"]["step"] == 1
            for name, t in two[0][mode]["saved"].items():
                assert (got["loaded"][name] == t).all(), f"{mode}->{other} {name}"
            err = rel_l2(got["after"], two[0][mode]["after"])
            assert err <= 1e-12, f"{mode}->{other} rank {rank}: relative L2 {err:.3g}"
        print(f"{mode} W=2 -> {other} W=2 resume, step 2 vs the {mode} run {err:.2g}")


@pytest.mark.slow  # 3 gloo ranks on this 2-core machine: ~60 s
def test_two_rank_checkpoints_resume_on_three_ranks(tmp_path):
    """The same mode at 3 ranks: DCP re-cuts every logical tensor (zero1's flat masters and
    moments, fsdp's per-parameter DTensors and vocabulary shards)."""
    (two, _) = run_ranks(save_at_two, 2, str(tmp_path))
    three = run_ranks(resume_at_three, 3, {m: two[m]["path"] for m in SHARDINGS})
    for mode in SHARDINGS:
        for rank in range(3):
            got = three[rank][mode]
            for name, t in two[mode]["saved"].items():
                assert (got["loaded"][name] == t).all(), f"{mode} rank {rank} {name}"
            err = rel_l2(got["after"], two[mode]["after"])
            assert err <= 1e-12, f"{mode} W=3 rank {rank}: relative L2 {err:.3g}"
        print(f"{mode}: W=2 -> W=3 resume, step 2 vs the 2-rank run {err:.2g}")


def resume_at_three(rank, world, paths):
    """Per mode: 3 fresh ranks load the 2-rank checkpoint (the same mode), then step 1."""
    out = {}
    for mode in SHARDINGS:
        cfg = load_config(None, overrides(mode, "float64", "retain"))
        w = _worker(cfg, rank, world)
        meta = w.load_checkpoint(paths[mode])
        loaded = state(w)["model"]
        _step(w, cfg, 1, rank, world)
        out[mode] = {"meta": meta, "loaded": loaded, "after": state(w)["model"]}
    return out


def resume_at_two(rank, world, path):
    """Per mode: fresh 2-rank workers load the 1-rank (replicated) checkpoint, then step 1."""
    out = {}
    for mode in SHARDINGS:
        cfg = load_config(None, overrides(mode, "float64", "retain"))
        w = _worker(cfg, rank, world)
        meta = w.load_checkpoint(path)
        loaded = state(w)["model"]
        _step(w, cfg, 1, rank, world)
        out[mode] = {"meta": meta, "loaded": loaded, "after": state(w)["model"]}
    return out


def test_a_one_rank_checkpoint_resumes_on_two_sharded_ranks(tmp_path):
    cfg = load_config(None, overrides("zero1", "float64", "retain"))
    one = _worker(cfg, 0, 1)  # a replica: the one format, written by this process alone
    _step(one, cfg, 0, 0, 1)
    path = one.save_checkpoint(str(tmp_path / "one"), 1, {"num_workers": 1})
    saved = state(one)["model"]
    _step(one, cfg, 1, 0, 1)
    after = state(one)["model"]
    results = run_ranks(resume_at_two, 2, path)
    for mode in SHARDINGS:
        for rank in (0, 1):
            got = results[rank][mode]
            assert got["meta"]["step"] == 1
            for name, t in saved.items():
                assert (got["loaded"][name] == t).all(), f"{mode} rank {rank} {name}"
            err = rel_l2(got["after"], after)
            assert err <= 1e-12, f"{mode} rank {rank}: relative L2 {err:.3g}"
        print(f"{mode}: W=1 -> W=2 resume, step 2 vs the 1-rank run {err:.2g}")

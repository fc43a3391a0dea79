"""Re-sharding (runtime.sharding.reshard): a DCP checkpoint written by 2 gloo ranks (zero1,
fsdp) resumed by one replica or by 3 ranks, and a 1-rank checkpoint resumed by 2 sharded
ranks, hold exactly the saved parameters, and their next step equals the original run's
(float64 <= 1e-12); resuming in another sharded mode is refused in one line naming both
world sizes and modes, before any parameter is touched."""
from __future__ import annotations

import os

import pytest

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_sharding import _step, _worker, overrides, rel_l2
from tests.workers import state

MODES = ("zero1", "fsdp")


def save_at_two(rank, world, directory):
    """Per mode: step 0, save, the full state then, step 1, the full state after; then an
    fsdp run asked to load the zero1 checkpoint (refused, its parameters unchanged)."""
    from runtime.dcp import ShardedCheckpointError

    out = {}
    for mode in MODES:
        cfg = load_config(None, overrides(mode, "float64", "retain"))
        w = _worker(cfg, rank, world)
        _step(w, cfg, 0, rank, world)
        path = w.save_checkpoint(os.path.join(directory, mode), 1, {"note": "test"})
        saved = state(w)["model"]
        _step(w, cfg, 1, rank, world)
        out[mode] = {"path": path, "saved": saved, "after": state(w)["model"]}
    cfg = load_config(None, overrides("fsdp", "float64", "retain"))
    w = _worker(cfg, rank, world)
    before = state(w)["model"]
    try:
        w.load_checkpoint(out["zero1"]["path"])
        out["refused"] = None
    except ShardedCheckpointError as exc:
        out["refused"] = str(exc)
    out["untouched"] = all((before[k] == v).all() for k, v in state(w)["model"].items())
    return out


def test_two_rank_checkpoints_resume_on_one_rank_and_mismatches_are_refused(tmp_path):
    from runtime.dcp import ShardedCheckpointError
    from runtime.sharding.reshard import check_resumable

    (two, _) = run_ranks(save_at_two, 2, str(tmp_path))
    for mode in MODES:
        cfg = load_config(None, overrides(mode, "float64", "retain"))
        one = _worker(cfg, 0, 1)  # ray.num_workers=1: a replica
        assert one.core.layout.sharding == "replicate"
        meta = one.load_checkpoint(two[mode]["path"])
        assert meta["world_size"] == 2 and meta["sharding"] == mode and meta["step"] == 1
        loaded = state(one)
        for name, t in two[mode]["saved"].items():  # exactly the saved parameters
            assert (loaded["model"][name] == t).all(), f"{mode} {name}"
        moments = [st for st in one.optimizer.state.values() if st]
        assert moments and all(float(st["step"]) == 1 for st in moments)
        _step(one, cfg, 1, 0, 1)
        err = rel_l2(state(one)["model"], two[mode]["after"])
        assert err <= 1e-12, f"{mode}: resumed on 1 rank vs 2 ranks, relative L2 {err:.3g}"
        print(f"{mode}: W=2 -> W=1 resume, step 2 vs the 2-rank run {err:.2g}")
    message = two["refused"]
    assert message is not None and "\n" not in message
    assert "2 rank(s) with train.sharding=zero1" in message and "train.sharding=fsdp" in message
    assert two["untouched"]
    with pytest.raises(ShardedCheckpointError, match=r"saved by 2 rank.*this run has 3 rank"):
        check_resumable(two["fsdp"]["path"], 3, "zero1")
    with pytest.raises(ShardedCheckpointError, match=r"this run has 2 rank.*replicate"):
        check_resumable(two["fsdp"]["path"], 2, "replicate")


@pytest.mark.slow  # 3 gloo ranks on this 2-core machine: ~60 s
def test_two_rank_checkpoints_resume_on_three_ranks(tmp_path):
    """The same mode at 3 ranks: DCP re-cuts every logical tensor (zero1's flat masters and
    moments, fsdp's per-parameter DTensors and vocabulary shards)."""
    (two, _) = run_ranks(save_at_two, 2, str(tmp_path))
    three = run_ranks(resume_at_three, 3, {m: two[m]["path"] for m in MODES})
    for mode in MODES:
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
    for mode in MODES:
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
    for mode in MODES:
        cfg = load_config(None, overrides(mode, "float64", "retain"))
        w = _worker(cfg, rank, world)
        meta = w.load_checkpoint(path)
        loaded = state(w)["model"]
        _step(w, cfg, 1, rank, world)
        out[mode] = {"meta": meta, "loaded": loaded, "after": state(w)["model"]}
    return out


def test_a_one_rank_checkpoint_resumes_on_two_sharded_ranks(tmp_path):
    cfg = load_config(None, overrides("zero1", "float64", "retain"))
    one = _worker(cfg, 0, 1)  # a replica: its checkpoint is model.pt + optimizer.pt
    _step(one, cfg, 0, 0, 1)
    path = one.save_checkpoint(str(tmp_path / "one"), 1, {"num_workers": 1})
    saved = state(one)["model"]
    _step(one, cfg, 1, 0, 1)
    after = state(one)["model"]
    results = run_ranks(resume_at_two, 2, path)
    for mode in MODES:
        for rank in (0, 1):
            got = results[rank][mode]
            assert got["meta"]["step"] == 1
            for name, t in saved.items():
                assert (got["loaded"][name] == t).all(), f"{mode} rank {rank} {name}"
            err = rel_l2(got["after"], after)
            assert err <= 1e-12, f"{mode} rank {rank}: relative L2 {err:.3g}"
        print(f"{mode}: W=1 -> W=2 resume, step 2 vs the 1-rank run {err:.2g}")

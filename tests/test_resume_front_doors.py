"""Another front door resumes under another layout (issue 48): AReaL's ``DTATrainEngine``
saves its DCP checkpoint (``SaveLoadMeta(weight_format="dcp")``, what AReaL's RecoverHandler
writes) under zero1 on 2 gloo ranks (``fsdp:d2``) after one ``train_batch``; a fresh engine
under fsdp with context parallelism 2 (``fsdp:d1c2``, 2 ranks) and one under replicate
(``fsdp:d1``, one process) load it and train the next batch: their parameters and AdamW
state equal the uninterrupted zero1 run's (float64, relative L2 <= 1e-12, step counts
equal). The Ray worker's and verl's checkpoints go through the same core
(``runtime.checkpoints.engine``): tests/test_resume_layouts.py."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from experiments.local_ranks import run_ranks
from tests.test_engine_front_doors import run_config
from tests.test_resume_layouts import KEYS, assemble, shapes_of, snapshot

pytestmark = pytest.mark.skipif(importlib.util.find_spec("areal") is None,
                                reason="the optional areal extra is not installed")
TOL = 1e-12


def _compare(got: dict, ref: dict) -> dict:
    if set(got) != set(ref):
        raise AssertionError(f"other entries: {sorted(set(got) ^ set(ref))[:4]}")
    errs = {}
    for key in KEYS:
        num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref if k[1] == key)
        den = sum(float(ref[k].pow(2).sum()) for k in ref if k[1] == key)
        errs[key] = (num / den) ** 0.5
    steps = {k: float(v) for k, v in got.items() if k[1] == "step"}
    if steps != {k: float(v) for k, v in ref.items() if k[1] == "step"} or \
            set(steps.values()) != {2.0}:
        raise AssertionError("the step counts differ")
    return errs


def areal(rank, world, mode, cp, directory, save: bool):
    """``save``: zero1 step 0, DCP save (version 1), step 1. Else: load, step 1."""
    from areal.api.io_struct import SaveLoadMeta

    from tests.areal_front_door import make_engine, train_step

    torch.set_num_threads(1)
    cfg = run_config(world, mode, cp)
    eng = make_engine(world, mode, cp, cfg)
    meta = SaveLoadMeta(path=directory, weight_format="dcp", with_optim=True)
    if save:
        train_step(eng, cfg, 0, rank, world, cp)
        eng.set_version(1)
        eng.save(meta)
    else:
        eng.load(meta)
    train_step(eng, cfg, 1, rank, world, cp)
    out = {"snapshot": snapshot(eng), "layout": eng.core.layout.record()}
    eng.destroy()
    return out


def on_two(rank, world, directory):
    return {"zero1": areal(rank, world, "zero1", 1, directory, save=True),
            "fsdp_c2": areal(rank, world, "fsdp", 2, directory, save=False)}


def test_areal_dcp_checkpoint_resumes_under_another_layout(tmp_path):
    directory = str(tmp_path / "recover")
    two = run_ranks(on_two, 2, directory, timeout=900.0)
    with pytest.MonkeyPatch.context() as mp:  # one process: the engine's own 1-rank group
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(key, raising=False)
        threads = torch.get_num_threads()
        try:
            one = areal(0, 1, "replicate", 1, directory, save=False)
        finally:
            torch.set_num_threads(threads)
    assert os.path.isdir(os.path.join(directory, "step-000001"))
    shapes = shapes_of()
    ref = assemble([r["zero1"]["snapshot"] for r in two], shapes)
    for name, results in (("fsdp_c2", [r["fsdp_c2"] for r in two]), ("replicate", [one])):
        assert results[0]["layout"]["sharding"] == name.split("_")[0]
        errs = _compare(assemble([r["snapshot"] for r in results], shapes), ref)
        print(f"AReaL: saved under zero1 fsdp:d2, resumed under {name}: "
              + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()))
        assert max(errs.values()) <= TOL, (name, errs)

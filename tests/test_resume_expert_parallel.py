"""Checkpoints of expert slices resume under another layout (issues 46 and 48): the
logical view holds every MoE layer's fused experts as the whole ``[n, ...]`` tensor, a
rank's slice as its box (replicate) or its flat range (zero1 / fsdp: the slices' flat
shards over the expert replicas), so a run saved with ``train.expert_parallel=2`` resumes
without expert parallelism and the reverse. float64, qwen3_moe tiny with replayed routing
and the router aux loss: the parameters, AdamW's exp_avg / exp_avg_sq and the step counts
after step 4 (read whole from each run's step-4 checkpoint) equal the uninterrupted run's,
relative L2 <= 1e-12."""
from __future__ import annotations

import os

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_expert_parallel import RoutedTails, overrides
from tests.test_sharding import _step, _worker

TOL = 1e-12
LAYOUTS = {"ep2-replicate": (2, "replicate", 2), "ep2-zero1": (2, "zero1", 2),
           "ep2-fsdp": (2, "fsdp", 2), "ep2-zero2": (2, "zero2", 2),
           "one": (1, "replicate", 1), "zero1": (1, "zero1", 2)}


def _cfg(layout):
    E, mode, world = LAYOUTS[layout]
    return load_config(None, overrides("qwen3_moe", "recompute", 8, E, mode) +
                       [f"ray.num_workers={world}"])


def run(rank, world, layout, directory, resume_from):
    """Uninterrupted (``resume_from`` None: steps 0-3, saved after steps 2 and 4) or resumed
    from ``resume_from``'s step-2 checkpoint (steps 2-3, saved after step 4)."""
    torch.set_num_threads(1)
    cfg = _cfg(layout)
    w, source = _worker(cfg, rank, world), RoutedTails(cfg)
    name = layout if resume_from is None else f"{resume_from}-to-{layout}"
    first = 0
    if resume_from is not None:
        meta = w.load_checkpoint(os.path.join(directory, resume_from, "step-000002"))
        if meta["step"] != 2 or w.completed_steps != 2:
            raise RuntimeError(f"resumed at step {meta['step']} ({w.completed_steps} done)")
        first = 2
    for k in range(first, 4):
        _step(w, cfg, k, rank, world, source)
        if k == 1 and resume_from is None:
            w.save_checkpoint(os.path.join(directory, name), 2, {})
    return w.save_checkpoint(os.path.join(directory, name), 4, {})


def on(layout, directory, resume_from=None):
    world = LAYOUTS[layout][2]
    if world > 1:
        return run_ranks(run, world, layout, directory, resume_from, timeout=900.0)[0]
    threads = torch.get_num_threads()
    try:
        return run(0, 1, layout, directory, resume_from)
    finally:
        torch.set_num_threads(threads)


def whole_state(path) -> dict:
    """A checkpoint (either format) loaded by one process without expert parallelism: per
    trained parameter its weights, exp_avg, exp_avg_sq and step, whole."""
    threads = torch.get_num_threads()
    try:
        w = _worker(_cfg("one"), 0, 1)
        w.load_checkpoint(path)
    finally:
        torch.set_num_threads(threads)
    mode, out = w.core.sharding, {}
    for n, p in zip(mode.names, mode.stepped):
        st = mode.optimizer.state[p]
        out[("model", n)] = p.detach().double().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[(k, n)] = st[k].double().clone()
        out[("step", n)] = torch.tensor(float(st["step"]))
    return out


def check(got_path, ref_path) -> dict:
    got, ref = whole_state(got_path), whole_state(ref_path)
    if not any("experts" in n for _, n in ref):
        raise AssertionError("the model has no expert tensor")
    errs = {}
    for kind in ("model", "exp_avg", "exp_avg_sq"):
        keys = [k for k in ref if k[0] == kind]
        num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in keys)
        den = sum(float(ref[k].pow(2).sum()) for k in keys)
        errs[kind] = (num / den) ** 0.5
    steps = {k: float(v) for k, v in got.items() if k[0] == "step"}
    if steps != {k: float(v) for k, v in ref.items() if k[0] == "step"} or \
            set(steps.values()) != {4.0}:
        raise AssertionError("step counts differ from the uninterrupted run's (4)")
    return errs


def _check_all(cases) -> None:
    for got, ref in cases:
        errs = check(got, ref)
        print(f"{got}: vs the uninterrupted run: {errs}")
        assert max(errs.values()) <= TOL, (got, errs)


def test_expert_slices_resume_without_expert_parallelism_and_back(tmp_path):
    """zero1's flat expert pieces into one process; one process's whole tensors into
    replicated expert slices."""
    d = str(tmp_path)
    ep, one = on("ep2-zero1", d), on("one", d)
    _check_all([(on("one", d, "ep2-zero1"), ep), (on("ep2-replicate", d, "one"), one)])


@pytest.mark.slow
def test_expert_slices_resume_across_modes(tmp_path):
    d = str(tmp_path)
    ep, fsdp, one = on("ep2-zero1", d), on("ep2-fsdp", d), on("one", d)
    _check_all([(on("zero1", d, "ep2-zero1"), ep), (on("ep2-zero1", d, "one"), one),
                (on("zero1", d, "ep2-fsdp"), fsdp), (on("ep2-fsdp", d, "one"), one)])


@pytest.mark.slow
def test_zero2_expert_slices_resume_across_layouts(tmp_path):
    """zero2 with E = 2 (the slices' flat shards beside FSDP2's layer units) saved at step 2,
    resumed by one process, by replicated slices (E = 2) and by zero1 without expert
    parallelism; one process's checkpoint resumed by zero2 with E = 2."""
    d = str(tmp_path)
    zero2, one = on("ep2-zero2", d), on("one", d)
    _check_all([(on("one", d, "ep2-zero2"), zero2), (on("ep2-replicate", d, "ep2-zero2"), zero2),
                (on("zero1", d, "ep2-zero2"), zero2), (on("ep2-zero2", d, "one"), one)])

"""A sharding mode moves every tensor it holds to the host and back (``Sharding.to``,
``runtime/sharding/residence.py``: AReaL's colocated ``offload()`` / ``onload()``) under
replicate, zero1 and fsdp on 2 gloo ranks, and (``-m slow``) zero1 / fsdp with the optimizer
offloaded and zero2 with and without (its layers gathered for a whole walk): after a
step, every storage the mode holds is copied into a new one (``fresh``: on a CPU-only machine
the host is the device, so the copy is forced) and back, views kept views; two more steps then
give parameters and optimizer state bit-identical to the same run without the moves. A tensor
the move missed (a flat buffer the parameters view, an FSDP2 shard) would keep the old storage
and the steps after it would differ."""
from __future__ import annotations

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_hsdp import overrides
from tests.test_sharding import _step, _worker
from tests.workers import state

CASES = [("replicate", "recompute", None, "none"), ("zero1", "retain", None, "none"),
         ("fsdp", "recompute", None, "none")]
SLOW = [("zero1", "recompute", None, "optimizer"), ("fsdp", "retain", None, "optimizer"),
        ("zero2", "recompute", None, "none"), ("zero2", "retain", None, "optimizer"),
        ("fsdp", "recompute", None, "gradients"), ("zero2", "recompute", None, "gradients")]


def _storages(mode) -> dict:
    """The storages the mode's tensors live in, by address (the objects kept: no address
    is reused while the caller holds them)."""
    from runtime.sharding.residence import held_tensors

    return {t.untyped_storage().data_ptr(): t.untyped_storage() for t in held_tensors(mode)
            if t.untyped_storage().nbytes()}


def round_trips(rank, world, case, move: bool) -> dict:
    torch.set_num_threads(1)
    cfg = load_config(None, overrides(*case))
    w = _worker(cfg, rank, world)
    _step(w, cfg, 0, rank, world)
    out = {}
    if move:
        mode = w.core.sharding
        before = _storages(mode)
        mode.to("host", fresh=True)
        during = _storages(mode)
        mode.to("host", fresh=True)  # already on the host: nothing moves
        again = _storages(mode)
        mode.to("device", fresh=True)
        after = _storages(mode)
        out = {"held": len(before), "kept": len(before.keys() & during.keys()),
               "same": during.keys() == again.keys(),
               "back_kept": len(during.keys() & after.keys()),
               "count": (len(during), len(after))}
    for k in (1, 2):
        _step(w, cfg, k, rank, world)
    return {**out, "state": state(w)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check(case):
    moved = run_ranks(round_trips, 2, case, True)
    plain = run_ranks(round_trips, 2, case, False)
    for rank, (got, ref) in enumerate(zip(moved, plain)):
        where = f"{case} rank {rank}"
        assert got["held"] > 0, where
        assert got["kept"] == 0, f"{where}: {got['kept']} storage(s) not moved to the host"
        assert got["same"], f"{where}: a second move to the host moved something"
        assert got["back_kept"] == 0, f"{where}: {got['back_kept']} storage(s) not moved back"
        assert got["count"][0] == got["count"][1] == got["held"], f"{where}: {got['count']}"
        assert _same(got["state"], ref["state"]), f"{where}: the steps after the moves differ"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_round_trip_keeps_training_bit_identical(case):
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[f"{c[0]}-{c[3]}" for c in SLOW])
def test_round_trip_with_the_optimizer_offloaded(case):
    _check(case)

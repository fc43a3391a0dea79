"""``train.sharding=zero2`` (runtime/sharding/zero2.py): the parameters gathered once per walk and
kept, the gradients reduce-scattered per backward call into the fp32 shard.

Float64, the tiny Qwen3, τ²-airline "tiny" batches, local gloo ranks as the Ray worker runs
them (``dta train``'s config): log-probs before and after training, each step's loss, every
reduced gradient and the parameters after one and two AdamW steps equal one process's within
1e-10 (tests/test_hsdp.py's comparisons) -- on 2 ranks; under ``-m slow`` the retain policy,
HSDP 2 x 2, offload, and context / expert parallelism on 4 ranks. Each step all-gathers each
FSDP2 unit once (fsdp: once per call) and reduce-scatters once per backward call; every layer
stays gathered through the walk (``state_bytes``' params hold the whole compute copy). A
checkpoint saved under zero2 resumes under fsdp and one replica, and a replica's under zero2
(tests/test_resume_layouts.py's snapshot, relative L2 <= 1e-12 after step 4).
"""
from __future__ import annotations

import pytest
import torch

from experiments.local_ranks import run_ranks
from tests.test_hsdp import assert_matches, check_hsdp_traffic, overrides, record

FAST = [("zero2", "recompute", None, "none"), ("fsdp", "recompute", None, "none")]
SLOW_TWO = [("zero2", "retain", None, "none"), ("zero2", "recompute", None, "optimizer")]
SLOW_FOUR = [("zero2", "retain", 2, "none"), ("zero2", "recompute", 2, "optimizer")]


BLOCK = ["walker.block_tokens=16"]  # the paths span several packs: several calls per step


def cases_on_ranks(rank, world, cases):
    torch.set_num_threads(1)
    return [record(rank, world, overrides(*case) + BLOCK) for case in cases]


def one_process(case):
    threads = torch.get_num_threads()
    try:
        return record(0, 1, overrides(*case[:2]) + BLOCK, counted=False)
    finally:
        torch.set_num_threads(threads)


def _units(case) -> int:
    """FSDP2 units of the tiny Qwen3: its decoder layers and the root (the decoder)."""
    from dta.config.schema import load_config
    from tests.test_sharding import _worker

    cfg = load_config(None, overrides(*case))
    return len(_worker(cfg, 0, 1).model.get_decoder().layers) + 1


def gathers(step) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) in one recorded step (FSDP2's and the vocabulary's
    flat shards')."""
    ops = [op for op, _, _ in step["comm"]]
    return ops.count("all_gather_single"), ops.count("reduce_scatter_single")


def _check(cases, world, results):
    counts = {}
    for i, case in enumerate(cases):
        ref = one_process(case)
        ranks = [results[r][i] for r in range(world)]
        worst = assert_matches(ranks, ref, f"{case} on {world} ranks")
        if case[2] is not None:
            check_hsdp_traffic(ranks, str(case))
        for got in ranks:
            for step in got["steps"]:
                counts.setdefault(case[0], []).append(gathers(step))
        print(f"{case} on {world} ranks: worst relative error vs one process "
              f"{ {k: f'{v:.2g}' for k, v in worst.items()} }; all-gathers / reduce-scatters "
              f"per step {counts[case[0]][:2]}; rank 0 state_bytes "
              f"{ranks[0]['steps'][-1]['state_bytes']}")
    return counts


def test_zero2_on_two_ranks_equals_one_process_and_gathers_once_per_walk():
    results = run_ranks(cases_on_ranks, 2, FAST, timeout=900.0)
    counts = _check(FAST, 2, results)
    units = _units(FAST[0])
    # zero2: every unit gathered once per step (with the vocabulary's gather after the
    # update and the root's), one reduce-scatter per unit and backward call (several calls
    # per step, as fsdp's); fsdp on the same walk gathers per call (forward and backward)
    for (ag, rs), (fag, frs) in zip(counts["zero2"], counts["fsdp"]):
        assert ag <= units + 2 and rs >= 2 * units, (ag, rs, units)
        assert rs == frs and fag > 2 * ag, (ag, rs, fag, frs)
    # the compute copy resident: zero2 holds every layer gathered at its peak, fsdp one
    z, f = (results[0][i]["steps"][-1]["state_bytes"] for i in range(2))
    assert z["params"] > f["params"] and z["optimizer"] == f["optimizer"], (z, f)


@pytest.mark.slow
def test_zero2_retain_and_offload_on_two_ranks():
    _check(SLOW_TWO, 2, run_ranks(cases_on_ranks, 2, SLOW_TWO, timeout=900.0))


@pytest.mark.slow
def test_zero2_hsdp_2x2_equals_one_process():
    _check(SLOW_FOUR, 4, run_ranks(cases_on_ranks, 4, SLOW_FOUR, timeout=900.0))


def test_zero2_checkpoints_resume_under_fsdp_and_a_replica_and_back(tmp_path):
    """zero2 on 2 ranks saved at step 2 resumed by fsdp on 2 ranks (C=2) and by one replica;
    the replica's checkpoint resumed by zero2."""
    from tests.test_resume_layouts import _check as check_resumed
    from tests.test_resume_layouts import checkpoint_of, on_layout, on_layouts, shapes_of, state

    d, shapes = str(tmp_path), shapes_of()
    rep = on_layout("rep1", d)
    zero2, fsdp = on_layouts([("zero2w2", {"rep1": checkpoint_of(d, "rep1")}, True),
                              ("fsdp2c2", {"zero2w2": checkpoint_of(d, "zero2w2")}, False)], d)
    rep_back = on_layout("rep1", d, {"zero2w2": checkpoint_of(d, "zero2w2")}, straight=False)
    refs = {n: state(r, "straight", shapes) for n, r in (("zero2w2", zero2), ("rep1", rep))}
    check_resumed([("rep1", "zero2w2", zero2), ("zero2w2", "fsdp2c2", fsdp),
                   ("zero2w2", "rep1", rep_back)], refs, shapes)

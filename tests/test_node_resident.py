"""``train.node_resident`` (runtime/sharding/node_resident.py, ZeRO++'s hpZ): fsdp under HSDP
whose fp32 masters, AdamW state and cross-node gradient sum are sharded across the replicas.

On 4 local gloo ranks as two "nodes" of 2 (``train.shard_size=2``), float64, the tiny
Qwen3, τ²-airline "tiny" batches cut into blocks of 16 tokens (several calls per step), as
the Ray worker runs them:

- log-probs before and after training, each step's loss, every reduced gradient and the
  parameters after one and two AdamW steps equal one process's within 1e-10
  (tests/test_hsdp.py's comparisons); under ``-m slow`` the retain policy and
  ``train.offload=optimizer`` too;
- the device state is what the planner prices for the layout, byte for byte
  (``dta.planning.state.model_state(..., node_resident=True)``);
- the bytes sent across the nodes per step (the replica group's and the world's
  collectives, ``experiments.bench_node_resident``'s count) are the same for two numbers of
  calls (whole paths vs blocks of 16 tokens: the in-node collectives differ), and are the
  planner's ``replica_traffic`` figure plus the step's scalars (norms, presence flags);
- with expert parallelism (E = 2) and context parallelism (C = 2) too (slow); the mode moves to
  the host and back bit-identically (slow, 2 ranks as 2 nodes of 1);
- a checkpoint saved under node residency resumes under fsdp on 2 ranks and under one
  replica, and a replica's resumes under node residency (tests/test_resume_layouts.py's
  snapshot, relative L2 <= 1e-12 after step 4).
"""
from __future__ import annotations

import math

import pytest
import torch

from experiments.local_ranks import run_ranks
from tests.test_hsdp import assert_matches, one_process, overrides, record

RESIDENT = ["train.node_resident=true", "walker.block_tokens=16"]
FAST = [("fsdp", "recompute", 2, "none")]
SLOW = [("fsdp", "retain", 2, "none"), ("fsdp", "recompute", 2, "optimizer")]


def cases_on_ranks(rank, world, cases):
    torch.set_num_threads(1)
    return [record(rank, world, overrides(*case) + RESIDENT) for case in cases]


def _check(cases, results):
    from dta.model.models import build_config
    from dta.planning.shapes import ModelShape
    from dta.planning.state import model_state

    shape = ModelShape.of(build_config("qwen3", "tiny", vocab_size=512))
    for i, case in enumerate(cases):
        ranks = [results[r][i] for r in range(4)]
        assert all(r["layout"].node_resident and r["layout"].shard_size == 2 for r in ranks)
        worst = assert_matches(ranks, one_process(case), f"node-resident {case}")
        sb = ranks[0]["steps"][-1]["state_bytes"]  # rank 0: the largest chunks
        want = model_state(shape, 4, "fsdp", compute_bytes=8, shard_size=2, offload=case[3],
                           node_resident=True)
        where = "host" if case[3] == "optimizer" else "optimizer"
        assert sb["params"] == want["params"], (case, sb, want)
        # the state's bytes, and AdamW's step counters (the planner's bound on them)
        assert want[where] < sb[where] <= want[where] + want["steps"], (case, sb, want)
        assert 0 < sb["grads"] <= want["grads"], (case, sb, want)
        print(f"node-resident {case}: worst relative error vs one process "
              f"{ {k: f'{v:.2g}' for k, v in worst.items()} }; rank 0 state_bytes {sb}, "
              f"planner {want}")


def test_node_resident_2x2_equals_one_process():
    _check(FAST, run_ranks(cases_on_ranks, 4, FAST, timeout=900.0))


@pytest.mark.slow
def test_node_resident_retain_and_offload_2x2():
    _check(SLOW, run_ranks(cases_on_ranks, 4, SLOW, timeout=900.0))


# ------------------------------------------------------------- bytes across nodes --
def test_bytes_across_the_nodes_do_not_grow_with_the_calls():
    """The same batch as whole paths and as blocks of 16 tokens (more calls: more
    collectives inside the nodes) sends the same bytes across the nodes, the planner's."""
    from argparse import Namespace

    from experiments.bench_node_resident import count

    args = Namespace(scale="tiny", size="tiny", dtype="float64", policy="recompute",
                     offload="none")
    cases = [(2, True, None), (2, True, 16)]
    res = run_ranks(count, 4, cases, args, timeout=900.0)
    for rank, (whole, blocks) in enumerate(res):
        sent = [c["comm"]["replicas"]["sent"] + c["comm"]["world"]["sent"]
                for c in (whole, blocks)]
        calls = [c["comm"]["shard"]["calls"] for c in (whole, blocks)]
        assert calls[1] > 2 * calls[0], (rank, calls)
        assert sent[0] == sent[1] > 0, (rank, sent)
        # the planner's once-a-step collectives, and a few scalars (norms, presence flags)
        assert 0 <= sent[0] - whole["planned"] < 1024, (rank, sent, whole["planned"])
        print(f"rank {rank}: in-node collectives {calls}, cross-node bytes sent {sent}, "
              f"planner {whole['planned']:.0f}")
    assert (res[0][0]["state"].keys() == res[0][1]["state"].keys())
    num = sum(float((res[0][1]["state"][k] - v).pow(2).sum()) for k, v in
              res[0][0]["state"].items())
    den = sum(float(v.pow(2).sum()) for v in res[0][0]["state"].values())
    assert math.sqrt(num / den) <= 1e-10


# ------------------------------------------------------------------ checkpoints --
HPZ = "fsdp-hsdp-hpz"  # tests/layouts.py: fsdp on 4 ranks, 2 nodes of 2, node-resident


def _on(jobs, directory):
    import tests.test_resume_layouts as rl

    return rl.on_layouts(jobs, directory)


def _resume(tmp_path, *, fsdp_too: bool):
    import tests.test_resume_layouts as rl

    d, shapes = str(tmp_path), rl.shapes_of()
    (rep,) = _on([("rep1", None, True)], d)
    (hpz,) = _on([(HPZ, {"rep1": rl.checkpoint_of(d, "rep1")}, True)], d)
    checks = [("rep1", HPZ, hpz)]
    (back,) = _on([("rep1", {HPZ: rl.checkpoint_of(d, HPZ)}, False)], d)
    checks.append((HPZ, "rep1", back))
    if fsdp_too:
        (fsdp,) = _on([("fsdp2c2", {HPZ: rl.checkpoint_of(d, HPZ)}, False)], d)
        checks.append((HPZ, "fsdp2c2", fsdp))
    refs = {n: rl.state(r, "straight", shapes) for n, r in ((HPZ, hpz), ("rep1", rep))}
    rl._check(checks, refs, shapes)


def test_node_resident_checkpoint_resumes_as_a_replica_and_back(tmp_path):
    """A replica's checkpoint resumed under node residency (4 ranks, 2 nodes of 2); the
    node-resident run's checkpoint resumed by one replica."""
    _resume(tmp_path, fsdp_too=False)


@pytest.mark.slow
def test_node_resident_checkpoint_resumes_under_fsdp_with_context_parallelism(tmp_path):
    _resume(tmp_path, fsdp_too=True)


# ---------------------------------------------------------------------- the layout --
def test_the_layout_builds_node_residency_and_refuses_it_without_a_node():
    """``train.node_resident=true`` resolves to a layout (no longer refused as unbuilt);
    without a shard group below the world, or under another mode, it is a one-line error
    naming the key."""
    from dta.config.schema import load_config
    from runtime.engine import resolve_run_config
    from runtime.errors import LayoutError

    base = ["train.sharding=fsdp", "ray.num_workers=4", "train.node_resident=true"]
    layout = resolve_run_config(load_config(None, base + ["train.shard_size=2"]), None).layout
    assert layout.node_resident and layout.shard_size == 2 and layout.record()["node_resident"]
    for extra in ([], ["train.shard_size=2", "train.sharding=zero1"]):
        cfg = load_config(None, [*base, *extra])
        with pytest.raises(LayoutError, match="node_resident"):
            resolve_run_config(cfg, None)


# ------------------------------------------- with expert and context parallelism --
COMPOSED = [("expert parallel 2", ["model.family=qwen3_moe", "train.expert_parallel=2"]),
            ("context parallel 2", ["train.context_parallel=2"])]


def composed_on_ranks(rank, world):
    torch.set_num_threads(1)
    return [record(rank, world, overrides("fsdp", "recompute", 2) + RESIDENT + extra)
            for _, extra in COMPOSED]


@pytest.mark.slow
def test_node_resident_with_expert_and_context_parallelism_equals_one_process():
    """2 nodes of 2 with E = 2 (the expert slices: flat shards over their replicas, beside
    the node-resident layers) and with C = 2 (a tree's ranks inside one node): log-probs,
    each step's loss, the parameters after two steps and every dense gradient (the expert
    slices' are not read back here) equal one process's."""
    from tests.test_hsdp import TOL, rel, rel_state

    results = run_ranks(composed_on_ranks, 4, timeout=900.0)
    for i, (what, extra) in enumerate(COMPOSED):
        family = [x for x in extra if x.startswith("model.family")]
        ref = record(0, 1, overrides("fsdp", "recompute") + family, counted=False)
        ranks = [results[r][i] for r in range(4)]
        heads = ranks[::2] if "context" in what else ranks  # a CP group's loss: its head's
        for k, step in enumerate(ref["steps"]):
            loss = sum(r["steps"][k]["loss"] for r in heads)
            assert abs(loss - step["loss"]) <= TOL * abs(step["loss"]), (what, k, loss)
        worst = 0.0
        for got in ranks:
            for j in (0, 1):
                worst = max(worst, rel(got["logprobs"][j], ref["logprobs"][j]))
            for k, step in enumerate(ref["steps"]):
                worst = max(worst, rel_state(got["steps"][k]["state"], step["state"]))
                dense = set(got["steps"][k]["grads"])
                assert dense and dense <= set(step["grads"]), (what, k)
                for name in dense:
                    worst = max(worst, rel(got["steps"][k]["grads"][name], step["grads"][name]))
        assert worst <= TOL, (what, worst)
        print(f"node-resident 2 x 2, {what}: worst relative error vs one process {worst:.2g}")


# ------------------------------------------------------------------- residence --
def _round_trips(rank, world, move):
    import tests.test_residence as tr

    plain = tr.overrides
    tr.overrides = lambda *case: plain(*case) + ["train.node_resident=true"]
    return tr.round_trips(rank, world, ("fsdp", "recompute", 1, "none"), move)


@pytest.mark.slow
def test_node_resident_moves_to_the_host_and_back_bit_identically():
    """2 ranks as 2 nodes of 1: every storage the mode holds (the node shards, the flat
    master slices and their AdamW state) moved to the host and back (``Sharding.to``,
    tests/test_residence.py's check); two more steps equal the run without the moves."""
    from tests.test_residence import _same

    moved = run_ranks(_round_trips, 2, True)
    plain = run_ranks(_round_trips, 2, False)
    for rank, (got, ref) in enumerate(zip(moved, plain)):
        assert got["held"] > 0 and got["kept"] == 0 and got["back_kept"] == 0, (rank, got)
        assert got["same"] and got["count"][0] == got["count"][1] == got["held"], (rank, got)
        assert _same(got["state"], ref["state"]), rank

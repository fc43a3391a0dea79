"""``train.prefetch=true`` (runtime/sharding/prefetch.py): fsdp's next-layer all-gather issued
before the current layer computes.

Float64, the tiny Qwen3, τ²-airline batches, local gloo ranks as the Ray worker runs them:
log-probs before and after training, each step's loss, every reduced gradient and the
parameters after one and two AdamW steps equal one process's within 1e-10
(tests/test_hsdp.py's comparisons) -- recompute on 2 ranks in the default suite; under
``-m slow`` retain on 2 ranks, both policies on 4 ranks, HSDP 2 x 2, expert parallelism
under retain, and the branched "small" batches (packs of several nodes, the ranks' pops
interleaving differently).

That the prefetch is issued: at the start of every layer's forward compute the next layer's
all-gather is already issued and not yet consumed (FSDP2's pending gather), and under
recompute at the start of every layer's backward compute the previous layer's; without
prefetch never. The all-gathers per step are as many as without prefetch (every prefetched
gather is used, none repeated), and a prefetched gather left unused after a walk is refused.
"""
from __future__ import annotations

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_hsdp import assert_matches, overrides, record

BLOCK = ["walker.block_tokens=16"]  # the paths span several calls
SMALL = ["workload.scale=small"]  # branched: packs of several nodes, nested pops
ON = ["train.prefetch=true"]


def case_overrides(policy, extra=(), prefetch=True):
    return overrides("fsdp", policy) + (ON if prefetch else []) + list(extra)


# ------------------------------------------------------------------- on the ranks --
def install_markers(mode) -> list:
    """Per layer compute start, forward and backward: (pass, layer, whether the layer the
    prefetch targets -- i + 1 forward, i - 1 backward -- holds an issued, unused gather)."""
    from runtime.sharding.prefetch import pending

    layers, log = mode.units[:-1], []

    def forward_mark(i):
        def hook(module, args):
            if i + 1 < len(layers):
                log.append(("forward", i, pending(layers[i + 1])))
        return hook

    def mlp_mark(i):
        def hook(module, args, out):
            if out.requires_grad and i > 0:  # its gradient: layer i's backward starts
                out.register_hook(lambda g: log.append(("backward", i, pending(layers[i - 1]))))
        return hook

    for i, layer in enumerate(layers):
        layer.input_layernorm.register_forward_pre_hook(forward_mark(i))
        layer.mlp.register_forward_hook(mlp_mark(i))
    return log


def observe(rank, world, over):
    """One step with the markers: their counts by (pass, prefetched) and the step's
    all-gathers."""
    from experiments.comm_count import CommCounter
    from tests.test_sharding import _step, _worker

    cfg = load_config(None, over)
    w = _worker(cfg, rank, world)
    log = install_markers(w.core.sharding)
    counter = CommCounter()
    with counter:
        _step(w, cfg, 0, rank, world)
    counts = {}
    for kind, _, ahead in log:
        counts[kind, ahead] = counts.get((kind, ahead), 0) + 1
    ops = [op for op, _, _ in counter.calls]
    return {"marks": counts, "all_gathers": ops.count("all_gather_single"),
            "reduce_scatters": ops.count("reduce_scatter_single")}


def run_cases(rank, world, cases, observed):
    torch.set_num_threads(1)
    return ([record(rank, world, case_overrides(*case)) for case in cases],
            [observe(rank, world, case_overrides(*case)) for case in observed])


def one_process(case):
    threads = torch.get_num_threads()
    try:
        over = [o for o in case_overrides(*case, prefetch=False)
                if not o.startswith("train.shard_size=")]  # one process: nothing to shard
        return record(0, 1, over, counted=False)
    finally:
        torch.set_num_threads(threads)


def check(cases, world, results):
    for i, case in enumerate(cases):
        ranks = [results[r][0][i] for r in range(world)]
        worst = assert_matches(ranks, one_process(case), f"fsdp+prefetch {case} on {world}")
        assert all(r["layout"].prefetch for r in ranks)
        print(f"fsdp+prefetch {case} on {world} ranks: worst relative error vs one process "
              f"{ {k: f'{v:.2g}' for k, v in worst.items()} }")


def check_issued(observed, results, world):
    """``observed``: (policy, extra, prefetch) cases run by :func:`observe`."""
    by = {}
    for j, (policy, extra, ahead) in enumerate(observed):
        for r in range(world):
            got = results[r][1][j]
            marks = got["marks"]
            forward = marks.get(("forward", True), 0) + marks.get(("forward", False), 0)
            backward = marks.get(("backward", True), 0) + marks.get(("backward", False), 0)
            assert forward > 0 and backward > 0, marks
            # prefetched: every layer's next gather issued before it computes; else none
            assert marks.get(("forward", ahead), 0) == forward, (policy, ahead, marks)
            back = ahead and policy == "recompute"  # the planner's passes (retain: forward)
            assert marks.get(("backward", back), 0) == backward, (policy, ahead, marks)
            by.setdefault((policy, tuple(extra)), {})[ahead, r] = got
    for key, got in by.items():  # as many gathers and reduce-scatters as without prefetch
        for r in range(world):
            on, off = got[True, r], got[False, r]
            assert on["all_gathers"] == off["all_gathers"] > 0, (key, on, off)
            assert on["reduce_scatters"] == off["reduce_scatters"], (key, on, off)
        print(f"{key} rank 0: markers {got[True, 0]['marks']} with prefetch, "
              f"{got[False, 0]['marks']} without; all-gathers {got[True, 0]['all_gathers']}")


FAST = [("recompute", BLOCK)]
OBSERVED = [("recompute", BLOCK, True), ("recompute", BLOCK, False)]


def test_prefetch_on_two_ranks_equals_one_process_and_is_issued():
    results = run_ranks(run_cases, 2, FAST, OBSERVED, timeout=900.0)
    check(FAST, 2, results)
    check_issued(OBSERVED, results, 2)


@pytest.mark.slow
def test_prefetch_retain_and_packs_on_two_ranks():
    """Exact on branched batches (packs of several nodes) under both policies; issued along
    a 4-layer chain (the "small" Qwen3 size) under recompute, and under retain."""
    cases = [("retain", BLOCK), ("retain", SMALL), ("recompute", SMALL)]
    deep = ["model.size=small"] + BLOCK
    observed = [("retain", SMALL, True), ("retain", SMALL, False), ("recompute", deep, True),
                ("recompute", deep, False)]
    results = run_ranks(run_cases, 2, cases, observed, timeout=1800.0)
    check(cases, 2, results)
    check_issued(observed, results, 2)


HSDP = ["train.shard_size=2"]


@pytest.mark.slow
def test_prefetch_on_four_ranks_both_policies_and_hsdp():
    """4 ranks, both policies; and HSDP 2 x 2 (the gathers inside the shard groups, the
    replicas summed once per step: tests/test_hsdp.py's traffic check)."""
    from tests.test_hsdp import check_hsdp_traffic

    cases = [("recompute", BLOCK), ("retain", BLOCK), ("recompute", BLOCK + HSDP)]
    results = run_ranks(run_cases, 4, cases, [], timeout=1800.0)
    check(cases, 4, results)
    check_hsdp_traffic([results[r][0][2] for r in range(4)], "fsdp+prefetch HSDP 2 x 2")


def _ep_on_ranks(rank, world, cases):
    """tests/test_expert_parallel.py's ranks, with prefetch (its one process: without)."""
    import tests.test_expert_parallel as ep

    base = ep.overrides
    ep.overrides = lambda *a, **k: base(*a, **k) + ON
    try:
        return ep.on_ranks(rank, world, cases)
    finally:
        ep.overrides = base


@pytest.mark.slow
def test_prefetch_with_expert_parallelism_under_retain():
    """fsdp + prefetch with E = 2 under retain (Mixtral, float64): a B round's forward
    without a forward follows the prefetched order -- layer i + 1's gather before layer i's
    expert exchanges -- or the ranks' gloo collectives would not match; equal to one process
    (tests/test_expert_parallel.py's checks, <= 1e-10)."""
    from tests.test_expert_parallel import compare
    from tests.test_expert_parallel import one_process as ep_one_process

    cases = [("mixtral", "retain", 8, 2, "fsdp", 1)]
    results = run_ranks(_ep_on_ranks, 2, cases, timeout=900.0)
    for i, case in enumerate(cases):
        ranks = [results[r][i] for r in range(2)]
        err = compare(case, ranks, ep_one_process(case))
        lock = ranks[0]["lockstep"]
        assert lock["B"] > 0 and lock["mixed_backwards"] > 0, lock  # forward_steps ran
        print(f"{case} + prefetch: worst relative error {err:.2g}, lockstep {lock}")


def test_a_prefetched_gather_left_unused_is_refused():
    """A walk's end with a unit holding an issued, unused gather (a decoder call that
    skipped its layers) is an error, not a stale weight served after the update."""
    results = run_ranks(_unused, 2, timeout=300.0)
    for msg in results:
        assert "layer 1" in msg and "never used" in msg, msg


def _unused(rank, world):
    from tests.test_sharding import _worker

    torch.set_num_threads(1)
    w = _worker(load_config(None, case_overrides("recompute")), rank, world)
    mode = w.core.sharding
    mode.units[1].unshard(async_op=True)  # issued, never waited for nor used
    try:
        mode.release_gathered()
    except RuntimeError as exc:
        return str(exc)
    return "not refused"


def test_the_plan_and_the_run_report_say_which_calls_prefetch_overlaps(capsys):
    """`dta plan --memory --prefetch on` names the passes it priced as overlapped; a run's
    settings record (``dta train --json``'s settings) names what its prefetch overlaps: the
    forward of every call, the backward too under recompute (the planner's same passes)."""
    from dta_cli.main import main
    from tests.workers import settings_for

    assert main(["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "8",
                 "--memory", "--model", "qwen3-14b", "--budget-gib", "80", "--sharding",
                 "fsdp", "--prefetch", "on"]) == 0
    out = capsys.readouterr().out
    assert "prefetch assumed overlapped: the forward all-gathers of " in out, out
    said = {}
    for policy in ("recompute", "retain"):
        for ahead in (True, False):
            cfg = load_config(None, case_overrides(policy, prefetch=ahead))
            said[policy, ahead] = settings_for(cfg, 2).record().get("prefetch_overlaps")
    assert said["recompute", False] is None and said["retain", False] is None
    assert said["recompute", True].startswith("the forward of every decoder call and the "
                                              "backward of every call with gradient")
    assert "backward is not prefetched" in said["retain", True]


def test_prefetch_is_refused_outside_fsdp():
    """zero1 / zero2 / replicate gather no layer per call: prefetch=true is a one-line error
    naming the key."""
    from runtime.engine import ParallelLayout
    from runtime.errors import LayoutError

    for mode in ("zero1", "zero2", "replicate"):
        with pytest.raises(LayoutError, match="train.prefetch.*fsdp gathers per layer"):
            ParallelLayout.make(world=2, sharding=mode, prefetch=True,
                                spelling={"prefetch": "train.prefetch"})
    assert ParallelLayout.make(world=2, sharding="fsdp", prefetch=True).prefetch


def _bytes_on_ranks(rank, world, cases):
    """tests/test_planning_runtime.py's ranks (tiny Qwen3-MoE, bf16), with prefetch."""
    import tests.test_planning_runtime as pr

    base = pr.overrides
    pr.overrides = lambda *a, **k: base(*a, **k) + ON
    try:
        return pr.runtime_bytes(rank, world, cases)
    finally:
        pr.overrides = base


@pytest.mark.slow
def test_planner_prices_the_prefetched_layer_as_the_runtime_holds_it():
    """fsdp + prefetch on 2 ranks (without and with expert parallelism, offloaded): the
    runtime's state_bytes() params -- the gathered layer and the issued gather of the next
    -- equal the planner's (model_state(..., prefetch=True)) byte for byte, one gathered
    layer more than without prefetch."""
    from dta.planning.memory import ModelShape, model_state
    from tests.test_planning_runtime import C, _tiny

    cases = [("fsdp", 1, 2, "none"), ("fsdp", 2, 2, "optimizer")]
    results = run_ranks(_bytes_on_ranks, 2, cases, timeout=900.0)
    shape = ModelShape.of(_tiny().config)
    for i, (mode, E, S, offload) in enumerate(cases):
        sb = results[0][i]["state_bytes"]
        kw = dict(compute_bytes=C, expert_parallel=E, shard_size=S, offload=offload)
        want = model_state(shape, 2, mode, prefetch=True, **kw)
        without = model_state(shape, 2, mode, **kw)
        assert sb["params"] == want["params"] > without["params"], (E, offload, sb, want)
        print(f"fsdp + prefetch E={E} offload={offload}: runtime params {sb['params']}, "
              f"planner {want['params']} (without prefetch {without['params']})")

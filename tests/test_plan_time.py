"""The planner's time model (dta.planning.timing, dta.planning.cp, dta.planning.work): per-rank
FLOPs, bytes sent and modeled step time add up and follow the tree, the split context-parallel
scheme divides the FLOPs by C (what it does not divide is stated and checked), its exchange
does not grow with the path, the replicated scheme gives the issue's efficiencies, and
plan_memory chooses by modeled throughput, not by the first fit."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dta.options import WalkOptions
from dta.planning import build_tree
from dta.planning.cost import CostModel, features
from dta.planning.cp import RECOMPUTE_FACTOR, HeadSplit
from dta.planning.memory import GIB, SHAPES, ModelShape, estimate, plan_memory
from dta.planning.timing import PEAK_TFLOPS, Hardware, Pricer, sharding_traffic

SIZES = (1, 2, 4, 8)
WALK = WalkOptions()  # the walk's default packing settings


def rollouts(n: int, prompt: int, own: int, seed: int = 0):
    """n sequences of ``own`` tokens each on one ``prompt``-token prompt, as a prefix tree."""
    rng = np.random.default_rng(seed)
    p = rng.integers(3, 150_000, prompt)
    return build_tree([np.concatenate([p, rng.integers(3, 150_000, own)]) for _ in range(n)])


@pytest.fixture(scope="module")
def long128k():  # the issue's batch: four rollouts of 120,000 tokens on an 8,192-token prompt
    return rollouts(4, 8192, 120_000)


def priced(name, world, tree, *, C, mode="zero1", policy="recompute", block=2048,
           scheme="split", hardware=None):
    est = estimate(SHAPES[name], world, mode, path_tokens=int(max(tree.lengths)),
                   call_tokens=block or int(max(tree.lengths)), policy=policy,
                   block_tokens=block, context_parallel=C, cp_scheme=scheme)
    return Pricer(SHAPES[name], tree, hardware, walk=WALK).price(est).time


def test_flops_follow_the_tree_and_split_divides_them_by_c():
    """C = 1's FLOPs are the cost model's on the group's tree (x 4/3 under recompute); at C
    ranks (one group: world = C) the split scheme's per-rank FLOPs are C = 1's / C exactly
    when C divides every call (nodes of 4 and 60 blocks of 2,048) and the KV heads."""
    tree = rollouts(4, 8192, 60 * 2048)
    cost = CostModel.from_config(SHAPES["qwen3-8b"])
    u, a = features(tree, np.arange(4))
    one = priced("qwen3-8b", 1, tree, C=1)
    assert one.flops_per_rank == pytest.approx(RECOMPUTE_FACTOR * (cost.token * u + cost.attention * a),
                                               rel=1e-12)
    assert one.tokens == u and one.group_efficiency == 1.0
    retain = priced("qwen3-8b", 1, tree, C=1, policy="retain")
    assert retain.flops_per_rank * RECOMPUTE_FACTOR == pytest.approx(one.flops_per_rank, rel=1e-12)
    for C in (2, 4, 8):  # 2,048-token blocks and 8 KV heads: nothing left undivided
        t = priced("qwen3-8b", C, tree, C=C)
        assert t.calls == 4 * 60 + 4 and t.flops_alone == pytest.approx(one.flops_per_rank, rel=1e-12)
        assert t.flops_per_rank == pytest.approx(one.flops_per_rank / C, rel=1e-12)
        assert abs(t.flops_undivided) <= 1e-9 * t.flops_per_rank
        assert t.group_efficiency == pytest.approx(1.0, rel=1e-12)


def test_what_split_does_not_divide_is_the_rounding():
    """Calls of odd lengths: each rank takes ceil(T / C) rows; the undivided FLOPs are
    exactly those extra rows' linear work (counted here from the tree's node lengths)."""
    tree = rollouts(3, 1001, 3333)
    cost = CostModel.from_config(SHAPES["qwen3-8b"])
    for C in (2, 4, 8):
        t = priced("qwen3-8b", C, tree, C=C, policy="retain", block=1000)
        seg = np.asarray([tree.length(u) for u in range(1, len(tree))])
        k = -(-seg // 1000)
        pieces = np.concatenate([np.full(kk, n // kk) + (np.arange(kk) < n % kk)
                                 for n, kk in zip(seg, k)])
        assert t.calls == len(pieces) and pieces.max() <= 1000
        extra = cost.token * float(np.sum(-(-pieces // C) - pieces / C))
        assert extra > 0 and t.flops_undivided == pytest.approx(extra, rel=1e-9)
        assert 0.99 < t.group_efficiency < 1.0


def test_heads_beyond_the_kv_heads_split_rows():
    shape = ModelShape.of(SHAPES["qwen3-8b"])  # 32 query heads, 8 KV heads
    assert HeadSplit.of(shape, 4) == HeadSplit(2, 8, 1)
    assert HeadSplit.of(shape, 3) == HeadSplit(3, 12, 1)  # uneven: the most loaded rank
    assert HeadSplit.of(shape, 16) == HeadSplit(1, 4, 2)  # two ranks per KV head
    assert HeadSplit.of(shape, 16).attention_share(shape) == 1 / 16
    kw = dict(path_tokens=100_000, call_tokens=2048, policy="recompute", block_tokens=2048)
    one = estimate(SHAPES["qwen3-8b"], 16, "fsdp", **kw)
    sixteen = estimate(SHAPES["qwen3-8b"], 16, "fsdp", context_parallel=16, **kw)
    assert sixteen.split["path_kv"] == pytest.approx(one.split["path_kv"] / 16, rel=1e-4)


def test_figures_add_up_and_follow_the_hardware(long128k):
    hw = Hardware(peak_tflops=500.0, utilization=0.5, intra_node_gbs=100.0,
                  inter_node_gbs=10.0, gpus_per_node=4, latency_us=0.0)
    t = priced("qwen3-8b", 8, long128k, C=4, mode="zero1", hardware=hw)
    assert t.compute_s == pytest.approx(t.flops_per_rank / (500e12 * 0.5), rel=1e-12)
    assert t.cp_s == pytest.approx(t.cp_bytes / 100e9, rel=1e-12)  # a group of 4: one node
    assert t.sharding_s == pytest.approx(t.sharding_bytes / 10e9, rel=1e-12)  # 8 ranks: two
    assert t.bytes_sent == t.cp_bytes + t.sharding_bytes
    assert t.step_s == pytest.approx(t.compute_s + t.cp_s + t.sharding_s, rel=1e-12)
    assert t.tokens_per_s * t.step_s == pytest.approx(4 * 128_192, rel=1e-12)
    default = Hardware()
    assert default.flop_rate("bfloat16") == PEAK_TFLOPS["bfloat16"] * 1e12 * 0.4
    assert default.flop_rate("float32") < default.flop_rate("bfloat16")
    for bad in (dict(utilization=0), dict(utilization=1.5), dict(intra_node_gbs=-1),
                dict(gpus_per_node=0), dict(latency_us=-1), dict(peak_tflops=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Hardware(**bad)


def test_sharding_traffic_by_mode():
    shape = ModelShape.of(SHAPES["qwen3-8b"])
    N, V, f = shape.params, shape.vocab_params, 7 / 8
    assert sharding_traffic("replicate", 1, shape, "retain", 10, 2) == (0.0, 0)
    assert sharding_traffic("replicate", 8, shape, "retain", 10, 2)[0] == pytest.approx(2 * f * N * 2)
    assert sharding_traffic("zero1", 8, shape, "retain", 10, 2)[0] == pytest.approx(f * N * 6)
    fsdp10 = sharding_traffic("fsdp", 8, shape, "recompute", 10, 2)[0]
    fsdp20 = sharding_traffic("fsdp", 8, shape, "recompute", 20, 2)[0]
    assert fsdp20 - fsdp10 == pytest.approx(10 * f * (N - V) * (3 * 2 + 4))  # per call
    assert sharding_traffic("fsdp", 8, shape, "retain", 10, 2)[0] < fsdp10  # 2 gathers, not 3
    lora = sharding_traffic("zero1", 8, shape, "retain", 10, 2, adapter_params=1000)[0]
    assert lora == pytest.approx(f * 1000 * 6)


def test_split_exchange_follows_the_tokens_not_the_path():
    """Two batches walking the same tokens in the same calls, paths of 5,120 and 3,072
    tokens: the split scheme sends the same bytes; the attention FLOPs grow with the path."""
    longer, shorter = rollouts(2, 1024, 4096), rollouts(4, 1024, 2048)
    for C in (2, 4):
        a = priced("qwen3-8b", C, longer, C=C, block=1024)
        b = priced("qwen3-8b", C, shorter, C=C, block=1024)
        assert a.tokens == b.tokens and a.calls == b.calls
        assert a.cp_bytes == b.cp_bytes > 0
        assert a.flops_per_rank > b.flops_per_rank


def test_calls_are_the_walkers_packs():
    """Each group's calls are planned as the walker plans them (dta.walk.Walker.plan: blocks,
    then packs under the walk's packing and the cap by memory policy), and the groups are
    the runtime's balance over data-parallel groups."""
    from dta.model.models import build_model
    from dta.planning.work import Workload
    from dta.planning.workers import assign_workers
    from dta.walk import Walker

    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 100, 40)
    seqs = [np.concatenate([prompt, rng.integers(3, 100, n)]) for n in (100, 7, 30, 64, 5, 250)]
    tree = build_tree(seqs)
    work = Workload(tree, model.config, WalkOptions())
    for policy, block in (("recompute", 32), ("retain", 0), ("retain", 16), ("recompute", 0)):
        walker = Walker(model, WalkOptions(policy=policy, block_tokens=block))
        want = sorted(p.tokens for p in walker.plan(tree).packs)
        (got,) = work.calls(1, block or None, policy)
        assert sorted(got.lengths.tolist()) == want and got.tokens == tree.stats().unique_tokens
    groups = assign_workers(tree, 2, work.cost).workers
    two = work.calls(2, 32, "recompute")
    for ids, calls in zip(groups, two):
        sub = build_tree([seqs[i] for i in ids])
        want = sorted(p.tokens for p in Walker(model, WalkOptions(
            policy="recompute", block_tokens=32)).plan(sub).packs)
        assert sorted(calls.lengths.tolist()) == want


@pytest.mark.parametrize("name, world, C, issue", [("qwen3-8b", 8, 2, 0.78),
                                                   ("qwen3-14b", 8, 4, 0.50),
                                                   ("qwen3-32b", 16, 8, 0.31)])
def test_replicated_scheme_gives_the_issues_efficiency(long128k, name, world, C, issue):
    """The round-4 scheme (the whole call on every rank, only the path's attention divided) at
    the issue's choices: its group efficiency (0.78 / 0.50 / 0.31 by the issue's count of all
    attention as divided; here each call's attention to its own keys stays on every rank)."""
    rep = priced(name, world, long128k, C=C, mode="fsdp", scheme="replicated")
    split = priced(name, world, long128k, C=C, mode="fsdp")
    assert issue - 0.02 < rep.group_efficiency < issue
    assert 0.998 < split.group_efficiency <= 1.0  # calls of 2,033-2,048 rows: ceil(T / C)
    assert split.flops_per_rank < rep.flops_per_rank
    assert rep.flops_alone == pytest.approx(split.flops_alone, rel=1e-12)


def test_choice_is_by_modeled_throughput_not_the_first_fit(long128k):
    """The issue's batch on Qwen3-8B, 8 x 80 GB: the memory order's first fit (the smallest
    C, modes by communication) is not the fastest; with the tree, plan_memory chooses the
    shortest modeled step among everything that fits."""
    kw = dict(context_parallel=SIZES)
    timed = plan_memory(SHAPES["qwen3-8b"], 8, 80 * GIB, tree=long128k, walk=WALK, **kw)
    first = plan_memory(SHAPES["qwen3-8b"], 8, 80 * GIB, path_tokens=128_192,
                        call_tokens=120_000, **kw)
    assert timed.rule == "throughput" and first.rule == "memory"
    assert timed.hardware["peak_tflops"] == PEAK_TFLOPS["bfloat16"]
    fits = [e for e in timed.tried if e.total <= timed.budget]
    assert all(e.time is not None for e in timed.tried)
    assert timed.chosen.time.step_s == min(e.time.step_s for e in fits)
    same = [e for e in fits if (e.label(), e.data_parallel) ==
            (first.chosen.label(), first.chosen.data_parallel)]
    assert len(same) == 1 and same[0].time.step_s > 1.05 * timed.chosen.time.step_s
    assert timed.chosen.label() != first.chosen.label()


def test_idle_groups_make_context_parallel_faster_than_data_parallel():
    """Four sequences on 8 GPUs: C = 1 fits (the memory order takes it) but leaves half of
    the 8 data-parallel groups idle; the time model gives the work to groups of C > 1."""
    tree = rollouts(4, 2048, 16_384)
    timed = plan_memory(SHAPES["qwen3-8b"], 8, 80 * GIB, tree=tree, walk=WALK,
                        context_parallel=SIZES,
                        policies=("recompute",), blocks=(2048,))
    by_c = {e.context_parallel: e for e in timed.tried if e.sharding == "zero1"}
    assert all(e.total <= timed.budget for e in by_c.values())
    assert by_c[1].time.step_s > by_c[2].time.step_s  # 4 of 8 groups idle at C = 1
    assert math.isclose(by_c[1].time.flops_per_rank, by_c[2].time.flops_per_rank * 2, rel_tol=1e-9)
    assert timed.chosen.context_parallel > 1


def test_plan_memory_keeps_its_signature_and_derives_the_extent_from_the_tree():
    tree = rollouts(2, 512, 1024)
    a = plan_memory(SHAPES["qwen3-8b"], 2, 80 * GIB, tree=tree, walk=WALK)
    b = plan_memory(SHAPES["qwen3-8b"], 2, 80 * GIB, tree=tree, walk=WALK, path_tokens=1536,
                    call_tokens=1024)
    assert a.chosen.label() == b.chosen.label() and a.chosen.time.step_s == b.chosen.time.step_s
    with pytest.raises(ValueError, match="path_tokens and call_tokens, or the batch's tree"):
        plan_memory(SHAPES["qwen3-8b"], 2, 80 * GIB)
    with pytest.raises(ValueError, match="needs walk="):
        plan_memory(SHAPES["qwen3-8b"], 2, 80 * GIB, tree=tree)
    with pytest.raises(ValueError, match="context-parallel scheme"):
        plan_memory(SHAPES["qwen3-8b"], 2, 80 * GIB, tree=tree, walk=WALK, cp_schemes=("ring",))


def test_dta_plan_prints_the_rates_and_takes_them_as_flags(capsys):
    """`dta plan --memory` states the rates it priced at (the defaults, or the flags), and
    the modeled step follows them: compute at a quarter of the FLOP rate takes 4x."""
    from dta_cli.main import main

    args = ["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "8",
            "--memory", "--model", "qwen3-8b", "--budget-gib", "80", "--context-parallel", "2",
            "--policy", "recompute", "--block-tokens", "256", "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    base = json.loads(out.strip().splitlines()[-1])["memory"]
    assert base["hardware"] == {**Hardware().as_dict("bfloat16")}
    assert "989 TFLOP/s peak x 0.4 (bfloat16)" in out and "450 GB/s in a node" in out
    assert main(args + ["--utilization", "0.1", "--intra-node-gbs", "45", "--latency-us",
                        "0", "--peak-tflops", "989"]) == 0
    out = capsys.readouterr().out
    slow = json.loads(out.strip().splitlines()[-1])["memory"]
    assert "989 TFLOP/s peak x 0.1 (bfloat16)" in out and "45 GB/s in a node" in out
    assert slow["hardware"]["utilization"] == 0.1 and slow["hardware"]["latency_us"] == 0
    assert slow["choice"] == base["choice"]  # one candidate per mode here; zero1 both times
    t0, t1 = base["time"], slow["time"]
    assert t1["flops_per_rank"] == t0["flops_per_rank"] and t1["bytes_sent"] == t0["bytes_sent"]
    assert t1["compute_s"] == pytest.approx(4 * t0["compute_s"])
    assert t1["cp_s"] == pytest.approx(10 * t0["cp_bytes"] / 450e9)
    assert main(args + ["--utilization", "1.5"]) == 2
    assert "utilization must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_dta_plan_prices_the_replicated_scheme_when_asked(capsys):
    from dta_cli.main import main

    args = ["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "4",
            "--memory", "--model", "qwen3-8b", "--budget-gib", "80", "--context-parallel", "4",
            "--json", "--context-parallel-scheme"]
    got = {}
    for scheme in ("split", "replicated"):
        assert main(args + [scheme]) == 0
        got[scheme] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
        assert got[scheme]["cp_scheme"] == scheme
        assert {c["cp_scheme"] for c in got[scheme]["candidates"]} == {scheme}
    assert got["replicated"]["group_efficiency"] < 0.5 < got["split"]["group_efficiency"]

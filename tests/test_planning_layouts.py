"""Issue 53's layouts priced (docs/planning.md, "Holding the weights across a step's calls"):
zero2's memory from the shapes, node residency's bytes across the nodes independent of the
calls, prefetch never below max(compute, communication), the host budget refusing what
does not fit it, and the planner choosing zero2 / node residency where they are the fastest
that fit."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dta.options import WalkOptions
from dta.planning import build_tree
from dta.planning.memory import GIB, SHAPES, SHARDINGS, ModelShape, estimate, plan_memory
from dta.planning.state import LAYOUT_KNOBS, layout_choices, model_state
from dta.planning.timing import Hardware, Pricer

WALK = WalkOptions()


def rollouts(n: int, prompt: int, length: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    p = rng.integers(3, 150_000, prompt)
    return build_tree([np.concatenate([p, rng.integers(3, 150_000, length)]) for _ in range(n)])


@pytest.mark.parametrize("name, W", [("qwen3-8b", 8), ("qwen3-14b", 16), ("llama-70b", 32)])
def test_zero2_holds_2p_plus_16p_over_n(name, W):
    """zero2 (runtime.sharding.zero2: FSDP2 keeping what it gathers) = every decoder layer
    gathered in bf16 all step with the vocabulary weights whole (2P, less the final norm),
    the fp32 shards -- masters, gradient shard, two AdamW states (16P/N) -- and fsdp's
    vocabulary handling (its bf16 gradient and fp32 reduction, 6V) and one layer's gradient
    until its reduce-scatter, computed from the shapes; zero1 holds the whole bf16 gradient
    instead (2P)."""
    shape = ModelShape.of(SHAPES[name])
    P, V, L, h = shape.params, shape.vocab_params, shape.layer_params, shape.hidden
    z2 = model_state(shape, W, "zero2", compute_bytes=2)
    z1 = model_state(shape, W, "zero1", compute_bytes=2)
    fsdp = model_state(shape, W, "fsdp", compute_bytes=2)
    state = z2["params"] + z2["grads"] + z2["optimizer"]
    body, v = math.ceil((P - V) / W), math.ceil(V / W)
    assert state == 2 * (P - h) + 16 * body + 12 * v + 6 * V + 2 * L
    assert 2 * P + 16 * P / W <= state <= 2 * P + 16 * P / W + 6 * V + 2 * L
    assert z2["grads"] == fsdp["grads"] and z2["optimizer"] == fsdp["optimizer"]
    assert z2["params"] - fsdp["params"] == 2 * (P - V - h - L)  # every layer, not one
    assert state < z1["params"] + z1["grads"] + z1["optimizer"] - P  # zero1: 4P + 16P/N
    off = model_state(shape, W, "zero2", compute_bytes=2, offload="optimizer")
    assert off["params"] == 2 * (P - h) + 2 * body and off["optimizer"] == 0
    assert off["host"] == 16 * (body + v)  # fp32 masters, two states, the gradient buffer
    assert off["steps"] == 4 * shape.tensors > 0


def test_offload_keeps_compute_dtype_shards_only():
    """Offloaded fsdp keeps its layer shards in bf16 (they were fp32): Llama-70B's state in a
    node's shard group of 8 is the bf16 shards, the fp32 gradient shard and the
    vocabulary's, no masters, no optimizer."""
    shape = ModelShape.of(SHAPES["llama-70b"])
    V, L = shape.vocab_params, shape.layer_params
    body = math.ceil((shape.params - V) / 8)
    off = model_state(shape, 16, "fsdp", compute_bytes=2, shard_size=8, offload="optimizer")
    assert off["params"] == body * 2 + V * 2 + L * 2
    assert off["grads"] == body * 4 + V * 2 + V * 4 + L * 2
    assert off["optimizer"] == 0 and off["host"] == 16 * (body + math.ceil(V / 8))


def test_node_resident_bytes_across_nodes_do_not_grow_with_the_calls():
    """Qwen3-14B on 16 GPUs (two nodes): fsdp sharded over the world sends every call's
    gathers across the nodes; node-resident (hpZ, the node of 8) crosses them once a step --
    the same bytes across nodes at 8,192-token blocks and at 1,024 (8x the calls)."""
    tree = rollouts(4, 2048, 16_384)
    pricer = Pricer(SHAPES["qwen3-14b"], tree, walk=WALK)
    kw = dict(path_tokens=2048 + 16_384, call_tokens=16_384, policy="recompute",
              context_parallel=8)
    got = {}
    for block in (8192, 1024):
        for label, layout in (("fsdp", {}), ("hpz", dict(shard_size=8, node_resident=True))):
            t = pricer.price(estimate(SHAPES["qwen3-14b"], 16, "fsdp", block_tokens=block,
                                      **layout, **kw)).time
            got[label, block] = t
            assert t.bytes_sent == pytest.approx(t.intra_bytes + t.inter_bytes)
    few, many = got["hpz", 8192], got["hpz", 1024]
    assert many.calls >= 4 * few.calls
    assert many.inter_bytes == pytest.approx(few.inter_bytes) and few.inter_bytes > 0
    assert many.intra_bytes > 3 * few.intra_bytes  # the per-call gathers, inside the node
    plain_few, plain_many = got["fsdp", 8192], got["fsdp", 1024]
    assert plain_many.inter_bytes > 3 * plain_few.inter_bytes  # grows with the calls
    assert plain_few.intra_bytes == plain_few.cp_bytes  # only the CP group of 8 in a node
    assert plain_few.inter_bytes > 10 * few.inter_bytes
    assert many.step_s < plain_many.step_s


@pytest.mark.parametrize("policy", ["recompute", "retain"])
@pytest.mark.parametrize("name, W, S", [("qwen3-32b", 16, 16), ("qwen3-14b", 8, 8),
                                        ("qwen3-8b", 16, 8)])
def test_prefetch_is_never_below_max_of_compute_and_communication(name, W, S, policy):
    tree = rollouts(4, 2048, 8192, seed=1)
    pricer = Pricer(SHAPES[name], tree, walk=WALK)
    kw = dict(path_tokens=2048 + 8192, call_tokens=8192, policy=policy, block_tokens=2048,
              context_parallel=8, shard_size=S)
    plain = pricer.price(estimate(SHAPES[name], W, "fsdp", **kw)).time
    ahead = pricer.price(estimate(SHAPES[name], W, "fsdp", prefetch=True, **kw)).time
    comm = ahead.cp_s + ahead.sharding_s + ahead.replica_s + ahead.ep_s + ahead.host_s
    assert ahead.step_s >= max(ahead.compute_s, comm) - 1e-9
    assert ahead.step_s >= max(ahead.compute_s, ahead.sharding_s)
    assert 0 < ahead.overlap_s <= min(ahead.compute_s, ahead.sharding_s)
    assert ahead.step_s == pytest.approx(plain.step_s - ahead.overlap_s)
    assert plain.overlap_s == 0 and plain.overlapped == ""
    passes = {"recompute": "forward and re-forward and backward", "retain": "forward"}[policy]
    assert ahead.overlapped == f"{passes} all-gathers of {ahead.calls} calls"
    # one more gathered layer on the device
    a = estimate(SHAPES[name], W, "fsdp", prefetch=True, **kw)
    b = estimate(SHAPES[name], W, "fsdp", **kw)
    assert a.params - b.params == ModelShape.of(SHAPES[name]).layer_params * 2


def test_host_budget_refuses_what_it_cannot_hold(capsys):
    """Qwen3-32B on one node of 80 GB fits only with the optimizer offloaded (61 GiB of host
    memory per rank): a 32 GiB host budget refuses it, with the reason."""


    tree = rollouts(4, 8192, 32_768)
    kw = dict(tree=tree, walk=WALK, context_parallel=(8,), policies=("recompute",),
              blocks=(8192,), offload=("none", "optimizer"))
    free = plan_memory(SHAPES["qwen3-32b"], 8, 80 * GIB, **kw)
    assert free.chosen is not None and free.chosen.offload == "optimizer"
    assert free.chosen.host > 32 * GIB
    tight = plan_memory(SHAPES["qwen3-32b"], 8, 80 * GIB, host_budget_bytes=32 * GIB, **kw)
    assert tight.chosen is None
    assert "32.00 GiB of host memory" in tight.message()
    refused = [e for e in tight.tried if e.offload == "optimizer"]
    assert refused and all("host budget" in e.refused for e in refused)
    assert all(e.refused.startswith("device:") for e in tight.tried if e.offload == "none")
    with pytest.raises(ValueError, match="host memory"):
        from runtime.engine.auto import price

        price(SHAPES["qwen3-32b"], world=8, budget_bytes=80 * GIB, tree=tree, walk=WALK,
              context_parallel=(8,), blocks=(8192,), compute_dtype="bfloat16",
              offload=("none", "optimizer"), host_budget_bytes=32 * GIB)


def test_the_planner_picks_zero2_and_node_residency_where_fastest_and_fitting():
    """zero2: Qwen3-8B on 16 GPUs under 56 GiB, retain -- zero1's whole bf16 gradient does
    not fit, zero2 does and sends less than fsdp (whose backward gathers prefetch cannot hide
    under retain); node residency: Qwen3-14B on 16 GPUs at 32K (the planning table's row).
    Each the shortest modeled step among the candidates that fit."""
    tree = rollouts(4, 2048, 16_384, seed=2)
    shape = ModelShape.of(SHAPES["qwen3-8b"])
    plan = plan_memory(SHAPES["qwen3-8b"], 16, 56 * GIB, tree=tree, walk=WALK,
                       context_parallel=(8,), policies=("retain",), blocks=(8192,),
                       **layout_choices(shape, 16, 8))
    assert plan.chosen.sharding == "zero2", plan.chosen.label()
    fits = [e for e in plan.tried if not e.refused]
    assert plan.chosen.time.step_s == min(e.time.step_s for e in fits)
    zero1 = [e for e in plan.tried if e.sharding == "zero1"]  # fits only offloaded (slower)
    assert all(e.refused.startswith("device:") for e in zero1 if e.offload == "none")
    assert all(e.time.host_s > 0 for e in zero1 if not e.refused)
    assert all(e.time.step_s > plan.chosen.time.step_s for e in fits if e.sharding == "fsdp")
    from runtime.engine.auto import price

    priced = price(SHAPES["qwen3-8b"], world=16, budget_bytes=56 * GIB, tree=tree,
                   walk=WALK.replace(policy="retain"), context_parallel=(8,), blocks=(8192,),
                   compute_dtype="bfloat16", **layout_choices(shape, 16, 8))
    assert (priced.sharding, priced.shard_size) == ("zero2", 8)

    tree = rollouts(4, 8192, 32_768 - 8192)
    shape = ModelShape.of(SHAPES["qwen3-14b"])
    plan = plan_memory(SHAPES["qwen3-14b"], 16, 80 * GIB, tree=tree, walk=WALK,
                       context_parallel=(8,), **layout_choices(shape, 16, 8))
    c = plan.chosen
    assert c.node_resident and c.shard_size == 8 and "/node-resident" in c.label(), c.label()
    fits = [e for e in plan.tried if not e.refused]
    assert c.time.step_s == min(e.time.step_s for e in fits)
    # the same candidate as plain HSDP: more memory (the masters over 8, not 16)
    twin = [e for e in plan.tried if not e.node_resident and e.shard_size == 8
            and (e.sharding, e.policy, e.block_tokens, e.prefetch, e.offload) ==
            (c.sharding, c.policy, c.block_tokens, c.prefetch, c.offload)]
    assert twin and twin[0].total > c.total


def test_layout_choices_are_the_one_list():
    shape = ModelShape.of(SHAPES["qwen3-30b-a3b"])
    every = layout_choices(shape, 16, 8)
    assert tuple(every) == LAYOUT_KNOBS
    assert every["shard_size"] == (None, 8) and every["node_resident"] == (False, True)
    assert every["offload"] == ("none", "optimizer", "gradients") \
        and every["prefetch"] == (False, True)
    assert 8 in every["expert_parallel"] and 16 in every["expert_parallel"]
    assert layout_choices(shape, 16, 8, offload=("none",))["offload"] == ("none",)
    assert "zero2" in SHARDINGS
    with pytest.raises(ValueError, match="unknown layout knob"):
        layout_choices(shape, 16, 8, offlaod=("none",))
    for bad, match in ((dict(node_resident=True), "node_resident needs a shard size .the node. below"),
                       (dict(node_resident=True, shard_size=8, mode="zero1"), "fsdp only"),
                       (dict(prefetch=True, mode="zero2"), "gathers no layers")):
        mode = bad.pop("mode", "fsdp")
        with pytest.raises(ValueError, match=match):
            estimate(SHAPES["qwen3-8b"], 16, mode, path_tokens=1024, call_tokens=1024, **bad)
    assert Hardware().gpus_per_node == 8


def test_a_row_short_of_the_share_names_what_binds_it():
    """experiments.planning_table: a row under 0.6 names the binding resource with its
    numbers -- Llama-70B on 16 GPUs at 32K: without the gradient sums on the host, fsdp over
    the world, bound by bandwidth across the nodes; with them (issue 53 item 4) its state
    fits the node's shard group of 8 and the host's per-call adds bind it, the faster
    candidates naming the memory they would need; Qwen3-235B-A22B on 32: the host's
    offloaded step."""
    import re

    from experiments.planning_table import SHARE, binds, plan, rollouts

    tree = rollouts(32_768)
    before = plan("llama-70b", 16, tree, offload=("none", "optimizer"))
    assert before.chosen is not None and before.chosen.shard_size == 16
    why = binds(before)
    assert why.startswith("bandwidth: fsdp's collectives") and "across nodes at 50 GB/s" in why
    llama = plan("llama-70b", 16, tree)
    e = llama.chosen
    assert e is not None and e.time.compute_share < SHARE
    assert (e.sharding, e.shard_size, e.offload) == ("fsdp", 8, "gradients")
    assert e.time.step_s < before.chosen.time.step_s  # the node's gathers, not the world's
    why = binds(llama)
    assert why.startswith("host: the offloaded step") and "gradients summed at 2.5 G/s" in why
    over = re.search(r"memory: .*/shard 8/.*\(device: [\d.]+ GiB, ([\d.]+) GiB over", why)
    assert over and float(over.group(1)) > 0, why
    big = plan("qwen3-235b-a22b", 32, tree)
    assert binds(big).startswith("host: the offloaded step"), binds(big)
    assert big.chosen.host <= 256 * GIB  # the table's host budget


def test_dta_plan_takes_the_new_knobs(capsys):
    """`dta plan --memory`: --sharding zero2, --node-resident on, --prefetch on and
    --host-budget-gib pin what the planner tries, the JSON says what was chosen and why
    candidates were refused; bad values are one-line errors."""
    import json

    from dta_cli.main import main

    args = ["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "16",
            "--memory", "--model", "qwen3-14b", "--budget-gib", "80", "--json"]
    assert main(args + ["--node-resident", "on", "--prefetch", "on", "--shard-size", "8"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert got["chosen"] == "fsdp" and got["node_resident"] and got["prefetch"]
    assert got["overlap_seconds"] > 0 and "calls" in got["overlapped"]
    assert got["inter_node_bytes"] > 0 and got["intra_node_bytes"] > got["inter_node_bytes"]
    assert main(args + ["--sharding", "zero2", "--offload", "optimizer",
                        "--host-budget-gib", "1"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert got["chosen"] is None and "host budget" in got["refused"]
    assert got["host_budget_bytes"] == GIB
    for bad, match in ((["--node-resident", "on", "--shard-size", "16"], "--node-resident on"),
                       (["--host-budget-gib", "0"], "--host-budget-gib must be > 0")):
        assert main(args + bad) != 0
        assert match in capsys.readouterr().err


def test_dta_train_auto_reads_the_host_budget():
    """train.host_memory_budget_gib reaches the planner through runtime.engine.resolve: Qwen3-32B
    on 8 x 80 GB fits only offloaded (61 GiB of host per rank); a 32 GiB host budget refuses
    it, the error naming the key and the host."""
    from dta.config.schema import load_config
    from runtime.engine import resolve_run_config

    tree = rollouts(4, 8192, 32_768)
    base = ["train.sharding=auto", "train.memory_budget_gib=80", "ray.num_workers=8",
            "walker.policy=recompute", "model.dtype=bfloat16", "train.offload=auto",
            "train.context_parallel=8", "walker.block_tokens=8192"]
    free = resolve_run_config(load_config(None, base), SHAPES["qwen3-32b"], tree)
    assert free.layout.offload == "optimizer" and free.report["host_bytes"] > 32 * GIB
    assert free.report["host_budget_bytes"] is None
    tight = load_config(None, base + ["train.host_memory_budget_gib=32"])
    with pytest.raises(ValueError, match=r"train.host_memory_budget_gib .*host budget"):
        resolve_run_config(tight, SHAPES["qwen3-32b"], tree)

"""The planner knows experts, prices expert parallelism, HSDP shard groups and optimizer offload
(issue 46; dta.planning.shapes, dta.planning.state, dta.planning.timing, docs/planning.md):
MoE totals and active counts against the published ones and against the tiny models' own
parameters; a Qwen3-30B-A3B config.json priced as 30B by `dta plan`; Qwen3-32B fitting one
8 x 80 GB node at 128K only with the optimizer offloaded; HSDP faster than plain fsdp on two
nodes; at EP = 4 a rank's expert weights a quarter, and the expert all-to-alls proportional to
the tokens routed, counted by the model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dta.options import WalkOptions
from dta.planning import build_tree
from dta.planning.memory import GIB, SHAPES, ModelShape, estimate, plan_memory
from dta.planning.state import OFFLOADS, expert_parallel_sizes, shard_sizes
from dta.planning.timing import Hardware, Pricer, replica_traffic, sharding_traffic

WALK = WalkOptions()
A3B = SHAPES["qwen3-30b-a3b"]


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9),
    ("llama-70b", 70.6e9, None), ("mixtral-8x7b", 46.7e9, 12.9e9),
    ("qwen3-8b", 8.19e9, None), ("qwen3-32b", 32.8e9, None)])
def test_named_shapes_have_their_published_counts(name, total, active):
    shape = ModelShape.of(SHAPES[name])
    assert shape.params == pytest.approx(total, rel=0.01)
    if active is None:
        assert not shape.is_moe and shape.active_params == shape.params
    else:  # published actives are rounded to 0.1B: 2 %
        assert shape.is_moe and shape.active_params == pytest.approx(active, rel=0.02)
        assert shape.params == shape.dense_params + shape.routed_params


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe",
                                    "qwen3_next"])
def test_shape_counts_the_tiny_moe_models_parameters(family):
    """Every parameter of the transformers model (q/k-norm widths aside: OLMoE's are full
    width, Mixtral has none; < 0.1 %), the routed experts exactly, and the sparse layers
    (Qwen3-MoE with mlp_only_layers and decoder_sparse_step: dense MLPs between)."""
    from dta.model.models import build_model

    model = build_model(family, "tiny")
    shape = ModelShape.of(model.config)
    real = sum(p.numel() for p in model.parameters())
    assert shape.params == pytest.approx(real, rel=1e-3)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert shape.routed_params == routed > 0
    sparse = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert shape.sparse_layers == sparse == len(model.model.layers)
    if family == "qwen3_moe":
        mixed = build_model(family, "tiny", num_hidden_layers=4, mlp_only_layers=[0],
                            decoder_sparse_step=2)
        s = ModelShape.of(mixed.config)
        assert s.sparse_layers == sum(hasattr(x.mlp, "experts") for x in mixed.model.layers) == 2
        assert s.params == sum(p.numel() for p in mixed.parameters())


def test_a_config_json_of_qwen3_30b_a3b_is_priced_as_30b_by_dta_plan(tmp_path, capsys):
    """The issue's bug: the config was priced as ~3B ("replicate fits" on 8 GPUs). Now its
    30.5B parameters are priced; replicate without expert parallelism needs its bf16 weights,
    gradients and states whole (~244 GB) and is never reported as fitting; everything
    reported as fitting holds at least its share of the weights and fits the usable bytes."""
    from dta_cli.main import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**A3B, "architectures": ["Qwen3MoeForCausalLM"],
                               "hidden_act": "silu", "torch_dtype": "bfloat16"}))
    assert main(["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "8",
                 "--memory", "--model", str(cfg), "--budget-gib", "80", "--json"]) == 0
    out = capsys.readouterr().out
    mem = json.loads(out.strip().splitlines()[-1])["memory"]
    assert mem["params"] >= 30e9 and 3e9 < mem["active_params"] < 3.5e9
    assert "30.53B parameters (3.35B active, 128 experts, top 8)" in out
    usable, shape = mem["usable_bytes"], ModelShape.of(A3B)
    assert mem["chosen"] is not None and mem["expert_parallel"] in (1, 2, 4, 8)
    fitting = [c for c in mem["candidates"] if c["total"] <= usable]
    assert fitting and {c["expert_parallel"] for c in mem["candidates"]} == {1, 2, 4, 8}
    for c in mem["candidates"]:
        E, S = c["expert_parallel"], c["shard_size"]
        held = shape.rank_params(E) if c["sharding"] != "fsdp" else shape.params // S
        assert c["params"] + c["host"] >= 2 * held  # at least its weights, in bf16
        if c["sharding"] == "replicate" and E == 1:  # weights, grads, 2 states (some on the host)
            assert c["state"] + c["host"] >= 4 * 2 * 30e9 and c["total"] > usable
        if c["total"] <= usable:
            assert c["state"] + sum(c["split"].values()) == c["total"] <= usable
    chosen = next(c for c in mem["candidates"] if c["label"] == mem["choice"])
    assert chosen["total"] <= usable


def rollouts(n: int, prompt: int, own: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    p = rng.integers(3, 150_000, prompt)
    return build_tree([np.concatenate([p, rng.integers(3, 150_000, own)]) for _ in range(n)])


def test_qwen3_32b_fits_one_8x80_node_at_128k_only_with_offload():
    """The docs' 128K row (experiments.planning_table: four rollouts of 131,072 tokens on an
    8,192-token prompt): no layout fits 8 x 80 GB without offload; with the optimizer state
    and masters in host memory one does, its host bytes reported."""
    from experiments.planning_table import rollouts as table_rollouts

    tree = table_rollouts(131_072)
    kw = dict(tree=tree, walk=WALK, context_parallel=(1, 2, 4, 8))
    none = plan_memory(SHAPES["qwen3-32b"], 8, 80 * GIB, **kw)
    offload = plan_memory(SHAPES["qwen3-32b"], 8, 80 * GIB, offload=OFFLOADS, **kw)
    assert none.chosen is None and none.shortfall > 0
    got = offload.chosen
    assert got is not None and got.offload == "optimizer" and got.optimizer == 0
    assert got.host >= 3 * 4 * ModelShape.of(SHAPES["qwen3-32b"]).params // 8  # masters, 2 states
    assert got.time.host_s > 0 and got.time.step_s > got.time.compute_s
    # an offloaded candidate is priced only where the same without offload does not fit
    fits = [e for e in none.tried if e.total <= none.budget]
    assert not fits and any(e.offload == "none" for e in offload.tried)


def test_hsdp_is_faster_than_plain_fsdp_for_qwen3_32b_on_two_nodes():
    """16 GPUs (two nodes of 8): fsdp's per-call gathers stay on NVLink inside a shard group
    of 8; one all-reduce of the sharded gradients crosses the nodes per step."""
    tree = rollouts(4, 8192, 32_768)
    pricer = Pricer(SHAPES["qwen3-32b"], tree, walk=WALK)
    kw = dict(path_tokens=8192 + 32_768, call_tokens=8192, policy="recompute",
              block_tokens=8192, context_parallel=8, offload="optimizer")
    plain = pricer.price(estimate(SHAPES["qwen3-32b"], 16, "fsdp", **kw)).time
    hsdp = pricer.price(estimate(SHAPES["qwen3-32b"], 16, "fsdp", shard_size=8, **kw)).time
    assert hsdp.step_s < plain.step_s and hsdp.sharding_s < plain.sharding_s / 5
    assert plain.replica_bytes == 0 < hsdp.replica_bytes
    shape = ModelShape.of(SHAPES["qwen3-32b"])
    assert hsdp.replica_bytes == pytest.approx(2 * 0.5 * shape.params / 8 * 4, rel=1e-6)
    assert hsdp.replica_s == pytest.approx(hsdp.replica_bytes / (Hardware().inter_node_gbs * 1e9),
                                           rel=0.01)  # + a latency per bucket
    assert hsdp.sharding_bytes == pytest.approx(plain.sharding_bytes * (7 / 8) / (15 / 16))
    # the state: an 8-way shard, twice the plain one
    a = estimate(SHAPES["qwen3-32b"], 16, "fsdp", **kw)
    b = estimate(SHAPES["qwen3-32b"], 16, "fsdp", shard_size=8, **kw)
    assert b.host == pytest.approx(2 * a.host, rel=1e-6) and b.grads > a.grads
    assert shard_sizes(16, 8) == (None, 8) and shard_sizes(8, 8) == (None,)
    plan = plan_memory(SHAPES["qwen3-32b"], 16, 80 * GIB, tree=tree, walk=WALK,
                       context_parallel=(8,), shard_size=(None, 8), offload=OFFLOADS,
                       policies=("recompute",), blocks=(8192,))
    assert plan.chosen.shard_size == 8 and "/shard 8" in plan.chosen.label()


def test_expert_parallel_divides_the_expert_weights_and_follows_the_routed_tokens():
    """Counted by the model on Qwen3-30B-A3B, one group of 4 ranks walking one tree (C = 4):
    at EP = 4 a rank holds a quarter of the routed experts (<= 0.3x of EP = 1's) and computes
    a quarter of the group's routed rows' expert FLOPs (<= 0.3x of one rank walking them at
    EP = 1) -- the same as at EP = 1 in the same group (balanced routing: EP moves the expert
    work to the experts' owners, it does not divide it further). The all-to-all bytes are
    proportional to the tokens routed: two path lengths, the same bytes per routed row."""
    shape = ModelShape.of(A3B)
    assert expert_parallel_sizes(shape, 8) == (1, 2, 4, 8)
    assert expert_parallel_sizes(ModelShape.of(SHAPES["qwen3-8b"]), 8) == (1,)
    X = shape.routed_params
    assert shape.rank_params(4) - shape.dense_params == X // 4 <= 0.3 * X
    kw = dict(path_tokens=40_960, call_tokens=2048, policy="recompute", block_tokens=2048)
    rep1 = estimate(A3B, 4, "replicate", context_parallel=4, **kw)
    rep4 = estimate(A3B, 4, "replicate", context_parallel=4, expert_parallel=4, **kw)
    assert (rep1.params - rep4.params) == 2 * (X - X // 4)  # bf16 experts: 3/4 of them gone
    assert rep4.split["ep_buffers"] > 0 and "ep_buffers" not in rep1.split

    def priced(tree, E, C, world):
        path = int(max(tree.lengths))
        est = estimate(A3B, world, "zero1", path_tokens=path, call_tokens=2048,
                       policy="recompute", block_tokens=2048, context_parallel=C,
                       expert_parallel=E)
        return Pricer(A3B, tree, walk=WALK).price(est).time

    tree = rollouts(4, 2048, 8 * 2048)
    alone, ep1, ep4 = priced(tree, 1, 1, 1), priced(tree, 1, 4, 4), priced(tree, 4, 4, 4)
    assert ep4.expert_flops <= 0.3 * alone.expert_flops
    assert ep4.expert_flops == pytest.approx(alone.expert_flops / 4, rel=1e-12)
    assert ep4.expert_flops == ep1.expert_flops and ep1.ep_bytes == 0 < ep4.ep_bytes
    # the routed experts' share of the FLOPs: top_k of 128 experts, x 3 (fwd + bwd) x 4/3
    per_row = 8 * 6 * 3 * 2048 * 768 * 48 * 4 / 3
    assert alone.expert_flops == pytest.approx(per_row * alone.tokens, rel=1e-12)
    # bytes per routed row: the same at paths of 18,432 and 67,584 tokens (within 10 %: here
    # exactly), the bytes in proportion to the rows routed
    longer = priced(rollouts(4, 2048, 32 * 2048), 4, 4, 4)
    per = [t.ep_bytes / (t.tokens / 4 * shape.experts.top_k) for t in (ep4, longer)]
    assert per[0] == pytest.approx(per[1], rel=0.10) and per[0] == pytest.approx(per[1], rel=1e-12)
    assert per[0] == pytest.approx(3 * 2 * 48 * 3 / 4 * 2048 * 2, rel=1e-12)
    assert longer.ep_bytes / ep4.ep_bytes == pytest.approx(longer.tokens / ep4.tokens)


def test_state_by_layout():
    """Offload moves the optimizer, the masters and their gradient buffers to the host; a
    shard group of S holds N / S of a dense layout, but under E > 1 the expert slices'
    state is split over their W / E replicas (runtime.sharding.experts), not the group; the
    layout is checked with one-line errors."""
    shape = ModelShape.of(A3B)
    kw = dict(path_tokens=8192, call_tokens=2048, policy="recompute")
    N, X = shape.params, shape.routed_params
    z = estimate(A3B, 16, "zero1", shard_size=8, **kw)
    assert z.optimizer == pytest.approx(2 * N / 8 * 4, rel=1e-4)  # 2 states of N / S
    for E in (4, 8):  # the dense part over S = 8, the slice X / E over its 16 / E replicas
        z = estimate(A3B, 16, "zero1", shard_size=8, expert_parallel=E, **kw)
        assert z.optimizer == 2 * (-(-(N - X) // 8) + X // 16) * 4
    z = estimate(A3B, 16, "zero1", expert_parallel=8, **kw)
    zo = estimate(A3B, 16, "zero1", expert_parallel=8, offload="optimizer", **kw)
    assert zo.optimizer == 0 and zo.grads == z.grads
    # the states, the masters and the masters' gradient buffers (and AdamW's step counters)
    assert zo.host - zo.steps == z.optimizer + 2 * (z.params - zo.params)
    assert z.host == z.steps == zo.steps == 4 * shape.tensors
    r = estimate(A3B, 16, "replicate", expert_parallel=8, **kw)
    ro = estimate(A3B, 16, "replicate", expert_parallel=8, offload="optimizer", **kw)
    # the states, the stepped copy and its gradient buffer
    assert ro.params == r.params and ro.optimizer == 0
    assert ro.host - ro.steps == r.optimizer + 2 * r.params
    assert ro.label().endswith("/expert parallel 8/offload optimizer")
    for bad, match in ((dict(expert_parallel=3), "expert_parallel=3 does not divide the world"),
                       (dict(expert_parallel=32), "does not divide the world of 16"),
                       (dict(shard_size=3), "shard_size=3 does not divide the world"),
                       (dict(offload="all"), "unknown offload 'all'")):
        with pytest.raises(ValueError, match=match):
            estimate(A3B, 16, "zero1", **bad, **kw)
    with pytest.raises(ValueError, match="no routed experts"):
        estimate(SHAPES["qwen3-8b"], 8, "zero1", expert_parallel=2, **kw)
    with pytest.raises(ValueError, match="replicate shards nothing"):
        estimate(A3B, 16, "replicate", shard_size=8, **kw)
    with pytest.raises(ValueError, match="must divide one another"):
        estimate(SHAPES["mixtral-8x7b"], 12, "zero1", shard_size=3, expert_parallel=2, **kw)
    # the traffic of a shard group: inside it only, the replicas' all-reduce across
    s8 = sharding_traffic("zero1", 16, shape, "recompute", 10, 2, expert_parallel=8,
                          shard_size=8)[0]
    assert s8 == pytest.approx(7 / 8 * shape.dense_params * 6)  # the experts: not the group's
    assert replica_traffic("zero1", 16, shape, 2, shard_size=16) == (0.0, 0)
    # the expert slices once a step over their 2 replicas (reduce-scatter fp32, gather bf16),
    # with the dense shards' all-reduce across the 2 groups of 8
    got = replica_traffic("zero1", 16, shape, 2, expert_parallel=8, shard_size=8)[0]
    assert got == pytest.approx(1 / 2 * X / 8 * 6 + 2 * 1 / 2 * shape.dense_params / 8 * 4)
    assert replica_traffic("zero1", 16, shape, 2, expert_parallel=16)[0] == 0  # one owner


def test_dta_plan_pins_the_layout(capsys):
    from dta_cli.main import main

    args = ["plan", "--workload", "tau2-airline", "--scale", "0.05", "--workers", "8",
            "--memory", "--model", "qwen3-30b-a3b", "--budget-gib", "80", "--json"]
    assert main(args + ["--expert-parallel", "4", "--offload", "none"]) == 0
    mem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert mem["expert_parallel"] == 4 and mem["offload"] == "none" and mem["shard_size"] == 8
    assert {(c["expert_parallel"], c["offload"]) for c in mem["candidates"]} == {(4, "none")}
    for flag, value, err in (("--expert-parallel", "3", "--expert-parallel: expert_parallel=3 "
                              "does not divide the world of 8 ranks"),
                             ("--shard-size", "x", "--shard-size must be auto or an integer"),
                             ("--shard-size", "3", "--shard-size: shard_size=3 does not divide")):
        assert main(args + [flag, value]) == 2
        assert err in capsys.readouterr().err
    assert main(args[:-4] + ["qwen3-8b", "--json", "--expert-parallel", "2"]) == 2
    assert "the model has no routed experts" in capsys.readouterr().err


def test_auto_price_takes_the_layouts_and_defaults_to_none():
    """runtime.engine.auto.price: the defaults are a run without the new layouts; given
    them, it returns the priced E / S / offload and reports them."""
    from runtime.engine.auto import price

    kw = dict(world=16, budget_bytes=80 * GIB, tree=None, walk=WALK, compute_dtype="bfloat16")
    plain = price(A3B, **kw)
    assert (plain.expert_parallel, plain.shard_size, plain.offload) == (1, 16, "none")
    got = price(A3B, **kw, expert_parallel=(1, 2, 4, 8, 16), shard_size=(None, 8),
                offload=OFFLOADS)
    r = got.report
    assert (r["expert_parallel"], r["shard_size"], r["offload"]) == \
        (got.expert_parallel, got.shard_size, got.offload)
    assert r["priced_expert_parallel"] == [1, 2, 4, 8, 16] and r["priced_shard_size"] == [16, 8]
    assert {e["expert_parallel"] for e in r["estimates"]} <= {1, 2, 4, 8, 16}

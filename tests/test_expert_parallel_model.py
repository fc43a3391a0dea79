"""The model side of expert parallelism (``dta.model.expert_parallel``) and the layout facts
it brings: each rank's slice of every MoE layer's experts, the (token, k) rows exchanged with
their owners, the model's own forward and backward (no walk) on 2 and 4 gloo ranks equal to
one process in float64 (every gradient: the dense ones summed over the ranks, each expert
slice against its piece of the whole), a no-grad forward that keeps nothing, the refusals,
and the layout's matched calls."""
from __future__ import annotations

import pytest
import torch

from dta.local_ranks import run_group

TOL = 1e-12


def build(family):
    from dta.model.models import build_model, make_truly_float64

    m = build_model(family, "tiny", dtype="float64", seed=0)
    make_truly_float64(m)
    return m


def sequences(rank, world):
    """Rank r's sequences: at W = 2 three and one, so the ranks make different numbers of
    calls (matched below by a peer's dummy calls, as runtime.engine.lockstep pads)."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (5 + 3 * i,), generator=g) for i in range(4)]
    if world == 2:
        return seqs[:3] if rank == 0 else seqs[3:]
    return seqs[rank::world]


def loss_of(model, s):
    return model(input_ids=s[None]).logits.pow(2).mean()


def ranks_main(group, family):
    import torch.distributed as dist

    from dta.model.expert_parallel import expert_parallel_of, parallelize_experts

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model = parallelize_experts(build(family), group)
    ep = expert_parallel_of(model)
    mine = sequences(rank, world)
    most = max(len(sequences(r, world)) for r in range(world))
    for s in mine:
        loss_of(model, s).backward()
    for _ in range(most - len(mine)):  # a peer's extra call: a one-token dummy, zero gradient
        (0.0 * loss_of(model, mine[0][:1])).backward()
    with torch.no_grad():
        model(input_ids=mine[0][None])
    kept = sum(len(layer.store) for layer in ep.layers)
    ep.check()
    grads, shapes = {}, {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if ep.is_expert(p):
            grads[name], shapes[name] = ep.full_tensor(g), (tuple(p.shape), ep.slice_of(p))
        else:
            g = g.clone()
            dist.all_reduce(g, group=group)
            grads[name] = g
    return {"grads": grads, "shapes": shapes, "sent": ep.sent_bytes, "kept": kept,
            "rows": ep.routed_rows}


@pytest.mark.parametrize("family,world", [
    ("qwen3_moe", 2), pytest.param("mixtral", 4, marks=pytest.mark.slow)])
def test_expert_slices_train_as_the_whole_model(family, world):
    ref = build(family)
    for r in range(world):
        for s in sequences(r, world):
            loss_of(ref, s).backward()
    results = run_group(ranks_main, world, family)
    whole = dict(ref.named_parameters())
    for rank, got in enumerate(results):
        assert got["kept"] == 0 and got["sent"] > 0 and got["rows"] > 0, got
        for name, (shape, (first, stop, n)) in got["shapes"].items():
            assert shape[0] == n // world == stop - first and first == rank * n // world
            assert shape[1:] == tuple(whole[name].shape[1:])
        assert len(got["shapes"]) == 2 * ref.config.num_hidden_layers  # 2 per MoE layer
        for name, p in whole.items():
            err = float((got["grads"][name] - p.grad).norm() / p.grad.norm())
            assert err <= TOL, f"{family} W={world} rank {rank} {name}: {err:.3g}"


# ------------------------------------------------------------------ refusals --
def _fake_group(size: int, rank: int = 0):
    """An ExpertParallel without torch.distributed (refusals are checked before any
    collective)."""
    from dta.model.expert_parallel import ExpertParallel

    ep = object.__new__(ExpertParallel)
    ep.group, ep.size, ep.rank, ep.layers = None, size, rank, []
    ep.sent_bytes = ep.collectives = ep.routed_rows = 0
    ep.errors = []
    return ep


def test_refusals_name_the_model_and_the_reason():
    from dta.model.expert_parallel import ExpertParallelError, parallelize_experts
    from dta.model.models import build_model

    with pytest.raises(ExpertParallelError, match="LlamaForCausalLM: expert parallel needs "
                                                  "MoE layers whose routed experts are one "
                                                  "fused module"):
        parallelize_experts(build_model("llama", "tiny"), _fake_group(2))
    with pytest.raises(ExpertParallelError, match=r"Qwen3MoeForCausalLM: expert parallel over "
                                                  r"3 ranks needs a number of experts "
                                                  r"divisible by 3; layers.0.mlp.experts has 4"):
        parallelize_experts(build_model("qwen3_moe", "tiny"), _fake_group(3))
    model = build_model("mixtral", "tiny")
    model.model.layers[0].mlp.experts.has_bias = True
    with pytest.raises(ExpertParallelError, match="layers.0.mlp.experts has biases"):
        parallelize_experts(model, _fake_group(2))
    model = build_model("qwen3_moe", "tiny")
    parallelize_experts(model, _fake_group(2, rank=1))
    experts = model.model.layers[1].mlp.experts
    assert (experts.first, experts.num_local, tuple(experts.down_proj.shape)) == (2, 2, (2, 64, 32))
    assert [n for n, _ in model.named_parameters() if "experts" in n][:2] == [
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(ExpertParallelError, match="applied already"):
        parallelize_experts(model, _fake_group(2))


# -------------------------------------------------------------------- layout --
def test_the_layout_matches_calls_where_an_expert_group_spans_data_parallel_groups():
    from runtime.engine import ParallelLayout
    from runtime.engine.layout import LayoutError

    def lay(**kw):
        return ParallelLayout.make(**kw)

    assert not lay(world=4).matched_calls
    span = lay(world=4, expert_parallel=2)  # two data-parallel groups per expert group
    assert span.matched_calls and span.sharded and span.walk_needs("retain") == {"head_rows": 0}
    assert span.walk_needs("recompute") == {}
    assert (span.at(3).expert_rank, span.expert_groups(), span.expert_replica_groups()) == (
        1, [[0, 1], [2, 3]], [[0, 2], [1, 3]])
    inside = lay(world=4, context_parallel=2, expert_parallel=2)  # a CP group walks one tree
    assert not inside.matched_calls and inside.walk_needs("retain") == {}
    assert lay(world=4, context_parallel=2, expert_parallel=4).matched_calls
    assert "expert_parallel=2 across data-parallel groups" in span.matched_reason()
    with pytest.raises(LayoutError, match="bad value for config key 'train.expert_parallel': "
                                          "3 must be a divisor of the world size 4"):
        lay(world=4, expert_parallel=3,
            spelling={"expert_parallel": "config key 'train.expert_parallel'"})


def test_a_frozen_base_is_refused_with_expert_parallel():
    from dta.model.models import build_model
    from dta.options import WalkOptions
    from runtime.engine import EngineCore, ParallelLayout, settle

    def frozen(dtype):
        m = build_model("qwen3_moe", "tiny", dtype=dtype)
        m.lm_head.weight.requires_grad_(False)
        return m

    layout = ParallelLayout.make(world=2, expert_parallel=2)
    with pytest.raises(ValueError, match="bad expert-parallel size 2: needs every weight "
                                         "trained; this model has frozen ones"):
        EngineCore(frozen, layout=layout, walk=settle(WalkOptions(), layout).walk,
                   make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0),
                   compute_dtype="float32")


# ------------------------------------------------------------------------ the CLI --
def test_cli_verify_expert_parallel_needs_its_group():
    from dta_cli.main import main

    with pytest.raises(SystemExit, match="--expert-parallel must be an integer >= 1"):
        main(["verify", "--family", "qwen3_moe", "--expert-parallel", "0"])
    with pytest.raises(SystemExit, match="--context-parallel must be 2 \\(or unset\\), not 4"):
        main(["verify", "--family", "qwen3_moe", "--expert-parallel", "2",
              "--context-parallel", "4"])


@pytest.mark.slow
def test_cli_verify_expert_parallel(capsys):
    """``dta verify --expert-parallel 2``: the experts divided over the 2 ranks that walk the
    batch together (each routes its own rows), replay + aux loss, blocks over a path."""
    import json

    from dta_cli.main import main

    assert main(["verify", "--family", "qwen3_moe", "--dtype", "float64", "--expert-parallel",
                 "2", "--replay", "--router-aux-loss", "0.01", "--packing", "node",
                 "--block-tokens", "16", "--policy", "recompute", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["passed"] and got["expert_parallel"] == 2 and got["max_rel_err"] <= 1e-10
    ranks = got["context_parallel_ranks"]
    assert min(ranks["expert_sent_bytes"]) > 0 and ranks["expert_weight_share"] == [0.5, 0.5]

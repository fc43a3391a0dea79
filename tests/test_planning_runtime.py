"""The planner prices what the runtime holds (issue 46: ``dta plan --memory`` must never choose
a layout whose weights do not fit): ``dta.planning.state.model_state`` against the rules
``runtime.sharding`` implements, on the tiny Qwen3-MoE model (4 experts, bf16 compute, fp32
masters), byte for byte for the parts that do not depend on the walk (params, optimizer,
host).

* Default suite: the rules restated from the model's own parameters (the expert slices are
  the fused experts' ``gate_up_proj`` / ``down_proj``, dim 0 cut by E, as
  ``dta.model.expert_parallel`` cuts them): under E > 1, zero1 and fsdp hold the rank's
  slice whole in the compute dtype, its fp32 master and AdamW state a flat shard over the
  W / E expert replicas (not the HSDP shard group); fsdp gathers its layers without the
  routed experts, keeps its layer shards in fp32 (offloaded: in the compute dtype, the
  masters on the host), zero2 holds fsdp's shards with every layer gathered all step, a
  node-resident fsdp keeps its masters and optimizer state over the world and a
  compute-dtype copy of its layers over the node, and an offloaded mode's host holds the
  states, the stepped weights and their gradient buffers.
* ``-m slow``: the real runtime on 2 and 4 gloo ranks (``experiments.local_ranks``), one
  step each, its ``state_bytes()`` against the planner: equal up to AdamW's ``step``
  counters (one 4-byte scalar per stepped tensor, which the planner does not price); the
  reported gradient bytes within the planner's peak.
"""
from __future__ import annotations

import math

import pytest

from dta.planning.memory import ModelShape
from dta.planning.state import model_state

C, M = 2, 4  # bf16 compute, fp32 masters


def _tiny():
    from dta.model.models import build_model

    return build_model("qwen3_moe", "tiny")


def held_by_rule(model, world: int, mode: str, E: int, S: int, offload: str,
                 resident: bool = False) -> dict:
    """What rank 0 (the largest chunks) holds by runtime.sharding's rules, from the model's
    parameters: zero1's flat shards (the dense part over S, the expert slices over the W / E
    replicas), fsdp's and zero2's Shard(0) layer shards (torch.chunk: ceil rows; fp32,
    offloaded or node-resident in the compute dtype), their vocabulary and expert flat
    shards, and fsdp's gathered layer, zero2's every gathered layer (less the routed experts
    under E > 1); node-resident: the masters over the world."""
    named = list(model.named_parameters())
    expert = {n for n, _ in named if ".mlp.experts." in n} if E > 1 else set()
    vocab = {"model.embed_tokens.weight", "lm_head.weight"}
    local = {n: p.numel() // (E if n in expert else 1) for n, p in named}
    X = sum(local[n] for n in expert)
    R = world // E
    x = math.ceil(X / R) if X else 0
    off = offload != "none"  # optimizer, or gradients: the same host state (sums apart)
    computed = sum(local.values())
    if mode == "zero1":
        dense = math.ceil(sum(v for n, v in local.items() if n not in expert) / S)
        shard = dense + x
        params = computed * C + (0 if off else shard * M)
    else:
        V = sum(local[n] for n in vocab)

        def body_over(ranks):
            return sum(math.ceil(p.shape[0] / ranks) * (p.numel() // p.shape[0])
                       for n, p in named if n not in expert and n not in vocab)

        layers = [sum(p.numel() for n, p in layer.named_parameters()
                      if f"model.layers.{i}.{n}" not in expert)
                  for i, layer in enumerate(model.model.layers)]
        over = world if resident else S  # the masters' partition
        shard = body_over(over) + math.ceil(V / over) + x
        body = body_over(S)
        masters = 0 if off else (shard - (0 if resident else body)) * M
        gathered = sum(layers) if mode == "zero2" else max(layers)  # zero2: every layer kept
        params = body * (C if off or resident else M) + (V + X) * C + masters + gathered * C
    optimizer = 2 * shard * M
    # offload gradients: the layers' per-call sums on the host -- the layers' gradient
    # buffer already there, but under node residency a node shard's beside the W slice's
    sums = body * M if offload == "gradients" and resident else 0
    return {"params": params, "optimizer": 0 if off else optimizer,
            "host": optimizer + 2 * shard * M + sums if off else 0}


LAYOUTS = [("zero1", 2, 4), ("fsdp", 2, 4), ("zero1", 2, 2), ("fsdp", 2, 2), ("fsdp", 4, 2),
           ("zero1", 4, 4), ("fsdp", 1, 4), ("zero1", 1, 2), ("zero2", 2, 4), ("zero2", 1, 2),
           ("zero2", 2, 2)]
RESIDENT = [("fsdp", 1, 2), ("fsdp", 2, 2)]  # node-resident: S = 2 of 4 ranks


@pytest.mark.parametrize("mode, E, S, resident", [(*x, False) for x in LAYOUTS]
                         + [(*x, True) for x in RESIDENT])
@pytest.mark.parametrize("offload", ["none", "optimizer", "gradients"])
def test_model_state_is_what_the_runtime_rules_hold(mode, E, S, resident, offload):
    model = _tiny()
    if offload == "gradients" and mode == "zero1":  # no per-call sum to put on the host
        with pytest.raises(ValueError, match="sharding=zero1 keeps no per-call fp32 gradient"):
            model_state(ModelShape.of(model.config), 4, mode, compute_bytes=C,
                        expert_parallel=E, shard_size=S, offload=offload)
        return
    shape = ModelShape.of(model.config)
    assert shape.params == sum(p.numel() for p in model.parameters())  # exact for qwen3_moe
    got = model_state(shape, 4, mode, compute_bytes=C, expert_parallel=E, shard_size=S,
                      offload=offload, node_resident=resident)
    want = held_by_rule(model, 4, mode, E, S, offload, resident)
    assert {k: got[k] for k in want} == want, (mode, E, S, offload, resident)
    # AdamW's step counters: a bound on every stepped tensor (one per parameter at most)
    assert got["steps"] >= 4 * len(list(model.parameters())), got["steps"]


def test_expert_slices_are_not_gathered_nor_sharded_like_the_dense_body():
    """The two mismatches of issue 46, on Qwen3-30B-A3B on 16 GPUs: under E > 1 fsdp holds the
    rank's slice whole in bf16 (not an fp32 shard of it over the shard group), and HSDP's
    shard group does not cut the slices' state (their W / E replicas do); offloaded fsdp
    keeps its layer shards in fp32."""
    from dta.planning.memory import SHAPES

    shape = ModelShape.of(SHAPES["qwen3-30b-a3b"])
    X = shape.routed_params
    kw = dict(compute_bytes=2, expert_parallel=8)
    plain = model_state(shape, 16, "fsdp", **kw)
    hsdp = model_state(shape, 16, "fsdp", shard_size=8, **kw)
    dense, V = shape.params - X, shape.vocab_params
    # the slice (X / 8) whole in bf16 and its fp32 master over its 2 replicas in both: S
    # changes the dense part's fp32 shards only
    assert hsdp["params"] - plain["params"] == 4 * (
        math.ceil((dense - V) / 8) + math.ceil(V / 8)
        - math.ceil((dense - V) / 16) - math.ceil(V / 16))
    assert hsdp["optimizer"] == 2 * (math.ceil((dense - shape.vocab_params) / 8)
                                     + math.ceil(shape.vocab_params / 8) + X // 16) * 4
    assert plain["params"] >= X // 8 * 2 + X // 16 * 4
    off = model_state(shape, 16, "fsdp", offload="optimizer", **kw)
    body = math.ceil((dense - shape.vocab_params) / 16)
    # offloaded, the device keeps compute-dtype shards only: the layer shards in bf16, the
    # masters (layer, vocabulary and expert shards) on the host
    assert off["params"] == plain["params"] - (math.ceil(shape.vocab_params / 16) + X // 16) * 4 \
        - body * 2
    assert off["params"] >= body * 2 + X // 8 * 2  # bf16 layer shards, the bf16 slice
    assert off["host"] == 2 * plain["optimizer"]  # states + masters + gradient buffers


@pytest.mark.parametrize("resident", [False, True])
def test_offload_gradients_takes_the_layer_sums_off_the_device(resident):
    """Llama-3.1-70B on 16 GPUs, fsdp in a node of 8 (issue 53 item 4): offload gradients
    leaves the device the optimizer offload's state less the fp32 sum of the layer shards
    (l m: 31.9 GiB here), with the host unchanged (that sum is the layers' host gradient
    buffer) or, node-resident, grown by it; zero1 has no such sum and is refused."""
    from dta.planning.memory import SHAPES

    shape = ModelShape.of(SHAPES["llama-70b"])
    kw = dict(compute_bytes=2, shard_size=8, node_resident=resident)
    opt = model_state(shape, 16, "fsdp", offload="optimizer", **kw)
    grad = model_state(shape, 16, "fsdp", offload="gradients", **kw)
    body = math.ceil((shape.params - shape.vocab_params) / 8)
    assert body * 4 > 31 * 2**30  # the fp32 sum of 1/8 of 70B's layers: 31.9 GiB
    assert grad["params"] == opt["params"] and grad["optimizer"] == opt["optimizer"] == 0
    assert grad["grads"] == opt["grads"] - body * 4
    assert grad["host"] == opt["host"] + (body * 4 if resident else 0)
    with pytest.raises(ValueError, match="offload=optimizer is zero1's"):
        model_state(shape, 16, "zero1", offload="gradients", compute_bytes=2)


# ------------------------------------------------------------ the real runtime --
def overrides(mode, E, S, offload, resident=False):
    return [f"train.node_resident={str(resident).lower()}", "workload.scale=tiny", "model.family=qwen3_moe", "model.dtype=bfloat16",
            "walker.policy=recompute", f"train.sharding={mode}", "optimizer.lr=1e-3",
            "optimizer.max_grad_norm=0.5", f"train.expert_parallel={E}",
            f"train.shard_size={S}", f"train.offload={offload}"]


def runtime_bytes(rank, world, cases):
    """One step of each case on this rank: its state_bytes() and the bytes of AdamW's step
    counters."""
    import torch

    from dta.config.schema import load_config
    from tests.test_sharding import _step, _worker

    torch.set_num_threads(1)
    out = []
    for case in cases:
        cfg = load_config(None, overrides(*case))
        w = _worker(cfg, rank, world)
        stats = _step(w, cfg, 0, rank, world)
        steps = sum(v.numel() * v.element_size() for st in w.core.optimizer.state.values()
                    for k, v in st.items() if k == "step" and torch.is_tensor(v))
        out.append({"state_bytes": stats["state_bytes"], "steps": steps})
    return out


def _compare(world, cases, results):
    shape = ModelShape.of(_tiny().config)
    for i, (mode, E, S, offload, *resident) in enumerate(cases):
        got = results[0][i]  # rank 0: the largest chunks
        sb, steps = got["state_bytes"], got["steps"]
        want = model_state(shape, world, mode, compute_bytes=C, expert_parallel=E,
                           shard_size=S, offload=offload, node_resident=bool(resident and
                                                                             resident[0]))
        where = "host" if offload != "none" else "optimizer"
        assert sb["params"] == want["params"], (mode, E, S, offload, sb, want)
        assert sb[where] - steps == want[where], (mode, E, S, offload, sb, want)
        assert sb["optimizer" if where == "host" else "host"] == 0
        assert 0 < sb["grads"] <= want["grads"], (mode, E, S, offload, sb, want)
        print(f"{mode} E={E} S={S} offload={offload} on {world}: runtime {sb} "
              f"(step counters {steps}), planner {want}")


TWO = [(m, 2, 2, o) for m in ("replicate", "zero1", "zero2", "fsdp")
       for o in ("none", "optimizer")]
FOUR = [("zero1", 2, 2, "none"), ("fsdp", 2, 2, "optimizer"), ("fsdp", 2, 4, "none")]


ZERO2 = [("zero2", 1, 2, "none"), ("zero2", 2, 2, "optimizer")]


GRADIENTS = [("fsdp", 1, 2, "optimizer"), ("fsdp", 1, 2, "gradients"),
             ("zero2", 1, 2, "gradients")]


def test_planner_prices_offload_gradients_as_the_runtime_holds_it():
    """fsdp and zero2 with the calls' gradient sum on the host, on 2 ranks: params and host
    bytes equal to the planner's, and the device's gradient bytes those of the same run
    with the optimizer offloaded less rank 0's fp32 layer-shard sum (FSDP2's Shard(0),
    ceil rows) -- what offload gradients takes off the device."""
    from experiments.local_ranks import run_ranks

    got = run_ranks(runtime_bytes, 2, GRADIENTS, timeout=900.0)
    _compare(2, GRADIENTS, got)
    model = _tiny()
    vocab = {"model.embed_tokens.weight", "lm_head.weight"}
    body = sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0])
               for n, p in model.named_parameters() if n not in vocab)
    opt, grad = (got[0][i]["state_bytes"] for i in (0, 1))
    assert grad["grads"] == opt["grads"] - body * M, (opt, grad, body)
    assert grad["host"] == opt["host"] and grad["params"] == opt["params"]


def test_planner_prices_zero2_as_the_runtime_holds_it():
    """zero2 on 2 ranks, without and with expert parallelism (offloaded): every decoder layer
    gathered and kept, FSDP2's layer shards (fp32; offloaded: bf16, the fp32 masters and
    AdamW state on the host) -- the runtime's state_bytes() equal to the planner's."""
    from experiments.local_ranks import run_ranks

    _compare(2, ZERO2, run_ranks(runtime_bytes, 2, ZERO2, timeout=900.0))


@pytest.mark.slow
def test_planner_equals_the_runtime_on_two_ranks():
    from experiments.local_ranks import run_ranks

    _compare(2, TWO, run_ranks(runtime_bytes, 2, TWO, timeout=900.0))


NODE_GRADIENTS = [("fsdp", 1, 2, "optimizer", True), ("fsdp", 1, 2, "gradients", True),
                  ("fsdp", 1, 2, "gradients")]


@pytest.mark.slow
def test_planner_prices_the_host_sums_with_shard_groups_on_four_ranks():
    """offload gradients under HSDP (S = 2 of 4) and node residency: params and host bytes
    equal to the planner's; node-resident, the host holds the node shard's sums beside the
    W-slice's gradient buffer."""
    from experiments.local_ranks import run_ranks

    got = run_ranks(runtime_bytes, 4, NODE_GRADIENTS, timeout=900.0)
    _compare(4, NODE_GRADIENTS, got)
    opt, grad = (got[0][i]["state_bytes"] for i in (0, 1))
    assert grad["host"] > opt["host"] and grad["grads"] < opt["grads"], (opt, grad)


@pytest.mark.slow
def test_planner_equals_the_runtime_with_shard_groups_and_expert_replicas_on_four_ranks():
    """W = 4, E = 2, S = 2: the expert slices' state over their 2 replicas ({0, 2}, {1, 3}),
    the dense part over the shard groups ({0, 1}, {2, 3})."""
    from experiments.local_ranks import run_ranks

    _compare(4, FOUR, run_ranks(runtime_bytes, 4, FOUR, timeout=900.0))

"""MoE (docs/moe.md): routing replay from the rollout and the router's load-balancing loss,
float64 DFS against per-sequence training (dta/reference.py) for the five MoE families.

Default suite: the record and model checks, the conflict error, forcing as an identity on
the router's own choice, the reference's aux loss against HF's, and one exactness case per
family (replayed routing that differs from the router's, the aux loss at 0.01, a small tree
with a fork, a duplicate and a strict prefix). ``slow``: the full matrix (both memory
policies x node / auto / tree packs, on the deep hard batch)."""
import json

import numpy as np
import pytest
import torch

from dta.batch import Batch, BatchError
from dta.losses import NLL, PPO
from dta.model.models import build_model, make_truly_float64
from dta.model.routing import MoERouters, RoutingError, synthetic_routing
from dta.reference import sequence_aux_loss
from dta.train import accumulate_gradients, forward_logprobs
from dta.verify import verify
from dta.walk import Walker
from tests.cases import hard_sequences, make_records

MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe", "qwen3_next"]
LOSS = PPO(eps_clip=0.2, dual_clip=3.0)
COEF = 0.01


def moe_model(family: str, **kw):
    model = build_model(family, "tiny", dtype="float64", seed=0, matrix=True, **kw)
    make_truly_float64(model)
    return model


def small_sequences(vocab: int = 512, seed: int = 3) -> list[np.ndarray]:
    """A fork, a duplicate, a strict prefix, a single-token branch, an unrelated tree."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(3, vocab, n)
    root = tok(6)
    a = np.concatenate([root, tok(4)])
    b = np.concatenate([a, tok(3)])
    c = np.concatenate([a, tok(2)])
    return [c, c.copy(), b, np.concatenate([b, tok(3)]), np.concatenate([root, [5]]), tok(5)]


def replay_batch(model, seqs, seed: int = 0) -> Batch:
    moe = MoERouters(model)
    routed = synthetic_routing(seqs, moe.layers, moe.top_k, moe.num_experts, seed)
    recs = make_records(seqs, prompt=4)
    for r, x in zip(recs, routed):
        r["routed_experts"] = x
    return Batch.from_records(recs)


# ------------------------------------------------------------------- the field --
GOOD = [[[0, 1], [2, 3]]] * 3  # 3 tokens, 2 layers, k = 2


@pytest.mark.parametrize("routed, match", [
    ([[[0, 1], [2, 3]]] * 1, "has 1 tokens, input_ids has 3 \\(give 3, or 2"),
    (GOOD[:2] + [[[0, 1]]], "token 2 has 1 layers x 2 experts, token 0 has 2 x 2"),
    (GOOD[:1] + [[[0, 1], [2]]] + GOOD[:1], "token 1 must be \\[layers\\]\\[k\\]"),
    (GOOD[:2] + [[[0, 1], [2, -1]]], "token 2 layer 1 holds -1"),
    (GOOD[:1] + [[[0, 1.5], [2, 3]]] + GOOD[:1], "token 1 layer 0 holds 1.5"),
    (GOOD[:1] + [[[0, 1], [3, 3]]] + GOOD[:1], "token 1 layer 1 names an expert twice"),
    ([[]] * 3, "token 0 must be"),
    (7, "must be a nested list"),
])
def test_record_field_errors(routed, match):
    recs = [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7], "routed_experts": routed}]
    with pytest.raises(BatchError, match="data.jsonl line 2: field 'routed_experts' " + match):
        Batch.from_records(recs, sources=["data.jsonl line 1", "data.jsonl line 2"])


def test_record_field_all_or_none():
    recs = [{"input_ids": [5, 6, 7], "routed_experts": GOOD}, {"input_ids": [5, 6]}]
    with pytest.raises(BatchError, match="line 2: field 'routed_experts' is missing"):
        Batch.from_records(recs, sources=["f line 1", "f line 2"])
    b = Batch.from_records([{"input_ids": [5, 6, 7], "routed_experts": json.loads(json.dumps(GOOD))}])
    assert b.routed_experts[0].shape == (3, 2, 2) and b.subset([0]).routed_experts[0].shape == (3, 2, 2)


@pytest.fixture(scope="module")
def olmoe():
    return moe_model("olmoe")


@pytest.mark.parametrize("change, match", [
    (lambda r: r[:, :1], "has 1 MoE layers x 2 experts per token; OlmoeForCausalLM has 2 MoE layers"),
    (lambda r: r[:, :, :1], "1 experts per token; .* routing each token to 2 experts"),
    (lambda r: np.where(np.arange(len(r))[:, None, None] == 4, r + 4, r), "token 4 layer 0 names expert"),
])
def test_routing_must_fit_the_model(olmoe, change, match):
    seqs = small_sequences()
    batch = replay_batch(olmoe, seqs)
    batch.routed_experts[2] = change(batch.routed_experts[2])
    with pytest.raises(RoutingError, match="sequence 2: field 'routed_experts' .*" + match):
        accumulate_gradients(olmoe, batch, LOSS)
    assert all(p.grad is None for p in olmoe.parameters())


def test_conflicting_routing_on_a_shared_token(olmoe):
    """Sequences 0-3 share tokens 0..9; sequence 2 routes token 7 otherwise: the error names
    it, a sequence it disagrees with, and the token, before any gradient (and the
    forward-only walk refuses too)."""
    seqs = small_sequences()
    batch = replay_batch(olmoe, seqs)
    r = batch.routed_experts[2]
    r[7, 1] = (r[7, 1] + 1) % 4
    if len(set(r[7, 1].tolist())) < 2:
        r[7, 1] = [r[7, 1, 0], (r[7, 1, 0] + 2) % 4]
    with pytest.raises(RoutingError, match=r"(sequence 2 and sequence [013]|sequence [013] and "
                                           r"sequence 2) share token 7 .* MoE layer 1"):
        accumulate_gradients(olmoe, batch, LOSS)
    assert all(p.grad is None for p in olmoe.parameters())
    with pytest.raises(RoutingError, match="share token 7"):
        forward_logprobs(olmoe, batch)
    batch = replay_batch(olmoe, seqs)  # the same experts in another order: no conflict
    batch.routed_experts[2][7] = batch.routed_experts[2][7][:, ::-1]
    forward_logprobs(olmoe, batch)


def test_replay_and_aux_refused_without_known_routers():
    llama = build_model("llama", "tiny", dtype="float64", seed=0)
    with pytest.raises(RoutingError, match="router_aux_loss=0.01 needs a top-k router.*without MoE"):
        Walker(llama, router_aux_loss=0.01)
    batch = Batch.from_records([{"input_ids": [5, 6, 7], "routed_experts": GOOD}])
    with pytest.raises(RoutingError, match="routing replay .* without MoE routers"):
        accumulate_gradients(llama, batch, NLL())


def _plain_pg(logp, entropy, fields):
    m = fields["loss_mask"]
    return -(fields["advantages"] * logp * m).sum() / m.sum().clamp_min(1)


@pytest.mark.parametrize("family, policy, packing, opaque", [
    ("olmoe", "retain", "auto", "gspo"), ("qwen3_moe", "recompute", "node", "zero_adv")])
def test_aux_with_a_sequence_loss_exact(family, policy, packing, opaque):
    """The opaque sequence-level loss (SequenceLoss) with replay and the aux loss: a
    sequence's aux weight is the reduction's weight of a sequence with a trained token,
    whatever the opaque loss's gradient -- "zero_adv": sequences 4 and 5 (a one-token branch,
    a tree of its own) have advantages 0, so their policy gradient vanishes and only their aux
    term reaches their nodes."""
    from dta.losses import SequenceLoss
    from tests.cases import SEQUENCE_LOSS

    model = moe_model(family)
    batch = replay_batch(model, small_sequences())
    loss = SEQUENCE_LOSS
    if opaque == "zero_adv":
        loss = SequenceLoss(_plain_pg, fields=("loss_mask", "advantages"), uses_entropy=False)
        for i in (4, 5):
            batch.fields["advantages"][i] = np.zeros_like(batch.fields["advantages"][i])
    report = verify(model, batch, loss, policy=policy, packing=packing, pack_tokens=12,
                    router_aux_loss=COEF)
    assert report.max_rel_err() <= 1e-10, report


# ----------------------------------------------------------------- the model fact --
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_forcing(family):
    """Forcing the router's own choice changes nothing; forcing other experts changes the
    output; the reference's aux loss is HF's ``aux_loss`` for that sequence."""
    model = moe_model(family, output_router_logits=True, router_aux_loss_coef=COEF)
    moe = MoERouters(model)
    ids = torch.as_tensor(small_sequences()[3]).unsqueeze(0)
    with torch.no_grad(), moe.scope():
        with moe.call(capture=True) as own:
            out = model(input_ids=ids)
        chosen = torch.stack([own.experts[layer] for layer in range(moe.layers)], dim=1)
        with moe.call(chosen):
            same = model(input_ids=ids).logits
        other = torch.as_tensor(synthetic_routing([ids[0].numpy()], moe.layers, moe.top_k,
                                                  moe.num_experts)[0])
        assert not torch.equal(other, chosen)
        with moe.call(other):
            forced = model(input_ids=ids).logits
    assert float((same - out.logits).abs().max()) <= 1e-12
    assert float((forced - out.logits).abs().max()) > 1e-6
    # HF casts its aux loss to float32 (load_balancing_loss_func: .float())
    ours = sequence_aux_loss(own, moe.num_experts)
    assert abs(float(ours) - float(out.aux_loss)) <= 1e-6 * float(out.aux_loss), (ours, out.aux_loss)


# ------------------------------------------------------------------- exactness --
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("policy, packing, block", [("retain", "auto", None),
                                                    ("recompute", "node", 4)])
def test_replay_and_aux_loss_exact(family, policy, packing, block):
    """Replayed routing (not the router's choice) and the aux loss at 0.01; packs of at
    most 12 tokens (several packs, some masked, a path of frames), or node by node with
    nodes cut into blocks of at most 4 tokens."""
    model = moe_model(family)
    seqs = small_sequences()
    batch = replay_batch(model, seqs)
    moe = MoERouters(model)
    with torch.no_grad(), moe.scope(), moe.call(capture=True) as own:
        model(input_ids=torch.as_tensor(seqs[3]).unsqueeze(0))
    chosen = np.sort(np.stack([own.experts[i].numpy() for i in range(moe.layers)], 1), -1)
    differs = (chosen != np.sort(batch.routed_experts[3], -1)).any(axis=(1, 2))
    assert differs.mean() > 0.5  # most tokens replay experts the router would not pick
    report = verify(model, batch, LOSS, policy=policy, packing=packing, pack_tokens=12,
                    router_aux_loss=COEF, **({"block_tokens": block} if block else {}))
    assert report.truly_float64 and 1 < report.packs <= report.nodes
    for err in ("logprobs", "loss", "grad", "params", "update"):
        assert getattr(report, f"{err}_rel_err") <= 1e-10, (family, report)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replay_without_the_last_token(family):
    """SGLang's export (one routing less than tokens: the last token was never forwarded):
    the last token is routed by the model; a longer sequence sharing it (a strict prefix)
    replays its own routing there, which cannot change the shorter one's loss. Exact; the
    aux loss, which counts the last token, refuses it."""
    model = moe_model(family)
    seqs = small_sequences()
    batch = replay_batch(model, seqs)
    recs = make_records(seqs, prompt=4)
    for r, x in zip(recs, batch.routed_experts):
        r["routed_experts"] = x[:-1].tolist()
    batch = Batch.from_records(recs)
    assert all(r[-1].min() == -1 and r[:-1].min() >= 0 for r in batch.routed_experts)
    report = verify(model, batch, LOSS, policy="recompute", packing="node")
    assert report.max_rel_err() <= 1e-10, report
    with pytest.raises(RoutingError, match="sequence 0: field 'routed_experts' has no routing "
                                           "for the last token"):
        accumulate_gradients(model, batch, LOSS, router_aux_loss=COEF)
    assert all(p.grad is None for p in model.parameters())


def test_aux_loss_value_and_weighting(olmoe):
    """The walk's aux loss is Σ_s coef · ω_s · aux_s of the reference (token_mean: ω_s is the
    sequence's share of the trained tokens), and it is not negligible."""
    seqs = small_sequences()
    batch = replay_batch(olmoe, seqs)
    dfs = accumulate_gradients(olmoe, batch, LOSS, router_aux_loss=COEF, packing="node")
    olmoe.zero_grad(set_to_none=True)
    moe = MoERouters(olmoe)
    expect = 0.0
    totals = sum(batch.loss_mask(i).sum() for i in range(len(batch)))
    with torch.no_grad(), moe.scope():
        for i, s in enumerate(seqs):
            with moe.call(torch.as_tensor(batch.routed_experts[i]), capture=True) as routed:
                olmoe(input_ids=torch.as_tensor(s).unsqueeze(0))
            expect += COEF * batch.loss_mask(i).sum() / totals * float(sequence_aux_loss(routed, 4))
    assert abs(dfs.walk.aux_loss - expect) <= 1e-12 * expect and expect > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("policy", ["retain", "recompute"])
@pytest.mark.parametrize("packing", ["node", "auto", "tree"])
@pytest.mark.parametrize("replay, coef", [(True, 0.0), (False, COEF), (True, COEF)])
def test_moe_matrix_exact(family, policy, packing, replay, coef):
    """Deep tree (a chain of depth >= 7), forks, duplicates, strict prefixes; seq_mean too."""
    model = moe_model(family)
    seqs = hard_sequences()
    batch = replay_batch(model, seqs, seed=1) if replay else \
        Batch.from_records(make_records(seqs))
    report = verify(model, batch, LOSS, policy=policy, packing=packing,
                    reduction="seq_mean" if packing == "tree" else "token_mean",
                    router_aux_loss=coef or "refuse", logits_chunk=7)
    assert report.max_rel_err() <= 1e-10, (family, policy, packing, replay, coef, report)


# ------------------------------------------------------------------- CLI, config --
def test_cli_verify_replay_and_aux(capsys):
    from dta_cli.main import main

    code = main(["verify", "--family", "olmoe", "--dtype", "float64", "--max-sequences", "4",
                 "--replay", "--router-aux-loss", "0.01", "--packing", "node", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and report["passed"] and report["replay"]
    assert report["router_aux_loss_coef"] == 0.01 and report["max_rel_err"] <= 1e-10
    assert "MoE: routing replayed, router aux loss coefficient 0.01" in out
    with pytest.raises(SystemExit, match="--replay needs a top-k router"):
        main(["verify", "--family", "llama", "--max-sequences", "2", "--replay"])


def test_config_key():
    from dta.config.schema import ConfigError, load_config

    assert load_config(overrides=["actor.router_aux_loss_coef=0.01"]).actor.router_aux_loss_coef == 0.01
    with pytest.raises(ConfigError, match="actor.router_aux_loss_coef"):
        load_config(overrides=["actor.router_aux_loss_coef=-1"])
    from dta.config.keys import check_dta_train

    for sharding in ("auto", "fsdp", "zero1", "replicate"):  # fsdp: tests/test_sharding_moe.py
        check_dta_train(load_config(overrides=["actor.router_aux_loss_coef=0.01",
                                               f"train.sharding={sharding}"]))


def test_runtime_batch_copies_keep_the_routing():
    """The Ray worker's batch copies (read-only arrays made writable; recomputed log-probs)
    keep ``routed_experts``: nothing is silently dropped on the way to the walk."""
    from runtime.ray_runtime.worker import _writable

    batch = Batch.from_records([{"input_ids": [5, 6, 7], "routed_experts": GOOD},
                                {"input_ids": [5, 6, 8], "routed_experts": GOOD}])
    for b in (_writable(batch), batch.subset([1])):
        assert b.routed_experts is not None and np.array_equal(b.routed_experts[0], np.array(GOOD))

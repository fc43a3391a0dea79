"""MoE routing replay through the AReaL adapter (docs/moe.md, "AReaL"): a batch dict carrying
AReaL's R3 tensors (``routed_experts`` int32 [B, S, MoE layers, k], right-padded with zeros,
the last token's row AReaL's copy of the row before; ``r3_routing_valid`` [B]) is replayed
by DTATrainEngine exactly as a per-sequence reference of FSDPEngine with the same replay
(tests/test_areal.py's, the routing forced in each sequence's forward), float64 <= 1e-10 on
log-probs, loss, gradients and the AdamW update; bad R3 tensors are refused, naming the
culprit, before anything is touched."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("areal")

from dta.model.models import build_model, load_model, make_truly_float64, save_word_tokenizer  # noqa: E402
from dta.model.routing import MoERouters, synthetic_routing  # noqa: E402
from runtime.areal import (
    DTAOptions,  # noqa: E402
    convert,  # noqa: E402
)
from tests import test_areal as ta  # noqa: E402
from tests.cases import make_records  # noqa: E402
from tests.test_areal import eager_areal  # noqa: E402,F401  (fixture)


def moe_sequences(seed: int = 5) -> list[np.ndarray]:
    """A shared prompt, a fork, a duplicate, a strict prefix continued by token 0 (the
    shorter one's wrap label: its appended token is a real token of the longer one) and one
    continued by another token, an unrelated sequence."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(3, ta.VOCAB, n)
    root = tok(6)
    a = np.concatenate([root, tok(4)])
    b = np.concatenate([a, [0], tok(3)])
    c = np.concatenate([a, tok(3)])
    return [a, b, c, c.copy(), np.concatenate([root, tok(2)]), tok(7)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    build_model("qwen3_moe", "tiny", dtype="float32", seed=0).save_pretrained(path)
    return save_word_tokenizer(path, ta.VOCAB)


def areal_r3(seqs, routing, S: int) -> dict[str, torch.Tensor]:
    """AReaL's R3 trajectory tensors (areal/engine/r3/preprocess.py): SGLang's n - 1 rows,
    the last row filled with the nearest earlier one, zero padding; all valid."""
    L, k = routing[0].shape[1:]
    out = torch.zeros(len(seqs), S, L, k, dtype=torch.int32)
    for i, (s, r) in enumerate(zip(seqs, routing)):
        n = len(s)
        out[i, :n - 1] = torch.as_tensor(r[:n - 1])
        out[i, n - 1] = out[i, n - 2]
    return {"routed_experts": out, "r3_routing_valid": torch.ones(len(seqs), dtype=torch.bool)}


def reference_routing(seqs, routing) -> dict[tuple, np.ndarray]:
    """Per sequence, what per-sequence training replays: SGLang's n - 1 rows; the last token
    the router's own (-1), unless a longer sequence of the batch routed that same token (the
    same prefix): then its routing, which the shared prefix carries in the tree (its output
    predicts the wrap label, AReaL's last position)."""
    out = {}
    for i, (s, r) in enumerate(zip(seqs, routing)):
        n = len(s)
        rows = r.copy()
        longer = [j for j, t in enumerate(seqs) if len(t) > n and np.array_equal(t[:n], s)]
        if not longer:
            rows[n - 1] = -1
        else:
            rows[n - 1] = routing[longer[0]][n - 1]
        out[tuple(int(x) for x in s)] = rows
    return out


def test_replays_areal_routing_float64(moe_dir, eager_areal, monkeypatch):  # noqa: F811
    stat = ta.stats_tracker.stat
    monkeypatch.setattr(ta.stats_tracker, "stat", lambda *a, **kw: stat(*a, **{
        k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in kw.items()}))
    seqs = moe_sequences()
    records = make_records(seqs, prompt=4)
    cfg = ta.engine_config(moe_dir, len(seqs))
    eng = ta.new_engine(cfg, DTAOptions(policy="recompute", dtype="float64", block_tokens=5))
    make_truly_float64(eng.model)
    ref_model = load_model(moe_dir, dtype="float64")
    make_truly_float64(ref_model)
    ref_opt = ta.reference_optimizer(ref_model, cfg.optimizer)
    moe = MoERouters(ref_model)
    routing = synthetic_routing(seqs, moe.layers, moe.top_k, moe.num_experts, seed=2)
    forced = reference_routing(seqs, routing)
    reference_logits = ta._reference_logits

    def replayed_logits(model, padded):  # the per-sequence forward with the replay forced
        ids = padded["input_ids"][0]
        n = int(padded["cu_seqlens"][1])
        rows = np.full((len(ids), moe.layers, moe.top_k), -1)
        rows[:n] = forced[tuple(int(x) for x in ids[:n])]
        with moe.call(torch.as_tensor(rows)):
            return reference_logits(model, padded)

    base = convert.from_records(records)
    r3 = areal_r3(seqs, routing, base["input_ids"].shape[1])
    with moe.scope():
        lp_own = ta.reference_forward(ref_model, ta.ids_only(base), ta.TEMPERATURE)
        monkeypatch.setattr(ta, "_reference_logits", replayed_logits)
        lp_ref = ta.reference_forward(ref_model, ta.ids_only(base), ta.TEMPERATURE)
        lp_dta = eng.forward_batch({**ta.ids_only(base), **r3})
        # AReaL after 1.0.4: PPOActor pops the keys and hands them over as attributes
        eng._r3_pending_routed_experts, eng._r3_pending_valid = r3["routed_experts"], None
        lp_side = eng.forward_batch(ta.ids_only(base))
        eng._r3_pending_routed_experts = None
        assert float((lp_ref - lp_own).abs().max()) > 1e-3  # the replay is not the router's own
        assert float((lp_dta - lp_ref).abs().max()) < 1e-12
        assert torch.equal(lp_side, lp_dta)

        batch = ta.make_train_batch(records, lp_ref)
        before = ta.params_of(eng.model)
        st_dta = eng.train_batch({**batch, **r3}, ta.grpo(), ta.loss_weight_fn)
        st_ref = ta.reference_train_batch(ref_model, ref_opt, batch, ta.grpo(), ta.TEMPERATURE,
                                          cfg.optimizer.gradient_clipping)
    assert st_dta["update_successful"] == st_ref["update_successful"] == 1.0
    assert abs(st_dta["grad_norm"] / st_ref["grad_norm"] - 1) < 1e-10
    assert abs(eng.export_stats()["dta_loss"] / st_ref["loss"] - 1) < 1e-10
    assert ta.max_rel(ta.grads_of(eng.model), ta.grads_of(ref_model)) < 1e-10
    after_dta, after_ref = ta.params_of(eng.model), ta.params_of(ref_model)
    assert ta.max_rel({k: after_dta[k] - before[k] for k in before},
                      {k: after_ref[k] - before[k] for k in before}) < 1e-10

    # the routing must fit the model: one error naming the sequence, nothing touched
    wrong = {**batch, **r3, "routed_experts": r3["routed_experts"][:, :, :1]}
    after = ta.params_of(eng.model)
    with pytest.raises(ValueError, match="sequence 0: field 'routed_experts' has 1 MoE layers x "
                                         "2 experts per token; Qwen3MoeForCausalLM has 2"):
        eng.train_batch(wrong, ta.grpo(), ta.loss_weight_fn)
    assert all(torch.equal(after[k], v) for k, v in ta.params_of(eng.model).items())
    eng.destroy()


def test_bad_r3_tensors_are_named():
    seqs = moe_sequences()
    base = convert.from_records(make_records(seqs, prompt=4))
    S = base["input_ids"].shape[1]
    good = areal_r3(seqs, synthetic_routing(seqs, 2, 2, 4), S)
    routed = good["routed_experts"]
    holes = routed.clone()
    holes[2, 3, 1] = torch.tensor([1, 1], dtype=torch.int32)
    cases = [
        (dict(routed_experts=routed.flatten(2)), "must be an integer tensor \\[B, S, MoE layers, "
                                                 "top_k\\] with \\[B, S\\] = \\[6, 14\\]"),
        (dict(routed_experts=routed[:, :-1]), "got Tensor \\[6, 13, 2, 2\\]"),
        (dict(routed_experts=torch.cat([routed, routed])), "has 12 sequences, input_ids 6: "
                                                           "AReaL 1.0.4's PPOActor"),
        (dict(routed_experts=routed.float()), "torch.float32"),
        (dict(r3_routing_valid=good["r3_routing_valid"]), "'r3_routing_valid' but no "
                                                           "'routed_experts'"),
        (dict(good, r3_routing_valid=torch.tensor([True, True, False, True, True, True])),
         "sequence 2: 'r3_routing_valid' is False"),
        (dict(good, r3_routing_valid=torch.ones(5, dtype=torch.bool)), "must be \\[B\\] = \\[6\\]"),
        (dict(routed_experts=holes), "sequence 2: field 'routed_experts' token 3 layer 1 names "
                                     "an expert twice: \\[1, 1\\]"),
    ]
    for extra, match in cases:
        with pytest.raises(ValueError, match=match):
            convert.take_routing({**ta.ids_only(base), **extra})
    taken = convert.take_routing(dict(ta.ids_only(base), **good))
    assert [len(r) for r in taken] == [len(s) for s in seqs]
    assert all((r[-1] == -1).all() and (r[:-1] >= 0).all() for r in taken)
    with pytest.raises(ValueError, match="take_routing\\(batched\\) takes AReaL's R3 keys out"):
        convert.split_sequences({**ta.ids_only(base), **good})


# ----------------------------------------------- sharded engine ranks (fsdp, zero1) --
def _sharded_step(rank, world, path, mode, r3_on):
    """One train_batch on this rank's half of the batch (AReaL's R3 tensors included)."""
    from tests.test_areal_sharding import _engine, _rank_setup

    seqs = moe_sequences()
    records = make_records(seqs, prompt=4)
    batch = ta.make_train_batch(records, torch.full((len(records), 1), -3.0))
    if r3_on:
        cfg = build_model("qwen3_moe", "tiny").config
        batch.update(areal_r3(seqs, synthetic_routing(seqs, cfg.num_hidden_layers,
                                                      cfg.num_experts_per_tok, cfg.num_experts,
                                                      seed=2), batch["input_ids"].shape[1]))
    with _rank_setup():
        eng = _engine(path, world, mode, "recompute", "float64")
        eng.train_batch({k: v[rank::world] for k, v in batch.items()}, ta.grpo(),
                        ta.loss_weight_fn)
        state = {k: v.detach().clone() for k, v in ta.params_of(eng.model).items()}
        eng.destroy()
    return state


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_sharded_engine_replays_areal_routing(moe_dir, mode):
    """2 engine ranks (actor.dta.sharding=fsdp / zero1), each half of the sequences, replaying
    AReaL's routing: the parameters after one step equal one process's (float64 <= 1e-12), and
    differ from the step without replay. Rank 0's half holds a strict prefix whose wrap label
    is a leaf node of its own (nothing to backpropagate: the walk keeps no graph for it; under
    fsdp + recompute it used to fail the lockstep, replay or not)."""
    from experiments.local_ranks import run_ranks
    from tests.test_areal_sharding import rel_l2

    two = run_ranks(_sharded_step, 2, moe_dir, mode, True)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(key, raising=False)
        one = _sharded_step(0, 1, moe_dir, mode, True)
        own = _sharded_step(0, 1, moe_dir, mode, False)
    assert rel_l2(own, one) > 1e-8  # the replay changed the update
    for rank in (0, 1):
        assert rel_l2(two[rank], one) <= 1e-12, (mode, rank, rel_l2(two[rank], one))

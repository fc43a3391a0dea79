"""Hybrid linear-attention models (Qwen3.5 dense / MoE, Qwen3-Next): the walk forks each Gated
DeltaNet layer's (conv, recurrent) state as it forks K/V, exactly.

Random-init hybrid models draw the GDN decay rate A from [0.01, 1] (HF: [0.01, 16]); see
``dta.model.recurrent.init_decay`` and ``test_strong_decay_conditioning`` for why.
"""
import numpy as np
import pytest
import torch

from dta.batch import Batch
from dta.losses import PPO
from dta.model.hf_cache import cache_kwarg, output_cache
from dta.model.models import build_model, make_truly_float64
from dta.model.recurrent import (
    GDN,
    RECURRENT,
    build_cache,
    init_decay,
    is_hybrid,
    layer_kinds,
    node_state,
)
from dta.planning.cost import CostModel
from dta.tree import PrefixTree
from dta.verify import verify
from tests.cases import EOS, make_records

HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
CHUNK = 64  # the delta rule's chunk (transformers and flash-linear-attention)


def _hf_decay(model, seed: int = 0):
    """HF's own draw of the GDN decay rate A, [0.01, 16] (build_model uses [0.01, 1])."""
    return init_decay(model, seed, 0.01, 16.0)


def hybrid_model(family, dtype="float64", seed=0, hf_decay=False):
    # the tested matrix: 4 layers, GDN / attention / GDN / GDN (dta/model/families.py)
    model = build_model(family, "tiny", dtype=dtype, seed=seed, matrix=True)
    if hf_decay:
        _hf_decay(model, seed)
    if dtype == "float64":
        make_truly_float64(model)
    return model


def hybrid_sequences(vocab: int = 512, seed: int = 0) -> list[np.ndarray]:
    """A 70-token root (past one GDN chunk): every fork below it is at a position that is not a
    multiple of 64; a chain of depth 10, single-token branches, a strict prefix, duplicates,
    a fork exactly at 64, an unrelated tree and a lone sequence."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(3, vocab, int(n))

    root = tok(70)
    chain, seqs = [root], []
    for _ in range(9):  # each level: the chain goes on, a sibling forks off it
        chain.append(np.concatenate([chain[-1], tok(rng.integers(1, 4))]))
        seqs.append(np.concatenate([chain[-2], tok(rng.integers(1, 5)), [EOS]]))
    seqs.append(np.concatenate([chain[-1], tok(3), [EOS]]))
    seqs += [np.concatenate([root, [5]]), np.concatenate([root, [6]])]  # single-token branches
    seqs.append(chain[4].copy())  # a strict prefix of several others
    seqs += [seqs[0].copy(), seqs[0].copy()]  # duplicates
    seqs.append(np.concatenate([root[:CHUNK], tok(4)]))  # a fork at the chunk boundary
    other = tok(9)
    seqs += [np.concatenate([other, tok(4)]), np.concatenate([other, tok(6), [EOS]])]
    seqs.append(tok(5))
    return seqs


def hybrid_batch(model) -> Batch:
    from dta.train import forward_logprobs

    seqs = hybrid_sequences()
    old = [lp.double().numpy() for lp in forward_logprobs(model, Batch.from_records(
        [{"input_ids": s} for s in seqs])).logprobs]
    return Batch.from_records(make_records(seqs, old_logprobs=old))


def test_hybrid_batch_covers_every_case():
    tree = PrefixTree(hybrid_sequences())
    forks = sorted({int(tree.start[u]) for u in range(1, len(tree)) if tree.parent[u] != 0})
    assert any(f > CHUNK for f in forks) and all(f % CHUNK for f in forks if f != CHUNK)
    assert CHUNK in forks
    assert tree.stats().depth >= 8
    assert any(tree.length(u) == 1 for u in range(1, len(tree)))  # single-token branches
    assert any(len(e) >= 3 for e in tree.ending)  # duplicates
    assert any(len(tree.ending[u]) and tree.children[u] for u in range(1, len(tree)))  # prefix
    assert len(tree.children[0]) == 3


@pytest.mark.parametrize("family", HYBRID)
def test_state_continuation_is_exact(family):
    """A sequence run chunk by chunk from the previous chunk's final (conv, recurrent) state
    and K/V equals the whole-sequence forward (float64; cuts at 1, 13, 63, 64, 65, 129 tokens:
    inside and across GDN chunks, single tokens, fewer tokens than the conv kernel)."""
    model = hybrid_model(family)
    assert is_hybrid(model)
    kinds = layer_kinds(model.config)
    assert kinds.count(RECURRENT) == 3
    ids = torch.as_tensor(np.random.default_rng(0).integers(3, 512, 150))
    with torch.no_grad():
        full = model(ids[None]).logits[0]
        cuts, outs, path, s = [1, 2, 13, 63, 64, 65, 66, 129, 150], [], [], 0
        for e in cuts:
            data = None
            if path:
                data = [p[-1] if k == RECURRENT else tuple(torch.cat([x[j] for x in p], 2)
                                                           for j in (0, 1))
                        for k, p in zip(kinds, zip(*path))]
            cache = build_cache(kinds, data, s)
            out = model.model(input_ids=ids[None, s:e], position_ids=torch.arange(s, e)[None],
                              use_cache=True, **{cache_kwarg(type(model.model).forward): cache})
            outs.append(model.lm_head(out.last_hidden_state[0]))
            path.append([node_state(layer, s, e, "t") if k == RECURRENT else
                         (layer.keys[:, :, s:], layer.values[:, :, s:])
                         for k, layer in zip(kinds, output_cache(out).layers)])
            s = e
    err = float((torch.cat(outs) - full).abs().max() / full.abs().max())
    assert err <= 1e-13, err


@pytest.mark.parametrize("policy", ["retain", "recompute"])
@pytest.mark.parametrize("family", HYBRID)
def test_float64_dfs_equals_per_sequence(family, policy):
    model = hybrid_model(family)
    batch = hybrid_batch(model)
    report = verify(model, batch, PPO(eps_clip=0.2, dual_clip=3.0), policy=policy, logits_chunk=7)
    assert report.truly_float64 and report.tree_depth >= 8
    for err in ("logprobs", "loss", "grad", "params", "update"):
        assert getattr(report, f"{err}_rel_err") <= 1e-10, (err, report)
    assert report.max_live_graphs <= (report.tree_depth if policy == "retain" else 1)


def test_forward_walk_equals_full_forward():
    """The forward-only walk (log-probs for PPO's old/prox) forks states too."""
    from dta.reference import sequence_logprobs
    from dta.train import forward_logprobs

    model = hybrid_model("qwen3_5")
    seqs = hybrid_sequences()
    lp = forward_logprobs(model, Batch.from_records([{"input_ids": s} for s in seqs])).logprobs
    with torch.no_grad():
        for s, got in zip(seqs, lp):
            want, _ = sequence_logprobs(model, s)
            assert float((got.double() - want).abs().max()) <= 1e-10


def test_float32_dfs_equals_per_sequence():
    model = hybrid_model("qwen3_5_moe", dtype="float32")
    report = verify(model, hybrid_batch(model), PPO(eps_clip=0.2), policy="recompute")
    for err in ("logprobs", "loss", "grad", "params"):
        assert getattr(report, f"{err}_rel_err") <= 1e-4, report


def test_strong_decay_conditioning():
    """With HF's A in [0.01, 16], the decay parameters' tiny gradients carry the chunked
    kernel's rounding (~1e-10 relative; ~5e-12 between HF's own chunked and token-by-token
    kernels on the same whole sequences); log-probs and the loss stay at round-off."""
    model = hybrid_model("qwen3_5", hf_decay=True)
    report = verify(model, hybrid_batch(model), PPO(eps_clip=0.2, dual_clip=3.0))
    assert report.logprobs_rel_err <= 1e-12 and report.loss_rel_err <= 1e-12
    assert report.grad_rel_err <= 1e-8, report


def test_layer_kinds_refuse_unknown_mix():
    import transformers

    cfg = transformers.Qwen3_5TextConfig(num_hidden_layers=2,
                                         layer_types=[GDN, "sliding_attention"])
    with pytest.raises(ValueError, match="sliding_attention"):
        layer_kinds(cfg)
    with pytest.raises(ValueError, match="at least one"):
        layer_kinds(transformers.Qwen3_5TextConfig(num_hidden_layers=2, layer_types=[GDN, GDN]))


def test_cost_model_gdn_linear_in_tokens():
    """Only the full-attention layers have attention pairs; GDN layers cost per token."""
    hybrid = build_model("qwen3_5", "tiny", dtype="float32", matrix=True).config
    plain = build_model("qwen3", "tiny", dtype="float32", num_hidden_layers=4).config
    h, p = CostModel.from_config(hybrid), CostModel.from_config(plain)
    heads, head_dim = hybrid.num_attention_heads, hybrid.head_dim
    assert h.attention == 3 * 4 * 1 * heads * head_dim  # 1 full-attention layer of 4
    assert p.attention == 3 * 4 * 4 * heads * head_dim
    assert h.token > 0


def test_treemask_refuses_recurrence():
    from experiments.bench.modes import run_mode

    model = hybrid_model("qwen3_5", dtype="float32")
    batch = Batch.from_records(make_records(hybrid_sequences()[:3]))
    with pytest.raises(ValueError, match="recurrent"):
        run_mode("treemask", model, batch, PPO(eps_clip=0.2))


def test_cli_verify_family(capsys):
    """`dta verify --family qwen3_5 --dtype float64 --packing subtrees --pack-tokens 96` (tiny:
    one GDN and one attention layer, the τ²-airline tiny batch) passes at 1e-10, in packs."""
    import json

    from dta_cli.main import main

    code = main(["verify", "--family", "qwen3_5", "--dtype", "float64", "--packing", "subtrees",
                 "--pack-tokens", "96", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["passed"] and report["max_rel_err"] <= 1e-10
    assert report["truly_float64"] and report["sharing_ratio"] > 1.5
    assert report["packing"] == "subtrees" and report["pack_tokens"] == 96
    assert report["packs"] < report["nodes"]


def test_packs_walk_recurrent_models_in_packs():
    """Hybrids are packed like dense models: 'auto' plans fewer packs than nodes (siblings as
    rows of one call, chains in one call), and every pack policy is accepted."""
    from dta.walk import Walker

    model = hybrid_model("qwen3_5", dtype="float32")
    tree = PrefixTree(hybrid_sequences())
    for packing in ("node", "siblings", "subtrees", "auto", "tree"):
        assert Walker(model, packing=packing).options.packing == packing
    plan = Walker(model, packing="auto").plan(tree)
    assert len(plan) < len(tree) - 1 and plan.stats()["masked_packs"] >= 1

"""Every benchmark mode is exact: its gradient equals one-sequence-at-a-time training
(dta.reference.unpacked_gradients) to 1e-10 in true float64 on a tiny model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dta import Batch, build_model, make_loss, make_truly_float64
from dta.reference import unpacked_gradients
from experiments.bench.modes import MODES, microbatches, pack_tree, run_mode, tree_packs

VOCAB = 512


def tree_batch(seed: int = 0) -> Batch:
    """Two trees: a shared prompt with forks at several depths, a fork inside the trainable
    part, a strict prefix, a duplicate, unequal lengths; loss mask 0 on the prompt."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(3, VOCAB, n)

    prompt, other = tok(14), tok(9)
    mid = np.concatenate([prompt, tok(5)])
    seqs = [np.concatenate([prompt, tok(7)]), np.concatenate([prompt, tok(3)]),
            np.concatenate([mid, tok(6)]), np.concatenate([mid, tok(2)]),
            np.concatenate([mid, [7], tok(4)]), np.concatenate([mid, [7], tok(9)]),
            mid.copy(), np.concatenate([other, tok(5)]), np.concatenate([other, tok(11)])]
    seqs.append(seqs[2].copy())
    recs = []
    for s in seqs:
        mask = np.ones(len(s))
        mask[:12 if len(s) > 20 else 6] = 0
        recs.append(dict(input_ids=s, loss_mask=mask, advantages=rng.normal(size=len(s)),
                         logprobs=-rng.random(len(s)) * 6))
    return Batch.from_records(recs)


def flat_grad(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is fastest


@pytest.fixture(scope="module")
def model64():
    model = build_model("qwen3", "tiny", dtype="float64", seed=3)
    make_truly_float64(model)
    return model


@pytest.fixture(scope="module")
def batch():
    return tree_batch()


CPU_MODES = [m for m in MODES if m != "treemask-flex"]  # FlexAttention: no CPU backward
OPTS = [dict(), dict(pad_batch=3, microbatch_tokens=64, tree_tokens=30, logits_chunk=7,
                    pack_tokens=16, head_rows=5),
        dict(packing="subtrees", pack_tokens=24, logits_chunk=5),
        dict(packing="tree")]


@pytest.mark.parametrize("loss_name", ["ppo", "nll"])
def test_modes_match_unpacked_float64(model64, batch, loss_name):
    loss = make_loss(loss_name)
    model64.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model64, batch, loss)
    g_ref = flat_grad(model64).clone()
    assert g_ref.norm() > 0
    for opts in OPTS:
        for mode in CPU_MODES:
            model64.zero_grad(set_to_none=True)
            value, calls = run_mode(mode, model64, batch, loss, **opts)
            assert calls["forward_calls"] >= 1 and calls["backward_calls"] >= 1, (mode, calls)
            err = float((flat_grad(model64) - g_ref).norm() / g_ref.norm())
            assert err <= 1e-10, f"{mode} {opts}: relative gradient error {err:.2e}"
            assert abs(value - ref.loss) <= 1e-10 * max(1.0, abs(ref.loss)), (mode, value, ref.loss)


def test_packing_helpers(batch):
    lens = batch.lengths
    groups = microbatches(lens, None)
    assert all(len(g) == 1 for g in groups) and sorted(sum(groups, [])) == list(range(len(lens)))
    for budget in (40, 64, 200):
        for g in microbatches(lens, budget):
            assert len(g) == 1 or len(g) * lens[g].max() <= budget
    packs = tree_packs(batch.input_ids, 30)
    assert len(packs) > 2 and sorted(sum(packs, [])) == list(range(len(batch)))
    assert len(tree_packs(batch.input_ids, 10**6)) == 1


def test_pack_tree_layout(batch):
    packed = pack_tree(batch, list(range(len(batch))))
    for i, rows in packed.rowmaps.items():
        # every sequence is spelled by its rows, at its own positions 0..n-1
        assert np.array_equal(packed.ids[rows], batch.input_ids[i])
        assert np.array_equal(packed.pos[rows], np.arange(len(rows)))
        mask = packed.dense_mask("cpu")[0, 0].numpy()
        # row q of the sequence sees exactly the sequence's rows up to q
        sub = mask[np.ix_(rows, rows)]
        assert np.array_equal(sub, np.tril(np.ones_like(sub)))
        assert mask[rows].sum() == len(rows) * (len(rows) + 1) // 2


def test_packed_flops_and_calls(model64, batch):
    """The packed DFS modes make fewer calls than the walk node by node; their FLOPs count
    the masked-away pairs of packs with branches, so they sit between the exact tree's and
    the dense tree mask's."""
    from dta.model.models import build_config
    from experiments.bench.flops import summary

    loss = make_loss("nll")
    calls = {m: run_mode(m, model64, batch, loss, pack_tokens=24)[1]
             for m in ("dfs-node", "dfs-retain")}
    model64.zero_grad(set_to_none=True)
    assert calls["dfs-node"]["forward_calls"] == calls["dfs-node"]["nodes"]
    assert calls["dfs-node"]["head_calls"] >= calls["dfs-retain"]["head_calls"] + 2
    assert calls["dfs-retain"]["forward_calls"] < calls["dfs-node"]["forward_calls"]
    s = summary(batch, build_config("qwen3", "tiny"), ["microbatch", "treemask", "dfs-node",
                                                       "dfs-retain", "dfs-recompute"],
                dict(pack_tokens=24))
    f = s["flops"]
    assert s["ideal_flops"] == f["dfs-node"] < f["dfs-retain"] < f["dfs-recompute"]
    assert f["dfs-retain"] < f["treemask"] and s["ideal_speedup"] > 1

"""Blocks (``dta/planning/blocks.py``): a node longer than ``block_tokens`` is walked as a chain
of pieces. float64 against one-sequence-at-a-time training (log-probs, loss, every gradient,
one AdamW update) <= 1e-10: every attention family of the support matrix with blocks shorter
than its sliding window, packs on, both memory policies (a cheap sweep); deeper cases on a
few families (a block of one token, blocks shorter and longer than the window, boundaries
inside nodes that fork at their end, masked packs inside a block); the hybrid (Gated
DeltaNet) families with blocks not at multiples of the delta rule's 64-token chunk; and the
walk's counters: under recompute no call and no live graph exceeds one block."""
import copy

import numpy as np
import pytest
import torch

from dta.model.families import WINDOW
from dta.model.models import build_model, make_truly_float64
from dta.options import NO_CUT, WalkOptions
from dta.planning.blocks import cut_blocks
from dta.planning.index import PlanningError
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients, forward_logprobs
from dta.tree import PrefixTree
from dta.verify import ZERO_FLOOR, _rel, _whole_norm, verify, worst
from tests.cases import make_records
from tests.test_families import ATTENTION_FAMILIES, LOSS, window_sequences

TOL = 1e-10


# ---------------------------------------------------------------------- metadata --
def _fork_nodes(tree):
    return [u for u in range(1, len(tree)) if len(tree.children[u]) > 1]


@pytest.mark.parametrize("block", [1, 3, 5, 13])
def test_cut_tree_is_the_tree_in_pieces(block):
    tree = PrefixTree(window_sequences())
    cut, origin = cut_blocks(tree, block)
    assert len(cut) > len(tree) and origin[0] == 0
    lengths = cut.end - cut.start
    assert lengths[1:].max() <= block and lengths[1:].min() >= 1
    for v in range(1, len(cut)):
        u = int(origin[v])
        assert tree.start[u] <= cut.start[v] < cut.end[v] <= tree.end[u]
        np.testing.assert_array_equal(cut.tokens(v), tree.sequences[tree.through(u)[0]][
            cut.start[v]:cut.end[v]])
        np.testing.assert_array_equal(np.sort(cut.through(v)), np.sort(tree.through(u)))
        p = int(cut.parent[v])
        if origin[p] == u:  # an inner boundary: the previous piece is the parent
            assert cut.end[p] == cut.start[v] and cut.children[p] == [v] and not len(cut.ending[p])
        else:  # the node's first piece hangs from the last piece of the node's parent
            assert origin[p] == tree.parent[u] and cut.end[p] == tree.start[u]
    np.testing.assert_array_equal(origin[cut.leaf_of()], tree.leaf_of())
    # a node that forks at its end is cut inside: its children hang from its last piece
    cut_forks = [u for u in _fork_nodes(tree) if tree.length(u) > block]
    assert cut_forks
    for u in cut_forks:
        last = int(np.flatnonzero(origin == u)[-1])
        assert sorted(origin[cut.children[last]]) == sorted(tree.children[u])


def test_no_cut_and_bad_block_values():
    tree = PrefixTree(window_sequences())
    for block in (None, 0, 10_000):
        cut, origin = cut_blocks(tree, block)
        assert cut is tree and np.array_equal(origin, np.arange(len(tree)))
    for bad in (-1, 2.5, True, "8"):  # refused by the walk's settings (dta/options.py)
        with pytest.raises(ValueError, match="block_tokens"):
            WalkOptions(block_tokens=bad)


# --------------------------------------------------------------- float64 exactness --
def _grads(model) -> dict:
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}


def _adamw_update(model) -> dict:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8, weight_decay=0.01).step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


class Reference:
    """One-sequence-at-a-time training of a batch, once: log-probs, loss, gradients and the
    AdamW update, for comparing several block settings against."""

    def __init__(self, model, batch):
        self.model, self.batch = model, batch
        ref_model = copy.deepcopy(model)
        make_truly_float64(ref_model)
        ref_model.zero_grad(set_to_none=True)
        self.result = unpacked_gradients(ref_model, batch, LOSS)
        self.grads = _grads(ref_model)
        self.update = _adamw_update(ref_model)

    def errors(self, **walk_kw) -> tuple[dict, object]:
        model = copy.deepcopy(self.model)
        make_truly_float64(model)
        model.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, self.batch, LOSS, logits_chunk=7, record=True,
                                   **walk_kw)
        ref = self.result
        g_floor = ZERO_FLOOR * _whole_norm(self.grads.values())
        u_floor = _whole_norm(self.update.values())
        grads, update = _grads(model), _adamw_update(model)
        errs = dict(
            loss=abs(res.loss - ref.loss) / abs(ref.loss),
            logprobs=max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs)),
            grad=worst(_rel(grads[n], g, g_floor) for n, g in self.grads.items()),
            update=worst(_rel(update[n], d, u_floor if float(self.grads[n].norm()) < g_floor else 0.0)
                         for n, d in self.update.items()))
        return errs, res.walk


def window_batch(model):
    seqs = window_sequences()
    lp = forward_logprobs(model, _plain(seqs)).logprobs
    from dta.batch import Batch
    return Batch.from_records(make_records(seqs, prompt=3, old_logprobs=[x.double().numpy() for x in lp]))


def _plain(seqs):
    from dta.batch import Batch
    return Batch.from_records([{"input_ids": s} for s in seqs])


def _model(family, seed=0):
    model = build_model(family, "tiny", dtype="float64", seed=seed, matrix=True)
    make_truly_float64(model)
    return model


def _sweep():
    """(family, policy) pairs: the default suite alternates the policy over the families
    (each policy on half of them); the other half of the pairs is marked slow."""
    out = []
    for i, family in enumerate(ATTENTION_FAMILIES):
        for j, policy in enumerate(("retain", "recompute")):
            marks = () if (i + j) % 2 == 0 else (pytest.mark.slow,)
            out.append(pytest.param(family, policy, marks=marks, id=f"{family}-{policy}"))
    return out


@pytest.mark.parametrize("family,policy", _sweep())
def test_every_family_blocks_shorter_than_the_window_exact(family, policy):
    """Blocks of 6 (< the window of 8) with packs on (auto, capped at the block); the
    forward-only walk's log-probs too."""
    model = _model(family)
    batch = window_batch(model)
    ref = Reference(model, batch)
    errs, walk = ref.errors(policy=policy, block_tokens=6, packing="auto", pack_tokens=64)
    assert max(errs.values()) <= TOL, (family, policy, errs)
    assert walk.plan["blocks_cut"] > 0 and walk.max_call_tokens <= 6
    fwd = forward_logprobs(model, batch, block_tokens=6, logits_chunk=5)
    assert fwd.max_call_tokens <= 6
    err = max(float((a - b).abs().max()) for a, b in zip(fwd.logprobs, ref.result.logprobs))
    assert err <= TOL, (family, err)


def test_mistral_has_the_tested_window():
    assert getattr(_model("mistral").config, "sliding_window", None) == WINDOW == 8


@pytest.fixture(scope="module")
def mistral_ref():
    model = _model("mistral")
    return Reference(model, window_batch(model))


@pytest.mark.parametrize("block,policy", [
    (1, "recompute"), pytest.param(1, "retain", marks=pytest.mark.slow),
    (5, "retain"), (5, "recompute"), (13, "retain"), (13, "recompute")])
def test_blocks_of_one_token_and_around_the_window_exact(mistral_ref, block, policy):
    """A sliding window of 8: blocks of 1 token, 5 (< window) and 13 (> window), cut inside
    the 14-token node that forks at its end, packs on."""
    errs, walk = mistral_ref.errors(policy=policy, block_tokens=block, packing="auto",
                                    pack_tokens=32)
    assert max(errs.values()) <= TOL, (block, policy, errs)
    assert walk.max_call_tokens <= block
    if policy == "recompute":
        assert walk.max_graph_tokens <= block and walk.max_live_graphs == 1
    if block == 13:  # sibling leaves share a masked pack inside one block
        assert walk.masked_packs > 0


@pytest.mark.parametrize("packing", [pytest.param("node", marks=pytest.mark.slow),
                                     pytest.param("siblings", marks=pytest.mark.slow),
                                     "subtrees"])
def test_blocks_under_every_pack_policy_exact(mistral_ref, packing):
    errs, walk = mistral_ref.errors(policy="recompute", block_tokens=7, packing=packing,
                                    pack_tokens=7)
    assert max(errs.values()) <= TOL, (packing, errs)
    assert walk.max_call_tokens <= 7


def test_verify_takes_blocks():
    """``dta.verify`` passes the walker options through: the full report (AdamW update
    included) with a block of 4 on Gemma 2 (window, soft-capping)."""
    model = _model("gemma2")
    report = verify(model, window_batch(model), LOSS, policy="recompute", block_tokens=4,
                    logits_chunk=7)
    assert report.max_rel_err() <= TOL, report


# ------------------------------------------------------------------- hybrid (GDN) --
def _hybrid_sequences(vocab=512, seed=3):
    """A 100-token root (past one 64-token chunk) forking into a 60-token and a 45-token
    branch, and a strict prefix."""
    rng = np.random.default_rng(seed)
    root = rng.integers(3, vocab, 100)
    a = np.concatenate([root, rng.integers(3, vocab, 60)])
    return [a, np.concatenate([root, rng.integers(3, vocab, 45)]), a[:130].copy()]


@pytest.mark.parametrize("policy", [pytest.param("retain", marks=pytest.mark.slow), "recompute"])
def test_hybrid_blocks_off_the_chunk_grid_exact(policy):
    """Qwen3.5 (GDN + attention): blocks of at most 37 tokens (the 100-token root in pieces
    of 33, 33, 34), so pieces start inside the first 64-token chunk and beyond it, none at a
    multiple of 64, and the recurrent states carry over between pieces exactly."""
    model = build_model("qwen3_5", "tiny", dtype="float64", seed=0, matrix=True)
    make_truly_float64(model)
    seqs = _hybrid_sequences()
    lp = forward_logprobs(model, _plain(seqs)).logprobs
    from dta.batch import Batch
    batch = Batch.from_records(make_records(seqs, prompt=20, old_logprobs=[x.double().numpy() for x in lp]))
    cut, _ = cut_blocks(PrefixTree(seqs), 37)
    starts = {int(s) for s in cut.start[1:]}
    assert min(s for s in starts if s) < 64 < max(starts) and not any(s % 64 == 0 for s in starts if s)
    report = verify(model, batch, LOSS, policy=policy, block_tokens=37, logits_chunk=16)
    assert report.max_rel_err() <= TOL, report


# ------------------------------------------------------------------------ counters --
def test_recompute_never_holds_more_than_one_block():
    """A 300-token root and four 200-token leaves, blocks of 64: under recompute no call,
    and no graph alive, is longer than a block, one graph at a time; without blocks the
    largest call is a whole node. Under retain the pieces on the path keep their graphs."""
    rng = np.random.default_rng(0)
    root = rng.integers(3, 500, 300)
    seqs = [np.concatenate([root, rng.integers(3, 500, 200)]) for _ in range(4)]
    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    batch = _plain(seqs)
    from dta.losses import NLL
    walks = {}
    for block in (64, NO_CUT):
        for policy in ("recompute", "retain"):
            model.zero_grad(set_to_none=True)
            walks[block, policy] = accumulate_gradients(model, batch, NLL(), policy=policy,
                                                        block_tokens=block).walk
    w = walks[64, "recompute"]
    assert w.max_call_tokens <= 64 and w.max_graph_tokens <= 64 and w.max_live_graphs == 1
    assert w.plan["max_pack_tokens"] <= 64 and w.recomputed_tokens > 0
    assert walks[NO_CUT, "recompute"].max_call_tokens >= 300  # the root in one call
    assert walks[NO_CUT, "recompute"].max_graph_tokens >= 300
    r = walks[64, "retain"]
    assert r.max_call_tokens <= 64 and r.max_graph_tokens >= 300  # the path's pieces
    assert r.max_live_graphs > 1


def test_tree_policy_longer_than_a_block_is_refused():
    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    batch = _plain(window_sequences())
    from dta.losses import NLL
    with pytest.raises(PlanningError, match="block_tokens=16"):
        accumulate_gradients(model, batch, NLL(), packing="tree", block_tokens=16)
    res = accumulate_gradients(model, batch, NLL(), packing="tree", block_tokens=0)
    assert res.walk.packs == 1


# ------------------------------------------------------------------------ layering --
def test_walk_sits_below_the_self_check_and_the_trainer():
    """dta/walk.py imports neither dta.selfcheck nor dta.train (not even lazily): the
    self-check walks with the Walker, and the trainer runs the self-check before it builds
    one (``dta.train.checked_walker``)."""
    import ast
    import pathlib

    import dta.walk

    tree = ast.parse(pathlib.Path(dta.walk.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"dta.selfcheck", "dta.train", "dta.verify"}, imported
    import dta.selfcheck
    src = pathlib.Path(dta.selfcheck.__file__).read_text()
    assert "dta.train" not in src and "from dta.walk import Walker" in src


def test_dfs_trainer_takes_block_tokens():
    from dta.losses import NLL
    from dta.train import DFSTrainer

    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    trainer = DFSTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), NLL(),
                         policy="recompute", block_tokens=4)
    res = trainer.step(_plain(window_sequences()))
    assert res.updated and res.walk.max_call_tokens <= 4 and res.walk.plan["block_tokens"] == 4

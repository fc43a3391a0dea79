"""Hybrid models (Gated DeltaNet + attention) in packs: every packing x both memory policies
equals one-sequence-at-a-time training in float64 (log-probs, loss, every gradient, one AdamW
update), and the GDN
pack plan (dta/model/gdn.py) agrees with a token-by-token reading of the pack's tree.

Default suite: qwen3_5 on a small batch that has every structural case; the MoE and Qwen3-Next
families run the same matrix under ``-m slow`` (and through ``verify``, AdamW update included,
in tests/test_hybrid.py with the default plan).
"""
import numpy as np
import pytest
import torch

from dta.batch import Batch
from dta.losses import PPO
from dta.model.gdn import open_nodes, plan_recurrence
from dta.planning.packs import PACKINGS, PackCost, plan_packs
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients
from dta.tree import PrefixTree
from tests.cases import EOS, make_records
from tests.test_families_packs import _grads, _worst
from tests.test_hybrid import CHUNK, hybrid_model

LOSS = PPO(eps_clip=0.2, dual_clip=3.0)
CAP = 96  # tokens per pack: siblings, subtrees and auto plan differently on this batch


def pack_sequences(vocab: int = 512, seed: int = 3) -> list[np.ndarray]:
    """A 70-token root (forks past the first 64-token chunk, not on its boundary); a chain of
    strict prefixes 9 nodes deep; single-token branches next to a 150-token sibling (very
    unequal lengths, a branch crossing chunk boundaries inside a pack); duplicates; a second tree."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(3, vocab, int(n))

    root = tok(70)
    seqs, cur = [], root
    for k in range(8):  # each a strict prefix of the next: depth 9
        cur = np.concatenate([cur, tok(1 + k % 3)])
        seqs.append(cur)
    seqs.append(np.concatenate([cur, tok(2), [EOS]]))
    seqs += [np.concatenate([root, [5]]), np.concatenate([root, [6]])]  # single-token branches
    seqs.append(np.concatenate([root, tok(150), [EOS]]))  # their very long sibling
    seqs += [seqs[2].copy(), seqs[2].copy()]  # duplicates (of a strict prefix)
    other = tok(9)
    seqs += [np.concatenate([other, tok(3)]), np.concatenate([other, tok(40), [EOS]])]
    return seqs


def test_pack_batch_covers_every_case():
    tree = PrefixTree(pack_sequences())
    forks = sorted({int(tree.start[u]) for u in range(1, len(tree)) if tree.parent[u] != 0})
    assert forks and all(f % CHUNK for f in forks) and max(forks) > CHUNK
    assert tree.stats().depth >= 8
    assert any(tree.length(u) == 1 for u in range(1, len(tree)))
    root = next(u for u in tree.children[0] if tree.length(u) == 70)
    lengths = [tree.length(c) for c in tree.children[root]]
    assert max(lengths) >= 100 * min(lengths)  # siblings of very unequal lengths
    assert any(len(e) >= 3 for e in tree.ending)  # duplicates
    assert any(len(tree.ending[u]) and tree.children[u] for u in range(1, len(tree)))


def _batch(model) -> Batch:
    from dta.train import forward_logprobs

    seqs = pack_sequences()
    old = [lp.double().numpy() for lp in forward_logprobs(model, Batch.from_records(
        [{"input_ids": s} for s in seqs]), packing="tree").logprobs]
    return Batch.from_records(make_records(seqs, old_logprobs=old))


@pytest.fixture(scope="module")
def reference(request):
    family = request.param
    model = hybrid_model(family)
    batch = _batch(model)
    model.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model, batch, LOSS)
    return family, model, batch, ref, _grads(model)


def _adamw_update(model, grads: dict) -> dict:
    """One AdamW step (dta.verify's settings) from the model's parameters with ``grads``: the
    change of each parameter."""
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    torch.optim.AdamW(params.values(), lr=1e-3, eps=1e-8, weight_decay=0.01).step()
    return {n: p.detach() - q.detach() for (n, p), q in zip(params.items(), model.parameters())}


def _check(reference, packing):
    family, model, batch, ref, g_ref = reference
    tree = PrefixTree(batch.input_ids)
    for policy in ("retain", "recompute"):
        model.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, batch, LOSS, policy=policy, packing=packing,
                                   pack_tokens=CAP, logits_chunk=7, record=True)
        case = (family, packing, policy)
        assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss), case
        lp = max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs))
        assert lp <= 1e-10, case
        g_dfs = _grads(model)
        assert _worst(g_dfs, g_ref) <= 1e-10, case
        assert _worst(_adamw_update(model, g_dfs), _adamw_update(model, g_ref)) <= 1e-10, case
        if packing == "node":
            assert res.walk.packs == len(tree) - 1, case
        else:  # hybrids are packed: several nodes per call
            assert res.walk.packs < res.walk.nodes, case
        if packing == "tree":
            assert res.walk.packs == 1 and res.walk.masked_packs == 1, case


@pytest.mark.parametrize("reference", ["qwen3_5"], indirect=True)
@pytest.mark.parametrize("packing", PACKINGS)
def test_qwen3_5_every_packing_float64(reference, packing):
    _check(reference, packing)


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["qwen3_5_moe", "qwen3_next"], indirect=True)
@pytest.mark.parametrize("packing", PACKINGS)
def test_hybrid_families_every_packing_float64(reference, packing):
    _check(reference, packing)


# ------------------------------------------------------------------ the GDN plan --
def _path_rows(layout, r):
    """Rows of the pack on row r's root path up to r, read from the layout's ancestry."""
    node = layout.node
    return [k for k in range(layout.tokens) if layout.enter[node[k]] <= layout.enter[node[r]]
            < layout.exit[node[k]] and layout.positions[k] <= layout.positions[r]]


@pytest.mark.parametrize("cap", [40, 96, 100000])
def test_plan_recurrence_follows_the_tree(cap):
    """Every row's conv window is the last `kernel` inputs on its root path (pack rows, then the
    initial state's columns); every row sits in exactly one chunk slot; a chunk's state comes
    from the step before; handed-on nodes' windows end at their last row."""
    tree = PrefixTree(pack_sequences())
    plan = plan_packs(tree, "auto", cap=cap, cost=PackCost(chunk_step=2.0))
    K = 4
    for i in range(len(plan)):
        layout = plan.layout(i)
        rp = plan_recurrence(layout, K, 16)
        for r in range(layout.tokens):
            window = (list(range(K)) + [K + k for k in _path_rows(layout, r)])[-K:]
            assert list(rp.conv_index[r]) == window, (i, r)
        slots = rp.row_slot
        assert sorted(slots) == sorted(np.flatnonzero(rp.chunk_rows.reshape(-1) < layout.tokens))
        assert np.array_equal(rp.chunk_rows.reshape(-1)[slots], np.arange(layout.tokens))
        assert sum(hi - lo for lo, hi in rp.steps) == rp.chunks
        for s, src in enumerate(rp.sources[1:], 1):
            if src is not None:
                assert src.max() < rp.steps[s - 1][1] - rp.steps[s - 1][0]
        hands = open_nodes(layout)
        assert len(rp.state_index) == len(hands) == len(rp.final_order)
        for u, idx in zip(hands, rp.state_index):
            assert idx[-1] == K + layout.offsets[u + 1] - 1
        # a one-path pack is one chunk chain: as many steps as chunks
        if layout.chain and len(layout.tree_nodes) == 1:
            assert len(rp.steps) == rp.chunks


def test_scan_steps_fewer_than_node_chunks():
    """Packing siblings as rows: the scan's steps follow the deepest chain of chunks, not the
    number of chunks (what a node-by-node walk loops over)."""
    tree = PrefixTree(pack_sequences())
    layout = plan_packs(tree, "tree").layout(0)
    rp = plan_recurrence(layout, 4, 16)
    assert len(rp.steps) < rp.chunks


def test_gdn_cost_terms():
    """The planner's cost of a hybrid pack has its GDN per-call and per-chunk-step terms."""
    model = hybrid_model("qwen3_5", dtype="float32")
    hybrid = PackCost.from_config(model.config)
    plain = PackCost.from_config({**model.config.to_dict(), "layer_types": None})
    assert hybrid.chunk_step > 0 and plain.chunk_step == 0 and hybrid.call > plain.call
    assert hybrid.of(65, 0, True) - hybrid.of(64, 0, True) > hybrid.token  # a new chunk step


def test_self_check_runs_the_pack_path():
    """The walker's self-check (two branches of a shared prefix) trains the hybrid through its
    packs and passes; the model's own forward is unchanged after a walk."""
    from dta.selfcheck import self_check

    model = hybrid_model("qwen3_5", dtype="float32")
    report = self_check(model)
    assert report.passed, report
    ids = torch.arange(3, 40)[None]
    before = model(ids).logits
    accumulate_gradients(model, Batch.from_records(make_records([np.arange(3, 30), np.arange(3, 25)])),
                         LOSS, self_check=False)
    assert all("forward" not in vars(m) for m in model.modules())
    assert torch.equal(model(ids).logits, before)

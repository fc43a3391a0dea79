"""Packs: the plan (metadata), the per-pack mask, and the packed walk's exactness.

Every packing (node by node, sibling leaves, subtrees, the cost model's choice, the whole
tree as one masked pack) under both memory policies trains the hard batch to float64
round-off against one-sequence-at-a-time training."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dta.losses import NLL, PPO
from dta.model.attention import native_gqa
from dta.model.models import build_model, make_truly_float64
from dta.model.packmask import dense_mask, pack_mask
from dta.planning.index import PlanningError
from dta.planning.packs import PACKINGS, PackCost, plan_packs
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients, forward_logprobs
from dta.tree import PrefixTree
from tests.cases import SEQUENCE_LOSS, hard_batch, hard_sequences

CAP = 20  # small enough that subtrees, siblings and auto differ on the hard batch


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is fastest


@pytest.fixture(scope="module")
def tree():
    return PrefixTree(hard_sequences())


def seed_mask(tree: PrefixTree, nodes) -> np.ndarray:
    """Seed 000's tree mask over the tokens of ``nodes`` (pre-order), from root paths alone:
    token k is visible to token q iff k's node is on q's root path and pos k <= pos q."""
    toks = [(u, p) for u in nodes for p in range(tree.start[u], tree.end[u])]
    paths = {u: set(tree.path(u)) for u in nodes}
    return np.array([[ku in paths[qu] and kp <= qp for ku, kp in toks] for qu, qp in toks])


# --------------------------------------------------------------------------- plans --
@pytest.mark.parametrize("packing", PACKINGS)
def test_plan_partitions_the_tree(tree, packing):
    plan = plan_packs(tree, packing, cap=CAP)
    nodes = sorted(u for p in plan.packs for u in p.nodes)
    assert nodes == list(range(1, len(tree)))  # every node in exactly one pack
    order = [i for kind, i in plan.walk() if kind == "push"]
    assert sorted(order) == list(range(len(plan)))
    for p in plan.packs:
        assert p.tokens == sum(tree.length(u) for u in p.nodes)
        if packing != "tree" and len(p.nodes) > 1:
            assert p.tokens <= CAP
        # roots hang from the pack's parent; the rest from nodes inside the pack
        assert all(int(tree.parent[u]) in set(p.nodes) | {p.parent} for u in p.nodes)
        for c in p.children:  # a pack below hangs from an open node of this one
            assert plan.packs[c].parent in p.open and plan.packs[c].parent in p.nodes
    if packing == "node":
        assert all(len(p.nodes) == 1 for p in plan.packs)
    if packing == "tree":
        assert len(plan) == 1 and not plan.packs[0].chain
    if packing == "siblings":  # several leaves share a pack, internal nodes stay alone
        assert any(len(p.nodes) > 1 for p in plan.packs)
        for p in plan.packs:
            assert len(p.nodes) == 1 or all(not tree.children[u] for u in p.nodes)


def test_pack_mask_is_the_seed_mask_restricted(tree):
    for packing in PACKINGS:
        plan = plan_packs(tree, packing, cap=CAP)
        for i, p in enumerate(plan.packs):
            lay = plan.layout(i)
            vis = lay.visible()
            assert vis.shape == (p.tokens, p.prefix + p.tokens)
            assert vis[:, :p.prefix].all()  # the whole cached prefix is visible
            assert np.array_equal(vis[:, p.prefix:], seed_mask(tree, p.nodes))
            assert np.array_equal(dense_mask(lay, "cpu")[0, 0].numpy(), vis)
            assert lay.chain == bool(np.array_equal(vis[:, p.prefix:], np.tril(np.ones_like(vis[:, p.prefix:]))))
            for o in p.open:  # a pack below sees exactly the rows on its root path
                local = int(np.flatnonzero(lay.tree_nodes == o)[0])
                want = [r for u in tree.path(o) if u in p.nodes
                        for r in range(*lay.rows(p.nodes.index(u)).indices(lay.tokens))]
                assert list(lay.path_rows(local)) == want
                assert len(want) + p.prefix == tree.end[o]


def test_sliding_window_mask(tree):
    plan = plan_packs(tree, "tree")
    lay = plan.layout(0)
    w = 5
    m = dense_mask(lay, "cpu", window=w)[0, 0].numpy()
    assert np.array_equal(m, lay.visible() & (lay.positions[:, None] - lay.positions[None, :] < w))
    model = build_model("qwen3", "tiny", layer_types=["sliding_attention", "full_attention"],
                        sliding_window=w, use_sliding_window=True)
    masks = pack_mask(lay, model, "cpu")
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert np.array_equal(masks["sliding_attention"][0, 0].numpy(), m)


def test_cost_model_decides(tree):
    node = plan_packs(tree, "node")
    free_calls = plan_packs(tree, "auto", cap=10**6, cost=PackCost(1.0, 1.0, 0.0))
    assert len(free_calls) == len(node)  # merging only adds masked-away pairs
    dear_calls = plan_packs(tree, "auto", cap=10**6, cost=PackCost(1.0, 1e-3, 1e9))
    assert len(dear_calls) == 1  # calls dominate: everything in one pack
    mid = plan_packs(tree, "auto", cap=CAP)
    assert 1 < len(mid) < len(node)
    with pytest.raises(PlanningError, match="unknown packing"):
        plan_packs(tree, "bogus")
    with pytest.raises(PlanningError, match="cap"):
        plan_packs(tree, "auto", cap=0)


# ------------------------------------------------------------------------ exactness --
@pytest.fixture(scope="module")
def f64():
    model = build_model("qwen3", "tiny", dtype="float64", seed=0)
    make_truly_float64(model)
    batch = hard_batch(model)
    return model, batch


def grads(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters()]


def rel(a, b):
    return max(float((x - y).norm() / y.norm()) if y.norm() > 0 else float((x - y).norm())
               for x, y in zip(a, b))


@pytest.mark.parametrize("loss_name", ["ppo", "sequence"])
def test_every_packing_is_exact_float64(f64, loss_name):
    model, batch = f64
    loss = PPO(eps_clip=0.2, dual_clip=3.0) if loss_name == "ppo" else SEQUENCE_LOSS
    model.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model, batch, loss)
    g_ref = grads(model)
    for packing in PACKINGS:
        for policy in ("retain", "recompute"):
            for head_rows in (None, 0, 5):  # batched head, one head call per pack, tiny cap
                model.zero_grad(set_to_none=True)
                res = accumulate_gradients(model, batch, loss, policy=policy, packing=packing,
                                           pack_tokens=CAP, head_rows=head_rows, logits_chunk=7,
                                           record=loss_name == "ppo")
                case = (packing, policy, head_rows)
                assert rel(grads(model), g_ref) <= 1e-10, case
                assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss), case
                if loss_name == "ppo":
                    lp = max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs))
                    assert lp <= 1e-10, case
                assert res.walk.packs == res.walk.plan["packs"]


def test_batching_cuts_calls(f64):
    model, batch = f64
    counts = {}
    for packing in ("node", "auto", "tree"):
        model.zero_grad(set_to_none=True)
        counts[packing] = accumulate_gradients(model, batch, NLL(), packing=packing,
                                               pack_tokens=CAP).walk.calls()
    n, a, t = counts["node"], counts["auto"], counts["tree"]
    assert n["forward_calls"] == n["nodes"] and n["masked_packs"] == 0
    assert a["forward_calls"] < n["forward_calls"] and a["head_calls"] < n["head_calls"]
    assert a["backward_calls"] < n["backward_calls"]
    assert t["forward_calls"] == t["backward_calls"] == t["head_calls"] == 1


def test_forward_walk_packed_equals_node_by_node(f64):
    model, batch = f64
    a = forward_logprobs(model, batch, packing="node", minmax=True)
    b = forward_logprobs(model, batch, packing="auto", pack_tokens=CAP, minmax=True)
    assert b.packs < a.packs
    for x, y in ((a.logprobs, b.logprobs), (a.entropy, b.entropy), (a.vocab_max, b.vocab_max)):
        assert max(float((p - q).abs().max()) for p, q in zip(x, y)) <= 1e-12


def test_native_gqa_is_exact_and_restored(f64):
    model, batch = f64
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    out = {}
    for gqa in (False, True):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, batch, NLL(), packing="auto", pack_tokens=CAP, native_gqa=gqa)
        out[gqa] = grads(model)
    assert rel(out[True], out[False]) <= 1e-12
    assert model.config._attn_implementation == "sdpa"
    with native_gqa(model):
        assert model.config._attn_implementation == "dta_sdpa"
    assert model.config._attn_implementation == "sdpa"


def test_sliding_window_model_exact_float64():
    """Packs with branches on a model with sliding-window layers: the per-layer-type masks
    honour the window (the reference is the model's own full forward)."""
    model = build_model("qwen3", "tiny", dtype="float64", seed=2, use_sliding_window=True,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    make_truly_float64(model)
    batch = hard_batch(model)
    model.zero_grad(set_to_none=True)
    unpacked_gradients(model, batch, NLL())
    g_ref = grads(model)
    for packing in ("node", "auto", "tree"):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, batch, NLL(), packing=packing, pack_tokens=CAP)
        assert rel(grads(model), g_ref) <= 1e-10, packing


def test_head_skips_the_entropy_pass():
    from dta.batch import Batch
    from dta.model.head import LMHead
    from dta.objective import Objective

    model = build_model("qwen3", "tiny", dtype="float64")
    batch = Batch.from_records([{"input_ids": np.arange(3, 20)}])
    tree = PrefixTree(batch.input_ids)
    obj = Objective(batch, NLL())
    terms = obj.terms(tree, 1, "cpu", torch.float64)
    hidden = torch.randn(tree.length(1), model.config.hidden_size, dtype=torch.float64)
    head = LMHead(model, temperature=1.0, chunk=64)
    out = head.evaluate(hidden, terms, lambda *a: obj.node_loss(terms, *a))
    assert out.entropy is None and out.dhidden is not None
    with_ent = head.evaluate(hidden, terms, entropy=True)
    assert with_ent.entropy is not None and torch.equal(with_ent.logp, out.logp)


def test_flex_mask_rule_equals_dense(tree):
    """The FlexAttention mask_mod (the GPU path) gives the dense mask, windows included."""
    from dta.model.packmask import flex_mask_mod

    plan = plan_packs(tree, "subtrees", cap=CAP)
    for i, p in enumerate(plan.packs):
        lay = plan.layout(i)
        q = torch.arange(lay.tokens)[:, None]
        kv = torch.arange(lay.prefix + lay.tokens)[None, :]
        for window in (None, 4):
            got = flex_mask_mod(lay, "cpu", window)(0, 0, q, kv)
            assert torch.equal(got, dense_mask(lay, "cpu", window)[0, 0]), (i, window)


@pytest.mark.slow
def test_flex_pack_forward_matches_sdpa_cpu(tree):
    """A masked pack over a cached prefix through HF's flex_attention (forward only: no
    FlexAttention backward on CPU; compiles, minutes on a loaded 2-core machine)."""
    from dta.model.attention import path_cache
    from experiments.bench.modes import attention

    model = build_model("qwen3", "tiny", seed=0)
    plan = plan_packs(tree, "subtrees", cap=CAP)
    i = next(i for i, p in enumerate(plan.packs) if not p.chain and p.prefix > 0)
    lay, p = plan.layout(i), plan.packs[i]
    dec = model.get_decoder()
    prefix = torch.as_tensor(np.concatenate([tree.tokens(u) for u in tree.path(p.parent)]))[None]
    ids = torch.as_tensor(np.concatenate([tree.tokens(int(u)) for u in lay.tree_nodes]))[None]
    pos = torch.as_tensor(lay.positions)[None]
    with torch.no_grad():
        cache = dec(input_ids=prefix, use_cache=True).past_key_values
        pieces = [[(layer.keys, layer.values)] for layer in cache.layers]
        out = {}
        for impl in ("sdpa", "flex_attention"):
            with attention(model, impl):
                out[impl] = dec(input_ids=ids, position_ids=pos, use_cache=True,
                                attention_mask=pack_mask(lay, model, "cpu"),
                                cache=path_cache(pieces, 2)).last_hidden_state
    assert (out["sdpa"] - out["flex_attention"]).abs().max() < 1e-5


def test_mask_support_and_single_path_packs(tree):
    """Which models take a tree mask, read from config and decoder; without one the plan has
    single-path packs only (no mask needed), and the walk stays exact."""
    from dta.model.models import build_model as build
    from dta.model.packmask import mask_support

    assert mask_support(build("qwen3", "tiny")) == ({"full_attention": None}, "single")
    win = build("qwen3", "tiny", layer_types=["sliding_attention", "full_attention"],
                sliding_window=6, use_sliding_window=True)
    assert mask_support(win) == ({"sliding_attention": 6, "full_attention": None}, "dict")
    flash = build("qwen3", "tiny")
    flash.config._attn_implementation = "flash_attention_2"
    assert mask_support(flash)[0] is None
    plan = plan_packs(tree, "auto", cap=CAP, branches=False)
    assert all(p.chain for p in plan.packs)
    assert len(plan) < len(plan_packs(tree, "node"))
    with pytest.raises(PlanningError, match="tree mask"):
        plan_packs(tree, "tree", branches=False)


# ------------------------------------------------------------------- chain segments --
def chain_records(turns: int, vocab: int = 512, seed: int = 1):
    """One sequence per agent turn, each a strict prefix of the next; loss on its last turn."""
    rng = np.random.default_rng(seed)
    tokens, recs = list(rng.integers(3, vocab, 9)), []
    for _ in range(turns):
        start = len(tokens)
        tokens += list(rng.integers(3, vocab, int(rng.integers(2, 6))))
        mask = np.zeros(len(tokens), np.int64)
        mask[start:] = 1
        recs.append({"input_ids": np.asarray(tokens), "loss_mask": mask})
    return recs


def test_auto_merges_chain_segments_into_open_packs():
    from dta.batch import Batch

    tree = PrefixTree.from_sequences(Batch.from_records(chain_records(40)).input_ids)
    cost = PackCost.from_config(build_model("qwen3", "tiny", seed=0).config)
    plan = plan_packs(tree, "auto", cap=32, cost=cost)
    total = int(sum(p.tokens for p in plan.packs))
    assert all(p.chain and p.tokens <= 32 for p in plan.packs)
    open_segments = [p for p in plan.packs if p.children and len(p.nodes) > 1]
    assert open_segments, "an open pack holds several chain nodes"
    assert len(plan) <= -(-total // 32) + 2  # segments near the cap, not one pack per node
    assert len(plan) < len(plan_packs(tree, "node"))


def test_chain_segments_exact_float64(f64):
    from dta.batch import Batch

    model, _ = f64
    batch = Batch.from_records(chain_records(14))
    plan = plan_packs(PrefixTree.from_sequences(batch.input_ids), "auto", cap=16,
                      cost=PackCost.from_config(model.config))
    assert any(p.children and len(p.nodes) > 1 for p in plan.packs)  # open chain segments
    model.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model, batch, NLL())
    g_ref = grads(model)
    for policy in ("retain", "recompute"):
        model.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, batch, NLL(), policy=policy, packing="auto",
                                   pack_tokens=16, record=True)
        assert res.walk.packs == len(plan) < 14
        assert rel(grads(model), g_ref) <= 1e-10, policy
        assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss), policy
        lp = max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs))
        assert lp <= 1e-10, policy


def test_mask_forms_made_once_per_forward_and_split_is_exact(monkeypatch):
    """dta_sdpa analyses a pack's boolean mask once per forward (not once per layer), and
    every forward over cached keys is split at the cache boundary: on an MHA and a GQA
    model the packed walk then trains to float64 round-off of the unsplit walk."""
    import dta.model.attention as attention
    import dta.model.split_attention as sa

    for kv in (4, 2):  # the tiny model has 4 heads: MHA, then grouped-query
        model = build_model("qwen3", "tiny", dtype="float64", seed=0, num_key_value_heads=kv)
        make_truly_float64(model)
        batch = hard_batch(model)
        made, splits = [], []
        real_split_of, real_apply = attention.split_of, sa.SplitAttention.apply
        monkeypatch.setattr(attention, "split_of", lambda m, d: made.append(m) or real_split_of(m, d))
        monkeypatch.setattr(sa.SplitAttention, "apply", lambda *a: splits.append(1) or real_apply(*a))
        model.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, batch, NLL(), packing="auto", pack_tokens=CAP)
        g_split = grads(model)
        layers = model.config.num_hidden_layers
        assert 0 < len(made) <= res.walk.forward_calls < layers * res.walk.forward_calls
        assert len(splits) > 0 and len(splits) % layers == 0
        monkeypatch.setattr(attention, "split_of", lambda m, d: None)  # one masked call each:
        monkeypatch.setattr(sa, "kernels_of", lambda *a: None)  # no kernel row for a pack view
        from dta.model.packmask import DENSE_PATH_MASKS

        DENSE_PATH_MASKS.clear()
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, batch, NLL(), packing="auto", pack_tokens=CAP)
        assert DENSE_PATH_MASKS["cpu"] > 0  # the packs over cached keys took the dense mask
        assert rel(g_split, grads(model)) <= 1e-12, kv
        monkeypatch.undo()


def test_head_workspace_reused_then_released():
    """On CPU the head writes every chunk's logits of one evaluation into one reused buffer:
    the same gradients as fresh logits per chunk (float32 round-off: ∂L/∂W is then added
    chunk by chunk), and the buffer is dropped when each evaluation returns (idle, it would
    sit on the peaks of the forwards and backwards between head calls). (Float64 exactness:
    the tests above, which run with the workspace.)"""
    from dta.objective import Objective
    from dta.walk import Walker

    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    batch = hard_batch(model)
    tree = PrefixTree(batch.input_ids)

    def run(reuse):
        model.zero_grad(set_to_none=True)
        walker = Walker(model, packing="auto", pack_tokens=CAP, logits_chunk=7)
        walker.head._reuse = reuse
        storages, real = [], walker.head._logits

        def logits(h):
            out, in_ws = real(h)
            storages.append(out.untyped_storage().data_ptr() if in_ws else None)
            return out, in_ws

        walker.head._logits = logits
        evaluate, idle = walker.head.evaluate, []

        def evaluate_then_check(*a, **k):
            out = evaluate(*a, **k)
            idle.append(walker.head._workspace is None)
            return out

        walker.head.evaluate = evaluate_then_check
        walker.train(tree, Objective(batch, NLL(), "token_mean"))
        assert idle and all(idle)  # released after every evaluation
        return [p.grad.clone() for p in model.parameters()], storages

    g_ws, used = run(True)
    g_fresh, fresh = run(False)
    assert len(used) > 3 and len(set(used)) < len(used) and None not in used  # reused
    assert set(fresh) == {None}
    assert rel(g_ws, g_fresh) <= 1e-6

"""Planning: ART's published packing example, packing and balancing quality on random
tau2-shaped batches, the lower bound, the cost model, bad input, the `dta plan` CLI, and a
brute-force cross-check of the prefix tree the planner stands on."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dta.planning import (
    PACKERS,
    CostModel,
    PlanningError,
    TreeIndex,
    balance,
    bin_pack,
    build_tree,
    features,
    flops,
    flops_unpacked,
    ideal_speedup,
    lower_bound,
)
from dta.planning.binpack import art_order
from dta.tree import PrefixTree, _sort_exact, _sort_order

ROW = 131_072


# ------------------------------------------------------------------------- batches --
def art_batch():
    """ART's example: a 4,096-token root, four groups of eight rollouts with a 12,000-token
    group prefix, completions of 2,000 / 2,000 / 12,000 / 7,000 tokens (in arrival order)."""
    rng = np.random.default_rng(0)
    root = rng.integers(1000, 100_000, 4096)
    seqs, masks, groups = [], [], []
    for g, completion in enumerate([2000, 2000, 12_000, 7000]):
        prefix = rng.integers(1000, 100_000, 12_000)
        for _ in range(8):
            s = np.concatenate([root, prefix, rng.integers(1000, 100_000, completion)])
            m = np.zeros(len(s), dtype=np.int8)
            m[4096 + 12_000:] = 1
            seqs.append(s), masks.append(m), groups.append(g)
    return seqs, masks, groups


def tau2_batch(tasks: int, seed: int, scale: float = 1 / 16):
    """tau2-shaped per-call batch (airline parameters of shared/reference/tau2-workload.md),
    every length multiplied by ``scale``: one sequence per agent call, ``P · u1 · trunk_1 …
    trunk_{i-1} · leaf_i`` with the loss on the leaf; groups of 8 rollouts that keep the
    first 0/1/2 visible calls identical with probability 0.5/0.35/0.15."""
    rng = np.random.default_rng(seed)

    def n(median, sigma, lo, hi, extra=0):
        v = min(max(median * np.exp(sigma * rng.standard_normal()), lo), hi) + extra
        return max(1, int(round(v * scale)))

    def tok(k):
        return rng.integers(1000, 151_000, k)

    prefix = tok(max(1, round(4906 * scale)))
    seqs, masks, groups = [], [], []
    for task in range(tasks):
        u1, n_shared, shared = tok(n(45, 0.5, 15, 200, 5)), rng.choice(3, p=[.5, .35, .15]), []
        for _ in range(8):
            calls = min(2 + int(rng.negative_binomial(4, 4 / 14)), 25)
            trunk = [prefix, u1]
            for i in range(calls):
                tool = i < calls - 1 and rng.random() < 0.5
                if i < len(shared):
                    resp, piece = shared[i]
                else:
                    resp = tok(n(35, 0.3, 20, 120) if tool else n(70, 0.6, 10, 600))
                    env = n(250, 0.8, 5, 4000, 12) if tool else n(40, 0.6, 5, 400, 8)
                    piece = np.concatenate([resp, tok(max(1, round(5 * scale))), tok(env)])
                    if i < n_shared:
                        shared.append((resp, piece))
                leaf = np.concatenate([tok(n(300, 0.9, 1, 8192)), resp, tok(1)])
                head = np.concatenate(trunk)
                seqs.append(np.concatenate([head, leaf]))
                masks.append(np.r_[np.zeros(len(head), np.int8), np.ones(len(leaf), np.int8)])
                groups.append(task)
                trunk.append(piece)
    return seqs, masks, groups


QWEN3_1P7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936)


# ----------------------------------------------------------------- ART's example --
def test_art_example_exact_rows():
    seqs, masks, groups = art_batch()
    tree = build_tree(seqs, masks, art_sharing=True)  # 11,999 shared group-prefix tokens
    inorder = bin_pack(tree, ROW, "inorder", groups=groups)
    assert inorder.bin_tokens == [120_113, 125_105, 23_096]
    bfd = bin_pack(tree, ROW, "bfd", groups=groups)
    assert bfd.bin_tokens == [130_105, 122_114]
    # bfd: the long group with 3 short A; medium, 5 short A and all of short B.
    assert sorted(len(b) for b in bfd.bins) == [11, 21]
    ours = bin_pack(tree, ROW, "dfs", groups=groups)
    assert ours.n_bins == 2 and max(ours.bin_tokens) <= ROW
    assert inorder.lower_bound == bfd.lower_bound == ours.lower_bound == 2
    # ART duplicates the last prompt token in each of the 8 rollouts of the 4 groups.
    assert build_tree(seqs).stats().unique_tokens == tree.stats().unique_tokens - 4 * 7


def art_reference(tree: PrefixTree, capacity: int, groups) -> list[list[int]]:
    """ART's _place_prefix_tree_leaves as published (seed 002), pure Python."""
    ix = TreeIndex(tree)
    leaves = {}
    for s in range(ix.n_seq):
        path = ix.seq_path(s).tolist()
        leaves[s] = [(u, int(ix.seg[u])) for u in path]
    by_group: dict = {}
    for s, g in enumerate(groups):
        by_group.setdefault(g, []).append(s)
    ordered = sorted(by_group.values(), key=lambda g: max(int(ix.lengths[s]) for s in g),
                     reverse=True)
    bins = []  # [leaves, occupied, count]
    for s in (s for g in ordered for s in g):
        best, best_remaining = None, capacity + 1
        for b in bins:
            count = b[2] + sum(n for u, n in leaves[s] if u not in b[1])
            if count <= capacity and capacity - count < best_remaining:
                best, best_remaining = b, capacity - count
        if best is None:
            best = [[], set(), 0]
            bins.append(best)
        best[2] += sum(n for u, n in leaves[s] if u not in best[1])
        best[1].update(u for u, _ in leaves[s])
        best[0].append(s)
    return [b[0] for b in bins]


@pytest.mark.parametrize("seed", range(6))
def test_bfd_is_arts_algorithm(seed):
    seqs, masks, groups = tau2_batch(3, seed)
    tree = build_tree(seqs, masks, art_sharing=seed % 2 == 0)
    cap = int(max(tree.lengths) * 1.7)
    assert bin_pack(tree, cap, "bfd", groups=groups).bins == \
        [sorted(b) for b in art_reference(tree, cap, groups)]


# ------------------------------------------------------- random tau2-shaped batches --
def test_tau2_packing_and_balancing():
    model = CostModel.from_config(QWEN3_1P7B)
    gaps, checked, sizes = [], 0, []
    for seed, tasks in enumerate(np.geomspace(1, 75, 20).round().astype(int)):
        seqs, masks, groups = tau2_batch(int(tasks), seed)  # ~100 to ~7,000 leaves
        sizes.append(len(seqs))
        tree = build_tree(seqs, masks, art_sharing=seed % 3 == 0)
        ix = TreeIndex(tree)
        # 32K / 24K-token budgets (AReaL's tree micro-batches) at 1/16 of the lengths
        cap = max(2048 if seed % 2 else 1536, int(ix.lengths.max()))
        ours, bfd = bin_pack(ix, cap, "dfs", groups=groups), bin_pack(ix, cap, "bfd", groups=groups)
        assert ours.n_bins <= bfd.n_bins, (seed, len(seqs), ours.n_bins, bfd.n_bins)
        assert ours.n_bins >= ours.lower_bound >= -(-ix.unique_tokens // cap)
        gaps.append(ours.gap)
        for W in (2, 4, 8, 16):
            if len(seqs) < 40 * W:
                continue
            a = balance(ix, W, model)
            assert a.imbalance <= 1.05, (seed, len(seqs), W, a.imbalance)
            checked += 1
    assert np.mean(gaps) <= 0.03, gaps
    assert checked >= 30 and min(sizes) <= 150 and max(sizes) >= 6000, sizes


def test_packings_are_valid_partitions():
    seqs, masks, groups = tau2_batch(4, 7)
    tree = build_tree(seqs, masks)
    ix = TreeIndex(tree)
    for method in PACKERS:
        p = bin_pack(ix, 1500, method, groups=groups)
        assert sorted(s for b in p.bins for s in b) == list(range(len(seqs)))
        assert p.bin_tokens == [ix.union_tokens(b) for b in p.bins]
        assert max(p.bin_tokens) <= 1500 and p.n_bins >= p.lower_bound


def brute_min_bins(ix: TreeIndex, capacity: int) -> int:
    """The optimal number of bins, by trying every partition (tiny batches only)."""
    n = ix.n_seq

    def parts(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in parts(rest):
            for i in range(len(p)):
                yield p[:i] + [[first] + p[i]] + p[i + 1:]
            yield [[first]] + p

    return min(len(p) for p in parts(list(range(n)))
               if all(ix.union_tokens(b) <= capacity for b in p))


@pytest.mark.parametrize("seed", range(12))
def test_lower_bound_never_exceeds_optimum(seed):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 50, 40)
    seqs = [np.concatenate([base[:rng.integers(1, 30)], rng.integers(0, 50, rng.integers(0, 20))])
            for _ in range(int(rng.integers(2, 8)))]  # some are prefixes of others
    ix = TreeIndex(PrefixTree(seqs))
    cap = int(max(ix.lengths) + rng.integers(0, 40))
    best = brute_min_bins(ix, cap)
    assert lower_bound(ix, cap) <= best <= bin_pack(ix, cap, "dfs").n_bins


@pytest.mark.parametrize("seed", range(20))
def test_plans_on_odd_trees(seed):
    """Duplicates, sequences ending inside others, unrelated roots: every plan is valid."""
    rng = np.random.default_rng(seed)
    seqs = random_batch(rng, int(rng.choice([2, 5, 1000])))
    tree = PrefixTree(seqs, min_shared=int(rng.choice([1, 1, 4])))
    ix = TreeIndex(tree)
    cap = int(ix.lengths.max() * rng.uniform(1, 3))
    for method in PACKERS:
        p = bin_pack(ix, cap, method)
        assert sorted(s for b in p.bins for s in b) == list(range(len(seqs)))
        assert p.bin_tokens == [ix.union_tokens(b) for b in p.bins]
        assert max(p.bin_tokens) <= cap and p.n_bins >= p.lower_bound
    for W in (1, 2, 3, 7):
        a = balance(ix, W, CostModel.from_config(QWEN3_1P7B))
        assert sorted(s for w in a.workers for s in w) == list(range(len(seqs)))
        assert a.duplicated_tokens == sum(a.worker_tokens) - ix.unique_tokens >= 0


# ------------------------------------------------------------------------ balance --
def test_balance_counts_duplicated_prefixes():
    seqs, masks, _ = tau2_batch(2, 3)
    tree = build_tree(seqs, masks)
    ix = TreeIndex(tree)
    one = balance(tree, 1)
    assert one.duplicated_tokens == 0 and one.worker_tokens == [ix.unique_tokens]
    a = balance(tree, 4, CostModel.from_config(QWEN3_1P7B))
    assert sorted(s for w in a.workers for s in w) == list(range(len(seqs)))
    assert a.worker_tokens == [ix.union_tokens(w) for w in a.workers]
    assert a.duplicated_tokens == sum(a.worker_tokens) - ix.unique_tokens
    assert a.duplicated_tokens >= 3 * round(4906 / 16)  # every worker pays the domain prefix
    assert a.imbalance == pytest.approx(max(a.worker_cost) / np.mean(a.worker_cost))


# ---------------------------------------------------------------------- cost model --
def test_cost_model():
    seqs = [np.arange(10), np.r_[np.arange(6), [99, 98]]]
    tree = PrefixTree(seqs)
    assert features(tree, [0, 1]) == (12, sum(range(1, 11)) + 7 + 8)  # shared 6, + 4, + 2
    m = CostModel.from_config(QWEN3_1P7B)
    assert m.attention == 3 * 4 * 28 * 16 * 128
    params = 28 * (2048 * 128 * (2 * 16 + 2 * 8) + 3 * 2048 * 6144)
    assert m.token == 3 * (2 * params + 2 * 2048 * 151936)
    assert m.cost(tree, [0]) == pytest.approx(m.token * 10 + m.attention * 55)
    assert flops_unpacked(seqs, m) == pytest.approx(m.token * 18 + m.attention * (55 + 36))
    assert ideal_speedup(tree, m) == pytest.approx(flops_unpacked(seqs, m) / flops(tree, m))
    assert ideal_speedup(tree) == pytest.approx(18 / 12)
    true = CostModel(2e-6, 3e-9, 0.01, "s")
    rng = np.random.default_rng(0)
    samples = [(u, a, true.token * u + true.attention * a + true.fixed)
               for u, a in rng.integers(1000, 100_000, (12, 2)) * [1, 500]]
    fit = CostModel.calibrate(samples)
    assert (fit.token, fit.attention, fit.fixed) == pytest.approx((2e-6, 3e-9, 0.01), rel=1e-6)
    assert CostModel.calibrate([(tree, [0, 1], 1.0), (tree, [0], 0.8)]).token >= 0


# ---------------------------------------------------------------------- bad input --
def test_bad_input_errors():
    tree = PrefixTree([np.arange(5), np.arange(12), np.r_[np.arange(3), [7] * 30]])
    with pytest.raises(PlanningError, match="empty batch"):
        build_tree([])
    for cap in (0, -3, 2.5):
        with pytest.raises(PlanningError, match="capacity"):
            bin_pack(tree, cap)
    with pytest.raises(PlanningError) as e:
        bin_pack(tree, 10)
    assert "sequence 1 (12 tokens)" in str(e.value) and "sequence 2 (33 tokens)" in str(e.value)
    assert "sequence 0" not in str(e.value)
    with pytest.raises(PlanningError, match="unknown packing method"):
        bin_pack(tree, 40, "worst-fit")
    for w in (0, -1, 1.5):
        with pytest.raises(PlanningError, match="workers"):
            balance(tree, w)
    with pytest.raises(PlanningError, match="loss masks"):
        build_tree([np.arange(3)], art_sharing=True)


# ----------------------------------------------------------------------------- CLI --
def test_cli_plan_json(tmp_path, capsys):
    from dta.records.jsonl import write_jsonl
    from dta_cli.main import main

    seqs, masks, groups = tau2_batch(2, 5)
    path = tmp_path / "batch.jsonl"
    write_jsonl(path, [dict(input_ids=s, loss_mask=m, group_id=g)
                       for s, m, g in zip(seqs, masks, groups)])
    assert main(["plan", "--input", str(path), "--capacity", "1024", "--method", "bfd",
                 "--workers", "4", "--model", "tokens", "--art-sharing", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tree = build_tree(seqs, masks, art_sharing=True)
    expect = bin_pack(tree, 1024, "bfd", groups=groups)
    assert out["bins"] == expect.n_bins and out["bin_tokens"] == expect.bin_tokens
    assert out["lower_bound"] == expect.lower_bound and out["plan_ms"] > 0
    assert out["duplicated_tokens"] >= 0 and 1 <= out["imbalance"] <= 1.05
    assert main(["plan", "--input", str(path), "--capacity", "100"]) == 2
    assert "larger than the capacity" in capsys.readouterr().err


# -------------------------------------------------- the tree the planner stands on --
def random_batch(rng, vocab):
    seqs = []
    for _ in range(int(rng.integers(1, 30))):
        if seqs and rng.random() < 0.7:
            src = seqs[rng.integers(len(seqs))]
            head = src[:rng.integers(0, len(src) + 1)]
            seqs.append(np.r_[head, rng.integers(0, vocab, rng.integers(0 if len(head) else 1,
                                                                       40))])
        else:
            seqs.append(rng.integers(0, vocab, rng.integers(1, 60)))
    return seqs


@pytest.mark.parametrize("seed", range(40))
def test_tree_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    seqs = random_batch(rng, int(rng.choice([2, 3, 1000, 2 ** 40])))
    until = None
    if seed % 3 == 0:
        until = [int(rng.integers(0, len(s) + 2)) for s in seqs]
    tree = PrefixTree(seqs, shared_until=until)
    caps = [len(s) if until is None else min(u, len(s)) for s, u in zip(seqs, until or seqs)]
    prefixes = {tuple(s[:k]) for s, c in zip(seqs, caps) for k in range(1, c + 1)}
    private = sum(len(s) - c for s, c in zip(seqs, caps))
    assert tree.stats().unique_tokens == len(prefixes) + private
    leaf = tree.leaf_of()
    for i, s in enumerate(seqs):  # every root path spells its sequence
        assert np.array_equal(np.concatenate([tree.tokens(u) for u in tree.path(leaf[i])]), s)
        assert all(i in tree.through(u) for u in tree.path(leaf[i]))
    order = _sort_exact(tree.sequences, np.array(caps))
    assert np.array_equal(tree.order, order)
    assert np.array_equal(_sort_order(tree.sequences, np.array(caps)), order)


def test_sort_order_wide_and_negative_ids():
    seqs = [np.array([2 ** 33, 1]), np.array([5, -1]), np.array([5, 7]), np.array([-2])]
    caps = np.array([2, 2, 2, 1])
    assert np.array_equal(_sort_order(seqs, caps), _sort_exact(seqs, caps))
    assert list(_sort_exact(seqs, caps)) == [2, 1, 0, 3]  # unsigned byte order, as before


def test_art_order_sorts_groups_by_largest_leaf():
    seqs, masks, groups = art_batch()
    ix = TreeIndex(build_tree(seqs, masks, art_sharing=True))
    order = art_order(ix, groups)
    assert [groups[s] for s in order[::8]] == [2, 3, 0, 1]
    assert order[:8] == list(range(16, 24))  # the long group, in arrival order

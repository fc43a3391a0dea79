"""PrefixTree against brute force: every distinct prefix is one tree position, every
sequence is spelled by its root path, sequences below a node are exactly those through it."""
import numpy as np
import pytest

from dta.tree import PrefixTree


def random_batch(rng, alphabet=3):
    return [rng.integers(0, alphabet, rng.integers(1, 9)) for _ in range(rng.integers(1, 12))]


def spelled(tree, i):
    return np.concatenate([tree.tokens(u) for u in tree.path(tree.leaf_of()[i])])


@pytest.mark.parametrize("seed", range(60))
def test_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    seqs = random_batch(rng)
    tree = PrefixTree(seqs)
    prefixes = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert tree.stats().unique_tokens == len(prefixes)
    assert tree.stats().total_tokens == sum(map(len, seqs))
    for i, s in enumerate(seqs):
        assert np.array_equal(spelled(tree, i), s)
        for u in tree.path(tree.leaf_of()[i]):
            assert i in tree.through(u)
    for u in range(1, len(tree)):
        through = set(tree.through(u).tolist())
        expected = {i for i, s in enumerate(seqs) if len(s) >= tree.end[u]
                    and np.array_equal(s[:tree.end[u]], seqs[tree.through(u)[0]][:tree.end[u]])}
        assert through == expected
        assert tree.start[u] == tree.end[tree.parent[u]]
        assert tree.length(u) >= 1
        # radix: an internal node with one child and no ending sequence would be compressible
        assert len(tree.children[u]) != 1 or len(tree.ending[u]) > 0
    firsts = [[int(tree.tokens(c)[0]) for c in kids] for kids in tree.children]
    assert all(len(f) == len(set(f)) for f in firsts)  # children differ at their first token


@pytest.mark.parametrize("seed", range(20))
def test_min_shared(seed):
    rng = np.random.default_rng(seed)
    seqs = random_batch(rng)
    tree = PrefixTree(seqs, min_shared=3)
    for i, s in enumerate(seqs):
        assert np.array_equal(spelled(tree, i), s)
    for u in range(1, len(tree)):
        if tree.children[u]:
            assert tree.length(u) >= 3


def test_shared_until_makes_tails_private():
    seqs = [np.array([1, 2, 3, 4, 5]), np.array([1, 2, 3, 4, 6]), np.array([1, 2, 3, 4, 5])]
    tree = PrefixTree(seqs, shared_until=[3, 3, 3])
    assert tree.stats().unique_tokens == 3 + 2 * 3
    for i, s in enumerate(seqs):
        assert np.array_equal(spelled(tree, i), s)


def test_duplicates_and_strict_prefix():
    seqs = [[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3, 4]]
    tree = PrefixTree(seqs)
    assert tree.stats().unique_tokens == 4
    leaf = tree.leaf_of()
    assert leaf[0] == leaf[1] != leaf[2]
    assert set(tree.ending[leaf[0]]) == {0, 1}
    assert tree.children[leaf[2]] == [leaf[0]]


def test_dfs_order_pushes_parents_first_and_pops_children_first():
    tree = PrefixTree([[1, 2, 3], [1, 2, 4], [5]])
    events = list(tree.dfs())
    seen, popped = set(), set()
    for kind, u in events:
        if kind == "push":
            assert tree.parent[u] == 0 or tree.parent[u] in seen
            seen.add(u)
        else:
            assert all(c in popped for c in tree.children[u])
            popped.add(u)
    assert seen == popped == set(range(1, len(tree)))


def test_errors():
    with pytest.raises(ValueError, match="no sequences"):
        PrefixTree([])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        PrefixTree([[1], []])


@pytest.mark.parametrize("seed", range(40))
def test_stats_of_the_counted_tokens(seed):
    """``stats(lengths)``: a front door appends a token to each sequence for the walk (a wrap
    label); the walked tree's stats of each sequence's own tokens equal the stats of a tree of
    those tokens alone (totals, unique tokens, sequences, longest), and every length counted
    equals the plain stats."""
    rng = np.random.default_rng(1000 + seed)
    seqs = random_batch(rng)
    labels = [np.append(s, rng.integers(0, 3)) for s in seqs]
    walked = PrefixTree(labels)
    got, want = walked.stats([len(s) for s in seqs]), PrefixTree(seqs).stats()
    assert (got.sequences, got.total_tokens, got.unique_tokens, got.max_length) == \
        (want.sequences, want.total_tokens, want.unique_tokens, want.max_length)
    assert got.sharing_ratio == want.sharing_ratio
    assert got.depth <= walked.stats().depth and got.nodes <= walked.stats().nodes
    assert walked.stats([len(s) for s in labels]) == walked.stats()
    with pytest.raises(ValueError, match="lengths must give"):
        walked.stats([len(s) + 1 for s in labels])

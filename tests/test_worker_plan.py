"""dta.planning.workers: the per-worker sequence ids a runtime sends out (pure metadata)."""
from __future__ import annotations

import numpy as np
import pytest

from dta.planning.workers import assign_workers, default_cost_model
from dta.tree import PrefixTree


def _tree():
    rng = np.random.default_rng(0)
    prefix = list(rng.integers(1, 50, 40))
    seqs = [np.array(prefix[: 10 + 3 * (i % 4)] + list(rng.integers(1, 50, 5 + i)))
            for i in range(12)]
    return PrefixTree(seqs)


def test_every_sequence_once_and_figures_consistent():
    tree = _tree()
    for W in (1, 2, 3):
        plan = assign_workers(tree, W, default_cost_model())
        assert len(plan.workers) == W
        assert sorted(i for w in plan.workers for i in w) == list(range(12))
        assert plan.global_unique_tokens == tree.stats().unique_tokens
        for ids, u in zip(plan.workers, plan.unique_tokens):
            assert u == (PrefixTree([tree.sequences[i] for i in ids]).stats().unique_tokens
                         if ids else 0)
        assert plan.duplicated_tokens >= 0 and plan.imbalance >= 1.0
    assert assign_workers(tree, 1).method == "single"


def test_bad_worker_count_is_refused():
    with pytest.raises(ValueError, match="n_workers"):
        assign_workers(_tree(), 0)

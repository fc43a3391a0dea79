"""Expert parallelism composed (docs/expert-parallel.md): with zero1 and fsdp (the expert
slices are flat shards over the expert replicas; fsdp's units leave them out) and with
context parallelism -- an expert group inside a context-parallel group (E = C: the ranks
walk one tree, each routes its own rows, no lockstep) and one spanning context-parallel
groups (E = 4 over C = 2: the lockstep matches the groups' calls) -- each against one
process in float64 (log-probs, loss, every reduced gradient, the parameters and their norm
after 2 AdamW steps, <= 1e-10; the checks of tests/test_expert_parallel.py). Cases are
``(family, policy, block_tokens, E, sharding, C)``. The default suite runs zero1 and fsdp at
E = 2 on 2 ranks; ``-m slow`` the 4-rank layouts (EP x CP = 2 x 2 in each mode, E = 4 over
C = 2, zero1 with 2 replicas of each expert slice)."""
from __future__ import annotations

import pytest

from tests.test_expert_parallel import run_and_compare

SHARDED = [("qwen3_moe", "recompute", 8, 2, "zero1", 1), ("mixtral", "retain", 8, 2, "fsdp", 1)]
FOUR = [("qwen3_moe", "retain", 8, 2, "replicate", 2),  # EP x CP = 2 x 2: E = C
        ("mixtral", "recompute", 8, 2, "zero1", 2),
        ("mixtral", "retain", 8, 2, "fsdp", 2),
        ("qwen3_moe", "recompute", 0, 4, "replicate", 2),  # E = 4 spans the C = 2 groups
        ("qwen3_moe", "retain", 8, 4, "fsdp", 2),
        ("qwen3_moe", "recompute", 8, 2, "zero1", 1)]  # each expert slice on 2 replicas


def test_expert_parallel_with_zero1_and_fsdp_matches_one_process():
    locks = run_and_compare(2, SHARDED)  # raises past 1e-10 on any compared quantity
    # E = 2 spans the two C = 1 groups: both layouts keep the ranks' calls matched, and
    # fsdp's retain backwards are matched in rounds
    assert all(lock is not None and lock["rounds"] > 0 for lock in locks), locks
    assert locks[1]["B"] > 0, locks[1]


@pytest.mark.slow
def test_expert_parallel_on_four_ranks_with_context_parallel_and_sharding():
    locks = run_and_compare(4, FOUR)  # raises past 1e-10 on any compared quantity
    assert len(locks) == len(FOUR)
    assert locks[0] is None and locks[2] is not None, locks  # E = C: no lockstep; fsdp: one

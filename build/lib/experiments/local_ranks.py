"""Run a function on W local gloo ranks and collect what each returns -- for tests and
benchmarks of the sharding modes without Ray (tests and ``experiments/bench_sharding.py``
use it; the library and the runtime do not). The harness is the library's
(``dta.local_ranks.run_group``: spawned processes, a file store, loopback only); this
module only calls ``fn(rank, world, *args)`` instead of ``fn(group, *args)``. The function
must be importable (defined at module level)."""
from __future__ import annotations

from dta.local_ranks import run_group


def _by_rank(group, fn, args):
    import torch.distributed as dist

    return fn(dist.get_rank(group), dist.get_world_size(group), *args)


def run_ranks(fn, world: int, *args, timeout: float = 300.0):
    """``fn(rank, world, *args)`` on every rank; returns the list of results by rank."""
    return run_group(_by_rank, world, fn, args, timeout=timeout)

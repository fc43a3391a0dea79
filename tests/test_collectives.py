"""dta.model.collectives on the torch it runs on and on an older one's names: torch 2.9-2.12
(AReaL's pins) have no all_gather_single / reduce_scatter_single; both calls must give the
same tensors through all_gather_into_tensor / reduce_scatter_tensor."""
from __future__ import annotations

import torch

from dta.local_ranks import run_group


def _both_ways(group):
    import torch.distributed as dist

    from dta.model import collectives

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send = torch.arange(4 * world, dtype=torch.float64) * (rank + 1)
    out = {}
    for label, hide in (("new", ()), ("old", ("all_gather_single", "reduce_scatter_single"))):
        saved = {n: getattr(dist, n) for n in hide if hasattr(dist, n)}
        for n in saved:
            delattr(dist, n)
        try:
            part = torch.empty(4, dtype=torch.float64)
            collectives.reduce_scatter_single(part, send, group=group)
            whole = torch.empty(4 * world, dtype=torch.float64)
            collectives.all_gather_single(whole, part, group=group)
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)
        out[label] = (part, whole)
    return out


def test_collectives_equal_on_the_old_names():
    results = run_group(_both_ways, 2)
    world = 2
    expected = torch.arange(4 * world, dtype=torch.float64) * sum(r + 1 for r in range(world))
    for rank, got in enumerate(results):
        for label in ("new", "old"):
            part, whole = got[label]
            torch.testing.assert_close(part, expected[4 * rank:4 * rank + 4], rtol=0, atol=0)
            torch.testing.assert_close(whole, expected, rtol=0, atol=0)

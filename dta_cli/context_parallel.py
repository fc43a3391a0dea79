"""`dta verify --context-parallel C`: the DFS side walked by C local gloo ranks (CPU) whose
K/V are spread over the group (dta/model/context_parallel.py), each rank compared with
one-sequence-at-a-time training; the report is the worst rank's."""
from __future__ import annotations

import math


def check_size(size, flag: str = "--context-parallel") -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SystemExit(f"dta verify: {flag} must be an integer >= 1 (ranks of the group), "
                         f"got {size!r}")
    return size


def _verify_rank(group, model, batch, loss, kw):
    from dta.verify import verify

    return verify(model, batch, loss, context_parallel_group=group, **kw)


def verify_on_group(size: int):
    """``dta.verify.verify`` with the DFS side on a group of ``size`` spawned gloo ranks:
    the worst rank's report (a NaN error is the worst)."""
    from dta.context_parallel import run_group

    def run(model, batch, loss, **kw):
        kw["progress"] = False  # one bar per rank would interleave
        reports = run_group(_verify_rank, size, model, batch, loss, kw)
        sent = [r.context_parallel_sent_bytes for r in reports]
        print(f"context parallel: {size} gloo ranks, bytes sent per rank "
              f"{', '.join(f'{b:,}' for b in sent)}, max relative error per rank "
              f"{', '.join(f'{r.max_rel_err():.3e}' for r in reports)}")
        if not any(sent):
            print("  (no pack had cached keys to spread: the walk was one pack; --packing node "
                  "or --block-tokens N walks a path over the group)")
        return max(reports, key=lambda r: (math.inf if math.isnan(r.max_rel_err())
                                           else r.max_rel_err()))

    return run

"""`dta verify --context-parallel C`: the DFS side walked by C local gloo ranks (CPU) that
divide every pack's rows and heads (dta/model/context_parallel.py), the group's gradient
(the sum of the ranks') compared on each rank with one-sequence-at-a-time training; the
report is the worst rank's, with what each rank sent and stored. `--expert-parallel E`
(E = C): the group also divides every MoE layer's experts (dta/model/expert_parallel.py),
each expert slice's gradient whole on its rank."""
from __future__ import annotations

import math


def check_size(size, flag: str = "--context-parallel") -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SystemExit(f"dta verify: {flag} must be an integer >= 1 (ranks of the group), "
                         f"got {size!r}")
    return size


def _verify_rank(group, model, batch, loss, kw, experts=False):
    """One rank: the check on the group, then the same DFS walk alone (a group of one rank:
    the path K/V one process stores, the figure the rank's share is measured against)."""
    import copy

    import torch.distributed as dist

    from dta.model.context_parallel import ContextParallel, parallelize_context
    from dta.options import WalkOptions
    from dta.train import accumulate_gradients
    from dta.verify import verify

    report = verify(model, batch, loss, context_parallel_group=group,
                    expert_parallel_group=group if experts else None, **kw)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    solo = ContextParallel([dist.new_group([r]) for r in range(size)][rank])
    walk = WalkOptions.given(kw.get("options"), {})
    accumulate_gradients(parallelize_context(copy.deepcopy(model), solo), batch, loss,
                         reduction=kw.get("reduction", "token_mean"), options=walk,
                         self_check=False)
    return report, solo.path_bytes_peak


def verify_on_group(size: int, experts: bool = False):
    """``dta.verify.verify`` with the DFS side on a group of ``size`` spawned gloo ranks
    (``experts``: the experts divided over it too): the worst rank's report (a NaN error is
    the worst), with the group's per-rank figures."""
    from dta.local_ranks import run_group

    def run(model, batch, loss, **kw):
        kw["progress"] = False  # one bar per rank would interleave
        got = run_group(_verify_rank, size, model, batch, loss, kw, experts)
        reports = [r for r, _ in got]
        alone = got[0][1]
        sent = [r.context_parallel_sent_bytes for r in reports]
        kv = [r.context_parallel_path_kv_bytes for r in reports]
        share = [b / alone if alone else 0.0 for b in kv]
        print(f"context parallel: {size} gloo ranks, each forwarding its rows of every pack and "
              f"attending for its heads; bytes sent per rank {', '.join(f'{b:,}' for b in sent)}; "
              f"max relative error per rank "
              f"{', '.join(f'{r.max_rel_err():.3e}' for r in reports)}")
        if alone:
            print(f"  path K/V (+ gradients) stored per rank {', '.join(f'{b:,}' for b in kv)} "
                  f"bytes, {', '.join(f'{x:.2f}' for x in share)}x of one process walking alone "
                  f"({alone:,} bytes); longest path {reports[0].path_tokens:,} tokens")
        else:
            print("  no pack was stored for a pack below it (the walk was one pack per tree): "
                  "the exchanges covered each pack's own rows and heads; --packing node or "
                  "--block-tokens N walks a path over the group")
        if not all(sent):
            print(f"  FAIL: rank(s) {[r for r, b in enumerate(sent) if not b]} sent nothing: "
                  "the group checked nothing of context parallelism")
        ex = [r.expert_parallel_sent_bytes for r in reports]
        if experts:
            print(f"expert parallel: the experts divided over the {size} ranks (each holds "
                  f"{', '.join(f'{r.expert_weight_share:.2f}' for r in reports)} of the expert "
                  f"weights); routed rows sent per rank {', '.join(f'{b:,}' for b in ex)} bytes")
            if not all(ex):
                print(f"  FAIL: rank(s) {[r for r, b in enumerate(ex) if not b]} sent no routed "
                      "row: the group checked nothing of expert parallelism")
        worst = max(reports, key=lambda r: (math.inf if math.isnan(r.max_rel_err())
                                            else r.max_rel_err(), r.vacuous))
        worst.context_parallel_ranks = dict(sent_bytes=sent, path_kv_bytes=kv,
                                            path_kv_alone_bytes=alone, path_kv_share=share)
        if not all(sent):
            worst.context_parallel_sent_bytes = 0  # vacuous: the report fails
        if experts:
            worst.context_parallel_ranks["expert_sent_bytes"] = ex
            worst.context_parallel_ranks["expert_weight_share"] = [r.expert_weight_share
                                                                   for r in reports]
            if not all(ex):
                worst.expert_parallel_sent_bytes = 0  # vacuous: the report fails
        return worst

    return run

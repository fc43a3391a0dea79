"""Collecting a step's results from the workers, and explaining a failed step.

:func:`gather` waits for every worker's step (up to ``ray.step_timeout_s``) and sorts the
outcomes into results and failures: a worker that died, raised or hung. Once one worker has
failed, the others get a short grace period to report. :func:`failure_message` turns the
failures into one message naming the culprit worker, its process, the step, and whether any
replica applied the update (none can, before the gradient collective completed).
"""
from __future__ import annotations

import time

from runtime.ray_runtime.errors import first_line

GRACE_S = 30.0  # after one failure, how long the other workers get to report


def gather(refs: dict, timeout_s: float, on_tick=None, tick_s: float = 0.5
           ) -> tuple[dict, dict]:
    """``refs``: object ref -> rank. Returns (rank -> result, rank -> (kind, detail)).
    ``on_tick()`` is called about every ``tick_s`` while waiting (progress display)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    pending = dict(refs)
    results, failures = {}, {}
    deadline = time.monotonic() + float(timeout_s)
    grace = None
    while pending:
        limit = deadline if grace is None else min(deadline, grace)
        wait = max(0.0, limit - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1,
                            timeout=wait if on_tick is None else min(wait, tick_s))
        if not ready and on_tick is not None and time.monotonic() < limit:
            on_tick()
            continue
        if not ready:
            for rank in pending.values():
                failures[rank] = ("hung", f"did not finish the step within {timeout_s:g} s"
                                  if grace is None else "did not report after a peer failed")
            break
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref, timeout=0)
            except RayActorError as exc:  # the worker process died
                failures[rank] = ("died", first_line(exc))
            except RayTaskError as exc:  # the step raised
                cause = getattr(exc, "cause", None) or exc
                failures[rank] = ("raised", f"{type(cause).__name__}: {first_line(cause)}")
            except GetTimeoutError:
                pending[ref] = rank
            if failures and grace is None:
                grace = time.monotonic() + GRACE_S
    return results, failures


def failure_message(step: int, results: dict, failures: dict, infos: list[dict],
                    last_checkpoint: str | None) -> tuple[str, int, str, list[int]]:
    """(message, culprit rank, verb, ranks that applied the update)."""
    applied = sorted(r for r, s in results.items() if s.get("updated"))
    order = sorted(failures, key=lambda r: (failures[r][0] != "died", r))
    culprit = order[0]
    kind, detail = failures[culprit]
    detail = detail.rstrip(". ")
    info = infos[culprit] if culprit < len(infos) else {}
    where = f"pid {info.get('pid', '?')} on {info.get('ip', '?')}"
    parts = [f"step {step} failed: worker {culprit} ({where}) {kind}: {detail}"]
    for r in order[1:]:
        parts.append(f"worker {r} {failures[r][0]}: {failures[r][1]}")
    if applied:
        state = (f"workers {applied} applied the update before the failure, so the "
                 "replicas now disagree")
    else:
        state = (f"no worker applied the update: the model and optimizer state are as "
                 f"after step {step - 1}" if step > 0 else
                 "no worker applied the update: the model and optimizer are unchanged")
    resume = (f"; recover() (or `dta train train.resume=true`) restarts the workers from "
              f"{last_checkpoint}" if last_checkpoint else "; no checkpoint to resume from")
    return "; ".join(parts) + ". " + state + resume, culprit, kind, applied

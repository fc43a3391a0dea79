"""Collecting a step's results from the workers, and explaining a failed step.

:func:`gather` waits for every worker's step (up to ``ray.step_timeout_s``) and sorts the
outcomes into results and failures: a worker that died, raised or hung. Once one worker has
failed, the others get a short grace period to report. :func:`failure_message` turns the
failures into one message naming the culprit worker, its process, the step, and whether any
replica applied the update (none can, before the gradient collective completed).
:func:`call_workers` does the same for any other call (save, load, export, a collective):
its results, or a :class:`~.errors.WorkerError` in one line — what was being done, by which
worker, and the cause the worker raised (an ``OSError`` with its path), never Ray's repr.
"""
from __future__ import annotations

import time

from runtime.errors import WorkerError, describe

GRACE_S = 30.0  # after one failure, how long the other workers get to report


def gather(refs: dict, timeout_s: float | None, on_tick=None, tick_s: float = 0.5,
           what: str = "the step") -> tuple[dict, dict]:
    """``refs``: object ref -> rank. Returns (rank -> result, rank -> (kind, detail)).
    ``on_tick()`` is called about every ``tick_s`` while waiting (progress display).
    ``timeout_s=None``: no deadline (only the grace period after a peer failed)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    pending = dict(refs)
    results, failures = {}, {}
    deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
    grace = None
    while pending:
        limits = [t for t in (deadline, grace) if t is not None]
        limit = min(limits) if limits else None
        wait = None if limit is None else max(0.0, limit - time.monotonic())
        if on_tick is not None:
            wait = tick_s if wait is None else min(wait, tick_s)
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
        if not ready and (limit is None or time.monotonic() < limit):
            if on_tick is not None:
                on_tick()
            continue
        if not ready:
            for rank in pending.values():
                failures[rank] = ("hung", f"did not finish {what} within {timeout_s:g} s"
                                  if grace is None else "did not report after a peer failed")
            break
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref, timeout=0)
            except RayActorError as exc:  # the worker process died
                failures[rank] = ("died", describe(exc))
            except RayTaskError as exc:  # the call raised
                failures[rank] = ("raised", describe(exc))
            except GetTimeoutError:
                pending[ref] = rank
            if failures and grace is None:
                grace = time.monotonic() + GRACE_S
    return results, failures


def call_workers(workers: list, infos: list[dict], action: str, call, *,
                 ranks=None, timeout_s: float | None = None) -> list:
    """``call(worker)`` (an object ref) on each of ``ranks`` (default: every worker); their
    results in rank order. A failure on any raises :class:`WorkerError`: ``action`` (what was
    being done), the worker (rank, pid, node) and its cause, in one line; the first Ray
    error is its ``__cause__`` (the worker's traceback, for ``--debug``)."""
    ranks = list(range(len(workers)) if ranks is None else ranks)
    refs = {call(workers[r]): r for r in ranks}
    results, failures = gather(refs, timeout_s, what=action)
    if not failures:
        return [results[r] for r in ranks]
    kinds = ("raised", "died", "hung")  # the cause first; hung ones waited on it
    order = sorted(failures, key=lambda r: (kinds.index(failures[r][0]), r))
    culprit = order[0]
    kind, detail = failures[culprit]
    info = infos[culprit] if culprit < len(infos) else {}
    where = f"worker {culprit} (pid {info.get('pid', '?')} on {info.get('ip', '?')})"
    verb = {"raised": "", "died": "died: ", "hung": "hung: "}[kind]
    message = f"{action} failed on {where}: {verb}{detail.rstrip('. ')}"
    others = [r for r in order[1:]]
    same = [r for r in others if failures[r] == failures[culprit]]
    if same:
        message += f" (workers {same} too)" if len(same) > 1 else f" (worker {same[0]} too)"
    for r in others:
        if r not in same:
            message += f"; worker {r} {failures[r][0]}: {failures[r][1].rstrip('. ')}"
    error = WorkerError(message, action, failures)
    raise error from _ray_error(refs, culprit)


def _ray_error(refs: dict, rank: int):
    """The Ray exception of ``rank``'s call (its text holds the worker's traceback)."""
    import ray

    for ref, r in refs.items():
        if r == rank:
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - returned, not handled
                return exc
    return None


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

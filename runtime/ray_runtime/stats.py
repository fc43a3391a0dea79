"""What a step reports (:class:`StepStats`) and what a run reports (:func:`summarize`)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepStats:
    step: int
    loss: float
    sequences: int
    total_tokens: int  # what unpacked training would forward
    unique_tokens: int  # the whole batch's tree
    forwarded_tokens: int  # sum over workers of their trees (duplicates included)
    sharing_ratio: float  # total / unique
    duplicated_tokens: int
    imbalance: float  # max / mean worker planning cost
    step_s: float  # driver wall time of the step
    grad_norm: float
    updated: bool
    plan_method: str
    workers: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def brief(self) -> dict:
        """The part a checkpoint's history keeps."""
        return {"step": self.step, "loss": self.loss, "total_tokens": self.total_tokens,
                "unique_tokens": self.unique_tokens, "step_s": self.step_s}


def step_stats(step: int, batch, tree_stats, plan, results: dict, wall: float) -> StepStats:
    """One step's figures from the batch's tree, the worker plan and the workers' reports."""
    ordered = [results[r] for r in sorted(results)]
    forwarded = int(sum(s["unique_tokens"] for s in ordered))
    st = tree_stats
    return StepStats(
        step=step, loss=float(sum(s["loss"] for s in ordered)), sequences=len(batch),
        total_tokens=st.total_tokens, unique_tokens=st.unique_tokens,
        forwarded_tokens=forwarded, sharing_ratio=st.sharing_ratio,
        duplicated_tokens=forwarded - st.unique_tokens, imbalance=plan.imbalance,
        step_s=wall, grad_norm=float(ordered[0]["grad_norm"]),
        updated=all(s["updated"] for s in ordered), plan_method=plan.method,
        workers=ordered)


def summarize(history: list[StepStats], trainer=None) -> dict:
    """The run's summary (what ``dta train --json`` prints)."""
    if not history:
        return {"steps": 0}
    total = sum(s.total_tokens for s in history)
    unique = sum(s.unique_tokens for s in history)
    forwarded = sum(s.forwarded_tokens for s in history)
    times = [s.step_s for s in history]
    peaks: dict[int, int] = {}
    for s in history:
        for w in s.workers:
            peaks[w["rank"]] = max(peaks.get(w["rank"], 0), int(w.get("peak_bytes", 0)))
    out = {
        "steps": len(history), "first_step": history[0].step,
        "workers": len(history[0].workers), "sequences": sum(s.sequences for s in history),
        "tokens_total": total, "tokens_unique": unique, "tokens_forwarded": forwarded,
        "tokens_saved": total - forwarded, "sharing_ratio": total / unique if unique else None,
        "effective_ratio": total / forwarded if forwarded else None,
        "duplicated_tokens": forwarded - unique,
        "imbalance_mean": float(np.mean([s.imbalance for s in history])),
        "step_s_median": statistics.median(times), "step_s_mean": float(np.mean(times)),
        "step_s": times, "loss": [s.loss for s in history],
        "grad_norm": [s.grad_norm for s in history],
        "peak_memory_bytes": [peaks[r] for r in sorted(peaks)],
        "peak_memory_kind": history[0].workers[0].get("kind"),
        "plan_method": history[-1].plan_method,
        # per worker, the last step's {params, grads, optimizer} bytes (runtime.sharding)
        "state_bytes": [w.get("state_bytes") for w in sorted(history[-1].workers,
                                                               key=lambda w: w["rank"])],
    }
    if trainer is not None:
        out.update(trainer.timings)
        out["backend"] = getattr(trainer, "backend", None)
        group = getattr(trainer, "group", None)
        if group is not None:  # where the workers ran (ray.placement) and how they met
            out["worker_nodes"] = group.worker_nodes  # Ray node id per rank
            out["nodes"] = len(set(group.worker_nodes))
            out["placement"] = group.placement.strategy if group.placement else None
            out["rendezvous"] = group.rendezvous
        out["completed_steps"] = trainer.completed_steps
        settings = getattr(trainer, "_settings", None)  # the resolved run settings
        if settings is not None:  # the layout: shard size, offload, node residency, ...
            out["layout"] = settings.layout.record()
        cp = getattr(trainer, "context_parallel", 1)  # docs/context-parallel.md
        if isinstance(cp, int):
            W = len(history[0].workers)
            out["context_parallel"] = cp
            out["data_parallel"] = W // cp
            out["context_parallel_groups"] = [list(range(g * cp, (g + 1) * cp))
                                              for g in range(W // cp)]
            sent: dict[int, int] = {}  # per rank, the run's bytes sent by the path attention
            for s in history:
                for w in s.workers:
                    sent[w["rank"]] = sent.get(w["rank"], 0) + int(
                        w.get("context_parallel_sent_bytes", 0))
            out["context_parallel_sent_bytes"] = [sent[r] for r in sorted(sent)]
    return out

"""``dta train``'s loop: config and a batch source in, summary dict out.

The caller says where batches come from (``source.batch(step) -> dta.Batch``; the CLI's
:class:`dta_cli.batches.BatchSource` generates workloads or reads a JSONL file), so the
runtime imports no workload generator.
"""
from __future__ import annotations

import sys
from typing import Callable, Protocol

from dta.batch import Batch
from runtime.ray_runtime import checkpoint as ckpt
from runtime.ray_runtime.driver import Trainer
from runtime.ray_runtime.stats import StepStats, summarize


class BatchSourceLike(Protocol):
    def batch(self, step: int) -> Batch: ...


def run_training(cfg, source: BatchSourceLike, *,
                 address: str | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None, fault=None,
                 on_step: Callable[[StepStats], None] | None = None) -> dict:
    """Train ``cfg.train.steps`` steps on ``source.batch(k)``; returns the summary
    (:func:`~runtime.ray_runtime.stats.summarize`)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    trainer = Trainer(cfg, address=address, fault=fault, log=log)
    t = cfg.train
    resume_path = ckpt.latest_checkpoint(t.checkpoint_dir) if t.resume else None
    start = int(ckpt.read_meta(resume_path)["step"]) if resume_path else 0
    if start >= int(t.steps):
        log(f"checkpoint {resume_path} is at step {start}: nothing left of {t.steps} steps")
        return {"steps": 0, "completed_steps": start}
    first = source.batch(start)
    trainer.validate(first)  # bad input fails before Ray starts
    bar = None
    with trainer:
        if resume_path:
            trainer.load(resume_path)
            log(f"resumed from {resume_path} (step {start})")
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=int(t.steps), initial=start, desc="dta train", unit="step",
                       file=sys.stderr, dynamic_ncols=True)
        try:
            for k in range(start, int(t.steps)):
                batch = first if k == start else source.batch(k)
                stats = trainer.step(batch, k)
                if on_step is not None:
                    on_step(stats)
                every = int(t.checkpoint_every)
                if t.checkpoint_dir and ((every and (k + 1) % every == 0) or k + 1 == t.steps):
                    trainer.save()
                if bar is not None:
                    bar.set_postfix(loss=f"{stats.loss:.4f}", share=f"{stats.sharing_ratio:.1f}x",
                                    s=f"{stats.step_s:.2f}")
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return summarize(trainer.history, trainer)

"""``dta train``'s loop: config and a batch source in, summary dict out.

The caller says where batches come from (``source.batch(step) -> dta.Batch``; the CLI's
:class:`dta_cli.batches.BatchSource` generates workloads or reads a JSONL file), so the
runtime imports no workload generator.

Nothing is lost, nothing is trusted blindly:

* before step 0, before anything is written there, the checkpoint folder is claimed for this
  run until it ends (:func:`.checkpoint.prepare_run`: missing, empty or a DTA run folder —
  never a folder of other files —, writable, not held by a live run nor holding a stopped
  run's checkpoints, and for ``train.resume=true`` existing with a checkpoint);
* a failure inside a worker (a save on a full disk, say) is one line naming what was being
  done, the worker and the cause (:func:`.failures.call_workers`);
* a checkpoint every ``train.checkpoint_every`` steps (default 1) and after the last one,
  keeping the newest ``train.keep_last``; SIGINT (Ctrl-C) or SIGTERM finishes the current
  step, saves it and stops (:class:`Interrupted`; a second signal stops at once);
* a skipped update (non-finite gradient norm) is a warning and, unless
  ``train.skip_nonfinite=true``, an error naming the step;
* per-step metrics go to ``metrics.jsonl`` / ``metrics.csv`` (and TensorBoard when
  installed) in ``train.log_dir`` (default: the checkpoint folder) as the run goes; a log
  folder of its own is claimed like the checkpoint folder (:func:`.metrics.claim_log_folder`:
  not a live run's, not holding another run's rows);
* ``train.export_hf=DIR`` writes the trained model with ``save_pretrained`` at the end.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
import warnings
from typing import Callable, Protocol

from dta.batch import Batch
from runtime.checkpoints import checkpoint as ckpt
from runtime.checkpoints.claim import Claim
from runtime.errors import TrainingError
from runtime.ray_runtime.driver import Trainer
from runtime.ray_runtime.metrics import MetricsLog, claim_log_folder
from runtime.ray_runtime.stats import StepStats, summarize


class BatchSourceLike(Protocol):
    def batch(self, step: int) -> Batch: ...


class Interrupted(TrainingError):
    """The run stopped on SIGINT/SIGTERM: after a completed (and saved) step, or at once (a
    second signal, ``train.stop_grace_s`` passed, or the signal came during start-up)."""

    def __init__(self, message: str, signum: int, checkpoint: str | None,
                 step: int | None = None, at_once: bool = False):
        super().__init__(message)
        self.signum, self.checkpoint, self.step, self.at_once = signum, checkpoint, step, at_once

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


class NonFiniteUpdateWarning(UserWarning):
    pass


class _StopSignals:
    """SIGINT/SIGTERM handling. ``armed`` (training): the first signal is recorded, so the
    loop stops after the current step and its save, within ``grace_s`` seconds; a second
    signal, the grace period's end, or a signal while not armed (start-up) stops at once:
    ``stop_now`` says why and a KeyboardInterrupt unwinds (Ray's waits turn what a handler
    raises into a KeyboardInterrupt: the reason travels here, not in the exception).
    Installed after Ray's own SIGTERM handler (``cluster.start_or_join`` keeps ours)."""

    def __init__(self, grace_s: float = 30.0, broken: Callable[[], bool] | None = None,
                 abandon: Callable[[int, str], None] | None = None):
        self.grace_s = float(grace_s)
        self.received: int | None = None
        self.stop_now: tuple[int, str] | None = None
        self.armed = False
        self._previous = {}
        self._expired = False
        self._done = threading.Event()
        self.broken, self.abandon = broken, abandon  # see _watch

    def _handler(self, signum, frame):
        if self.stop_now is not None:
            return  # stopping at once already: let the shutdown finish
        if self.armed and self.received is None:
            self.received = signum
            print(f"\ndta train: {signal.Signals(signum).name} received: finishing the current "
                  f"step, then saving and stopping (within train.stop_grace_s="
                  f"{self.grace_s:g} s; again to stop at once)", file=sys.stderr, flush=True)
            threading.Thread(target=self._watch, name="dta-stop", daemon=True).start()
            return
        if self._expired:
            why = f"train.stop_grace_s={self.grace_s:g} s passed"
        elif self.received is not None:
            why = "a second signal"
        else:
            why = "the signal came during start-up"
        self.stop_now = (int(self.received or signum), why)
        raise KeyboardInterrupt

    def _watch(self):
        """After the first signal: at the grace period's end, stop at once (the handler, in
        the main thread). Where the main thread does not get there -- a Ray call that does
        not return, the private Ray's own processes gone (a SIGTERM to the whole process
        group reaches them) -- ``abandon`` ends the process (one line, the instance reaped)."""
        import _thread

        signum, end = int(self.received), time.monotonic() + self.grace_s
        while not self._done.wait(0.5):
            if self.broken is not None and self.broken():
                why = "it reached the private Ray's own processes too"
                wait = 5.0
                break
            if time.monotonic() > end:
                self._expired = True
                _thread.interrupt_main(signum)  # the handler runs in the main thread
                why = f"train.stop_grace_s={self.grace_s:g} s passed; a Ray call did not return"
                wait = 15.0
                break
        else:
            return
        if not self._done.wait(wait) and self.abandon is not None:
            self.abandon(signum, why)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_training(cfg, source: BatchSourceLike, *,
                 address: str | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None, fault=None,
                 on_step: Callable[[StepStats], None] | None = None,
                 resume_command: str | None = None) -> dict:
    """Train ``cfg.train.steps`` steps on ``source.batch(k)``; returns the summary
    (:func:`~runtime.ray_runtime.stats.summarize`). ``resume_command``: the command line
    that continues the run, for the line a stop signal ends it with."""
    from dta.config.keys import check_dta_train

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_dta_train(cfg)  # a key dta train would ignore is an error, not a no-op
    t = cfg.train
    if t.resume and not t.checkpoint_dir:
        raise TrainingError("train.resume=true needs train.checkpoint_dir (the folder to "
                            "resume from)")
    trainer = Trainer(cfg, address=address, fault=fault, log=log)
    _check_output_paths(t)  # before the claim: a bad path leaves nothing behind
    run, logs = claim_folders(t)
    try:
        return _run(cfg, trainer, run, logs, source, progress=progress, log=log,
                    on_step=on_step, resume_command=resume_command)
    finally:
        for held in (logs, run):
            if held is not None:
                held.release()


def claim_folders(t) -> tuple[ckpt.RunInfo | None, Claim | None]:
    """The run's folders are its own from here (another run's: refused, one line) until it
    ends: ``train.checkpoint_dir``, and ``train.log_dir`` when it is another folder."""
    run = ckpt.prepare_run(t.checkpoint_dir, resume=bool(t.resume)) if t.checkpoint_dir else None
    if not t.log_dir or (run is not None and os.path.isdir(str(t.log_dir))
                         and os.path.samefile(str(t.log_dir), run.directory)):
        return run, None
    try:
        return run, claim_log_folder(str(t.log_dir), run.run_id if run else None,
                                     resume=bool(t.resume))
    except BaseException:
        if run is not None:
            run.withdraw()  # refused before anything was written: its folder as it was
        raise


def _run(cfg, trainer: Trainer, run: ckpt.RunInfo | None, logs: Claim | None,
         source: BatchSourceLike, *, progress: bool, log: Callable[[str], None],
         on_step: Callable[[StepStats], None] | None,
         resume_command: str | None = None) -> dict:
    """run_training's steps, in the folders ``run`` and ``logs`` hold."""
    t = cfg.train
    trainer.run_id = run.run_id if run else (logs.run_id if logs else None)
    trainer.progress = bool(progress)
    resume_path = run.resumed_from if run else None
    if resume_path:
        ckpt.verify_manifest(resume_path)  # a corrupted checkpoint fails before Ray starts
    start = int(ckpt.read_meta(resume_path)["step"]) if resume_path else 0
    if start >= int(t.steps):
        log(f"checkpoint {resume_path} is at step {start}: nothing left of {t.steps} steps")
        return {"steps": 0, "completed_steps": start}
    first = source.batch(start)
    trainer.validate(first)  # bad input fails before Ray starts
    trainer.resolve_sharding(first)  # the run's settings, once (auto: by the memory model)
    log_dir = t.log_dir or t.checkpoint_dir
    metrics = MetricsLog(log_dir, run_id=trainer.run_id) if log_dir else None
    def abandon(signum: int, why: str) -> None:
        print(f"\ndta train: {_at_once(trainer, t, signum, why, resume_command)[0]}",
              file=sys.stderr, flush=True)
        if trainer.cluster is not None:
            trainer.cluster.abandon()
        os._exit(128 + signum)

    stop = _StopSignals(float(t.stop_grace_s), abandon=abandon,
                        broken=lambda: trainer.cluster is not None and trainer.cluster.broken())
    try:
        with stop, trainer:
            return _steps(cfg, trainer, stop, source, start, first, resume_path, metrics,
                          progress=progress, log=log, on_step=on_step,
                          resume_command=resume_command)
    except (KeyboardInterrupt, TrainingError) as exc:
        _log_full(exc, t.log_dir or t.checkpoint_dir)
        if isinstance(exc, Interrupted) or (stop.stop_now is None and stop.received is None):
            raise
        if stop.stop_now is None and isinstance(exc, KeyboardInterrupt):
            raise
        # stopped at once; or a step failed after the signal (sent to the whole process
        # group, it reached the workers and the private Ray too)
        signum, why = stop.stop_now or (stop.received, "the signal reached the workers: "
                                        f"{str(exc).split(';')[0]}")
        message, last = _at_once(trainer, t, signum, why, resume_command)
        raise Interrupted(message, signum, last, trainer.completed_steps, at_once=True) from None


def _at_once(trainer: Trainer, t, signum: int, why: str, resume_command: str | None
             ) -> tuple[str, str | None]:
    """The line of a run stopped at once, and the newest complete checkpoint."""
    last = trainer.latest_checkpoint() if t.checkpoint_dir else None
    where = (f"the newest complete checkpoint is {last}; {_resume(t, resume_command)}"
             if last else "no checkpoint was written")
    return (f"stopped at once by {signal.Signals(signum).name} ({why}) during step "
            f"{trainer.completed_steps}: {where}", last)


def _steps(cfg, trainer: Trainer, stop: _StopSignals, source: BatchSourceLike, start: int,
           first: Batch,
           resume_path: str | None, metrics: MetricsLog | None, *, progress: bool,
           log: Callable[[str], None], on_step, resume_command: str | None) -> dict:
    """The steps, on the started trainer; a stop signal ends them after a step and its save
    (:class:`Interrupted`)."""
    t = cfg.train
    every, last_saved = int(t.checkpoint_every), None
    bar = None
    try:
        if resume_path:
            trainer.load(resume_path)
            log(f"resumed run {trainer.run_id} from {resume_path} (step {start})")
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=int(t.steps), initial=start, desc="dta train", unit="step",
                       file=sys.stderr, dynamic_ncols=True)
        stop.armed = True
        for k in range(start, int(t.steps)):
            batch = first if k == start else source.batch(k)
            stats = trainer.step(batch, k)
            _check_update(stats, bool(t.skip_nonfinite))
            if metrics is not None:
                metrics.write(stats)
            if on_step is not None:
                on_step(stats)
            if t.checkpoint_dir and ((every and (k + 1) % every == 0) or k + 1 == t.steps):
                last_saved = trainer.save()
            if bar is not None:
                bar.set_postfix(loss=f"{stats.loss:.4f}", share=f"{stats.sharing_ratio:.1f}x",
                                s=f"{stats.step_s:.2f}")
                bar.update(1)
            if stop.received is not None and k + 1 < int(t.steps):
                name = signal.Signals(stop.received).name
                if t.checkpoint_dir and (last_saved is None or
                                         not last_saved.endswith(ckpt.step_name(k + 1))):
                    last_saved = trainer.save()
                where = (f"step {k + 1} saved in {last_saved}; {_resume(t, resume_command)}"
                         if t.checkpoint_dir else "nothing saved (no train.checkpoint_dir)")
                raise Interrupted(f"stopped by {name} after step {k + 1} ({k + 1 - start} "
                                  f"steps this run): {where}", stop.received, last_saved, k + 1)
        stop.armed = False
        if t.export_hf:
            path = trainer.export_hf(str(t.export_hf))
            log(f"exported the model (save_pretrained) to {path}")
    finally:
        stop.armed = False
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    out = summarize(trainer.history, trainer)
    out["sharding"] = trainer.settings.layout.sharding  # what ran (auto resolved)
    overlaps = trainer.settings.record().get("prefetch_overlaps")
    if overlaps:  # train.prefetch: which calls' all-gathers it overlaps
        out["prefetch_overlaps"] = overlaps
    if trainer.sharding_report is not None:
        out["sharding_auto"] = trainer.sharding_report
    out["param_norm"] = trainer.param_norms()[0]  # after the last step
    out["run_id"] = trainer.run_id
    out["checkpoint"] = last_saved
    if metrics is not None:
        out["metrics_log"] = metrics.paths
    return out


def _log_full(exc: BaseException, folder: str | None) -> None:
    """The workers' whole error texts (what the one line leaves out: gloo's paths, Ray's
    advice) appended to ``failures.log`` in the run's log folder, named in the line."""
    full = getattr(exc, "full", None)
    if not full or not folder:
        return
    path = os.path.join(os.path.abspath(str(folder)), "failures.log")
    try:
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {exc.args[0]}\n")
            for rank in sorted(full):
                f.write(f"worker {rank}:\n{full[rank]}\n")
    except OSError:
        return
    exc.args = (f"{exc.args[0]} (the workers' whole errors: {path})",)


def _resume(t, command: str | None) -> str:
    """How to continue the run: the command line when the caller gave it."""
    return f"resume with: {command}" if command else \
        f"continue with train.checkpoint_dir={t.checkpoint_dir} train.resume=true"


def _check_update(stats: StepStats, skip_nonfinite: bool) -> None:
    if stats.updated or math.isfinite(stats.grad_norm):
        return  # updated, or nothing to train (warned by the trainer)
    message = (f"step {stats.step}: the gradient norm is {stats.grad_norm}: the update was "
               "skipped, the model and optimizer are unchanged")
    warnings.warn(message, NonFiniteUpdateWarning, stacklevel=2)
    if not skip_nonfinite:
        raise TrainingError(message + " (set train.skip_nonfinite=true to go on past such "
                            "steps)")


def _check_output_paths(t) -> None:
    """``train.log_dir`` and ``train.export_hf``: folders, or creatable (dta.paths)."""
    from dta.paths import check_path

    if t.log_dir:
        check_path(str(t.log_dir), "dir", "train.log_dir", create=True, write=True,
                   error=TrainingError)
    if t.export_hf:
        path = os.path.abspath(str(t.export_hf))
        check_path(path, "dir", "train.export_hf", create=True, write=True, error=TrainingError)
        if os.path.isdir(path) and os.listdir(path):
            raise TrainingError(f"train.export_hf {path!r} is not empty; choose a new folder")

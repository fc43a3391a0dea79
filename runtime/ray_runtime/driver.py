"""The driver: batches in, balanced data-parallel DFS steps out.

:class:`Trainer` owns W :class:`~runtime.ray_runtime.worker.DFSWorker` actors (one per GPU,
or CPU workers). For each batch it

1. validates the batch on the driver (bad input fails here, before any worker is touched);
2. builds the batch's prefix tree (statistics) and the plan: which sequences each worker
   trains (:func:`~runtime.ray_runtime.plan.assign_workers`);
3. sends each worker its sequences (token ids and per-token metadata as numpy arrays) and
   the whole batch's loss normalizers, waits for all of them, and aggregates their stats.

A worker failure fails the step with a :class:`StepFailed` that names the worker and the
step. Workers apply the update only after the gradient all-reduce, so when a worker dies
before it, no replica has changed. The process group is broken after any failure:
:meth:`Trainer.recover` replaces every worker and restores the last checkpoint.

:func:`run_training` is ``dta train``: config in, summary dict out.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from dta.batch import Batch, BatchError
from dta.config import as_dict, loss_kwargs
from dta.losses import batch_totals, make_loss
from dta.tree import PrefixTree
from runtime.ray_runtime import checkpoint as ckpt
from runtime.ray_runtime.cluster import ClusterHandle, cluster_has_gpus, start_or_join
from runtime.ray_runtime.plan import Assignment, assign_workers, default_cost_model
from runtime.ray_runtime.worker import FAULT_ENV, DFSWorker, parse_fault


class TrainingError(RuntimeError):
    pass


class StepFailed(TrainingError):
    """A step failed on one or more workers; ``.failures`` maps rank -> description."""

    def __init__(self, message: str, step: int, failures: dict, applied: list[int]):
        super().__init__(message)
        self.step, self.failures, self.applied = step, failures, applied


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


# ------------------------------------------------------------------- model info --
def model_limits(cfg) -> tuple[int, int | None, Any]:
    """(vocab size, max positions, HF config) of the configured model, without weights."""
    if cfg.model.path:
        import transformers

        if not os.path.isdir(cfg.model.path):
            raise TrainingError(f"model.path {cfg.model.path!r} is not a local directory")
        hf = transformers.AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
    else:
        from dta.models import build_config

        hf = build_config(cfg.model.family, cfg.model.size)
    return int(hf.vocab_size), getattr(hf, "max_position_embeddings", None), hf


def required_fields(cfg) -> tuple[str, ...]:
    from runtime.ray_runtime.worker import recompute_fields

    loss = make_loss(cfg.loss.name, **loss_kwargs(cfg))
    filled = recompute_fields(cfg, loss)
    return tuple(f for f in loss.fields if f not in filled)


# ------------------------------------------------------------------ batch source --
class BatchSource:
    """Step k's batch: the workload generated with seed + k, or a slice of a JSONL file."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg, self.vocab_size = cfg, vocab_size
        self._records = None

    def records(self, step: int) -> list[dict]:
        w = self.cfg.workload
        if w.path:
            if self._records is None:
                from dta.jsonl import read_jsonl

                if not os.path.isfile(w.path):
                    raise TrainingError(f"workload.path {w.path!r} does not exist")
                self._records = read_jsonl(w.path)
                if not self._records:
                    raise TrainingError(f"workload.path {w.path!r} holds no sequences")
            n = int(w.sequences_per_step) or len(self._records)
            start = (step * n) % len(self._records)
            idx = [(start + i) % len(self._records) for i in range(n)]
            return [self._records[i] for i in idx]
        from experiments.workloads import make_workload

        scale = str(w.scale)
        scale = scale if scale in ("tiny", "small", "full") else float(scale)
        vocab = int(w.vocab_size or self.vocab_size)
        return make_workload(w.name, scale=scale, seed=int(w.seed) + int(step),
                             vocab_size=vocab).records

    def batch(self, step: int) -> Batch:
        return Batch.from_records(self.records(step))


# ------------------------------------------------------------------------ trainer --
class Trainer:
    """W DFS workers on Ray; ``step(batch)`` is one synchronized optimizer update."""

    def __init__(self, cfg, *, address: str | None = None, fault=None,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.address = address
        self.fault = parse_fault(fault if fault is not None else os.environ.get(FAULT_ENV))
        self.log = log or (lambda msg: None)
        self.vocab_size, self.max_positions, self.hf_config = model_limits(cfg)
        self.required = required_fields(cfg)
        self.cost_model = default_cost_model(self.hf_config)
        self.cluster: ClusterHandle | None = None
        self.workers: list = []
        self.infos: list[dict] = []
        self.completed_steps = 0
        self.broken: str | None = None
        self.history: list[StepStats] = []
        self.timings: dict[str, float] = {}
        self._group_dir: str | None = None
        self._generation = 0

    # ---------------------------------------------------------------- lifecycle --
    @property
    def num_workers(self) -> int:
        return int(self.cfg.ray.num_workers)

    def start(self) -> "Trainer":
        t0 = time.perf_counter()
        self.cluster = start_or_join(self.cfg.ray, address=self.address)
        self.timings["ray_start_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        self._start_workers()
        self.timings["workers_start_s"] = time.perf_counter() - t1
        return self

    def _start_workers(self) -> None:
        import ray

        r = self.cfg.ray
        gpus = r.gpus_per_worker
        if gpus is None:
            gpus = 1.0 if cluster_has_gpus() else 0.0
        total = ray.cluster_resources()
        need = {"CPU": self.num_workers * float(r.cpus_per_worker),
                "GPU": self.num_workers * float(gpus)}
        for kind, amount in need.items():
            if amount > float(total.get(kind, 0.0)) + 1e-9:
                key = "ray.cpus_per_worker" if kind == "CPU" else "ray.gpus_per_worker"
                raise TrainingError(
                    f"{self.num_workers} workers need {amount:g} {kind}s ({key} x "
                    f"ray.num_workers) but the cluster has {float(total.get(kind, 0)):g}")
        actor_cls = ray.remote(DFSWorker)
        cfg_dict = as_dict(self.cfg)
        # No runtime_env: the actors can then start in Ray's prestarted worker processes
        # (the worker sets its own torch thread count).
        self.workers = [
            actor_cls.options(num_cpus=float(r.cpus_per_worker), num_gpus=float(gpus),
                              max_restarts=0, max_task_retries=0).remote(
                                  rank, self.num_workers, cfg_dict,
                                                use_gpu=gpus > 0, fault=self.fault)
            for rank in range(self.num_workers)]
        try:
            infos = ray.get([w.info.remote() for w in self.workers],
                            timeout=float(r.step_timeout_s))
        except Exception as exc:
            self._kill_workers()
            raise TrainingError(f"starting {self.num_workers} workers failed: {exc}") from None
        backend = "nccl" if gpus > 0 and all(i["device"].startswith("cuda") for i in infos) \
            else "gloo"
        self._generation += 1
        same_node = len({i["ip"] for i in infos}) == 1
        if same_node:
            # FileStore rendezvous: nothing listens beyond loopback; a fresh file per group.
            self._group_dir = tempfile.mkdtemp(prefix="dta-pg-")
            init = "file://" + os.path.join(self._group_dir, f"store-{self._generation}")
            ifname = "lo"  # gloo's pairs and NCCL's bootstrap sockets stay on loopback
        else:
            # Workers on several nodes: a TCP store on rank 0's node (its listening socket is
            # on that node's address; keep the cluster on a private network).
            port = ray.get(self.workers[0].__ray_call__.remote(lambda self: _free_port()))
            init, ifname = f"tcp://{infos[0]['ip']}:{port}", None
        try:
            self.infos = ray.get([w.setup_group.remote(init, backend, float(r.step_timeout_s),
                                                       ifname) for w in self.workers],
                                 timeout=float(r.step_timeout_s))
        except Exception as exc:
            self._kill_workers()
            raise TrainingError(f"the workers' process group ({backend}, {init}) did not "
                                f"form: {exc}") from None
        self.backend = backend
        self.broken = None
        self.log(f"{self.num_workers} workers ({backend}, "
                 f"{'GPU' if backend == 'nccl' else 'CPU'}) ready")

    def _kill_workers(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers = []
        if self._group_dir:
            shutil.rmtree(self._group_dir, ignore_errors=True)
            self._group_dir = None

    def close(self) -> None:
        import ray

        if self.workers and ray.is_initialized():
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
            except Exception:
                pass
            self._kill_workers()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None

    def __enter__(self) -> "Trainer":
        return self.start() if self.cluster is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------- batches --
    def validate(self, batch: Batch) -> Batch:
        """Driver-side validation: bad input fails before any worker is touched."""
        if not isinstance(batch, Batch):
            raise BatchError(f"expected a dta.Batch, got {type(batch).__name__}")
        return batch.validate(vocab_size=self.vocab_size, max_positions=self.max_positions,
                              required=self.required)

    def plan(self, batch: Batch, tree: PrefixTree | None = None) -> Assignment:
        tree = tree or PrefixTree(batch.input_ids, min_shared=int(self.cfg.walker.min_shared))
        return assign_workers(tree, self.num_workers, self.cost_model)

    # ---------------------------------------------------------------------- step --
    def step(self, batch: Batch, step: int | None = None) -> StepStats:
        import ray

        if self.broken:
            raise TrainingError(f"the workers are unusable after a failure ({self.broken}); "
                                "call recover() to restart them from the last checkpoint")
        if not self.workers:
            raise TrainingError("the trainer is not started (use `with Trainer(cfg) as t:`)")
        step = self.completed_steps if step is None else int(step)
        self.validate(batch)
        t0 = time.perf_counter()
        tree = PrefixTree(batch.input_ids, min_shared=int(self.cfg.walker.min_shared))
        plan = self.plan(batch, tree)
        totals = batch_totals(batch)
        refs = {}
        for rank, (w, ids) in enumerate(zip(self.workers, plan.workers)):
            part = batch.subset(ids) if ids else None
            refs[w.step.remote(step, part, totals)] = rank
        results, failures = self._gather(refs, step)
        if failures:
            self._fail(step, results, failures)
        stats = self._aggregate(step, batch, tree, plan, results, time.perf_counter() - t0)
        self.completed_steps = step + 1
        self.history.append(stats)
        return stats

    def _gather(self, refs: dict, step: int) -> tuple[dict, dict]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        pending = dict(refs)
        results, failures = {}, {}
        deadline = time.monotonic() + float(self.cfg.ray.step_timeout_s)
        grace = None  # once one worker failed, the others get a short time to report
        while pending:
            limit = deadline if grace is None else min(deadline, grace)
            ready, _ = ray.wait(list(pending), num_returns=1,
                                timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                for rank in pending.values():
                    failures[rank] = ("hung", "did not finish the step within "
                                      f"{self.cfg.ray.step_timeout_s:g} s" if grace is None
                                      else "did not report after a peer failed")
                break
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref, timeout=0)
                except RayActorError as exc:  # the worker process died
                    failures[rank] = ("died", _first_line(exc))
                except RayTaskError as exc:  # the step raised
                    cause = getattr(exc, "cause", None) or exc
                    failures[rank] = ("raised", f"{type(cause).__name__}: {_first_line(cause)}")
                except GetTimeoutError:
                    pending[ref] = rank
                if failures and grace is None:
                    grace = time.monotonic() + 30.0
        return results, failures

    def _fail(self, step: int, results: dict, failures: dict) -> None:
        applied = sorted(r for r, s in results.items() if s.get("updated"))
        order = sorted(failures, key=lambda r: (failures[r][0] != "died", r))
        culprit = order[0]
        kind, detail = failures[culprit]
        detail = detail.rstrip(". ")
        info = self.infos[culprit] if culprit < len(self.infos) else {}
        where = f"pid {info.get('pid', '?')} on {info.get('ip', '?')}"
        verb = {"died": "died", "raised": "raised", "hung": "hung"}[kind]
        parts = [f"step {step} failed: worker {culprit} ({where}) {verb}: {detail}"]
        for r in order[1:]:
            parts.append(f"worker {r} {failures[r][0]}: {failures[r][1]}")
        if applied:
            state = (f"workers {applied} applied the update before the failure, so the "
                     "replicas now disagree")
        else:
            state = (f"no worker applied the update: the model and optimizer state are as "
                     f"after step {step - 1}" if step > 0 else
                     "no worker applied the update: the model and optimizer are unchanged")
        last = ckpt.latest_checkpoint(self.cfg.train.checkpoint_dir)
        resume = (f"; recover() (or `dta train train.resume=true`) restarts the workers from "
                  f"{last}" if last else "; no checkpoint to resume from")
        message = "; ".join(parts) + ". " + state + resume
        self.broken = f"step {step}, worker {culprit} {verb}"
        raise StepFailed(message, step, failures, applied)

    def _aggregate(self, step, batch, tree, plan, results, wall) -> StepStats:
        ordered = [results[r] for r in sorted(results)]
        st = tree.stats()
        forwarded = int(sum(s["unique_tokens"] for s in ordered))
        return StepStats(
            step=step, loss=float(sum(s["loss"] for s in ordered)), sequences=len(batch),
            total_tokens=st.total_tokens, unique_tokens=st.unique_tokens,
            forwarded_tokens=forwarded, sharing_ratio=st.sharing_ratio,
            duplicated_tokens=forwarded - st.unique_tokens, imbalance=plan.imbalance,
            step_s=wall, grad_norm=float(ordered[0]["grad_norm"]),
            updated=all(s["updated"] for s in ordered), plan_method=plan.method,
            workers=ordered)

    # ---------------------------------------------------------------- streaming --
    def train_stream(self, source, *, target_sequences: int | None = None,
                     target_tokens: int | None = None, max_steps: int | None = None,
                     drop_last: bool = False, on_step=None) -> list[StepStats]:
        """Train on batches cut from a rollout stream (see :mod:`.stream`)."""
        from runtime.ray_runtime.stream import StreamingBatcher

        s = self.cfg.stream
        batcher = StreamingBatcher(
            source, target_sequences=int(s.target_sequences if target_sequences is None
                                         else target_sequences),
            target_tokens=int(s.target_tokens if target_tokens is None else target_tokens),
            drop_last=drop_last)
        out = []
        for sb in batcher:
            stats = self.step(sb.batch)
            if on_step is not None:
                on_step(sb, stats)
            out.append(stats)
            if max_steps is not None and len(out) >= max_steps:
                break
        return out

    # ------------------------------------------------------------ checkpoints --
    def save(self, directory: str | None = None, extra: dict | None = None) -> str:
        import ray

        directory = directory or self.cfg.train.checkpoint_dir
        if not directory:
            raise TrainingError("no checkpoint directory: set train.checkpoint_dir")
        if self.broken:
            raise TrainingError(f"refusing to checkpoint unusable workers ({self.broken})")
        meta = {"config": as_dict(self.cfg), "num_workers": self.num_workers,
                "plan": {"method": self.history[-1].plan_method if self.history else None,
                         "cost_model": repr(self.cost_model)},
                "history": [_brief(s) for s in self.history], **(extra or {})}
        return ray.get(self.workers[0].save_checkpoint.remote(
            os.path.abspath(directory), self.completed_steps, meta))

    def load(self, path: str) -> dict:
        import ray

        metas = ray.get([w.load_checkpoint.remote(os.path.abspath(path)) for w in self.workers])
        self.completed_steps = int(metas[0]["step"])
        return metas[0]

    def recover(self, path: str | None = None) -> dict | None:
        """Replace every worker (new process group) and restore the last checkpoint (or
        ``path``); without a checkpoint, the initial weights (only valid before step 0)."""
        path = path or ckpt.latest_checkpoint(self.cfg.train.checkpoint_dir)
        self._kill_workers()
        self._start_workers()
        if path:
            return self.load(path)
        if self.completed_steps:
            raise TrainingError(f"no checkpoint to recover from after {self.completed_steps} "
                                "completed steps (set train.checkpoint_dir)")
        return None

    # -------------------------------------------------------------------- tests --
    def worker_state(self, rank: int) -> dict:
        import ray
        return ray.get(self.workers[rank].state.remote())

    def worker_gradients(self, rank: int) -> dict:
        import ray
        return ray.get(self.workers[rank].gradients.remote())

    def digests(self) -> list[float]:
        import ray
        return ray.get([w.digest.remote() for w in self.workers])


def _first_line(exc) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("Traceback"):
            return line[:400]
    return type(exc).__name__


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _brief(s: StepStats) -> dict:
    return {"step": s.step, "loss": s.loss, "total_tokens": s.total_tokens,
            "unique_tokens": s.unique_tokens, "step_s": s.step_s}


# ------------------------------------------------------------------ run_training --
def summarize(history: list[StepStats], trainer: Trainer | None = None) -> dict:
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
    }
    if trainer is not None:
        out.update(trainer.timings)
        out["backend"] = getattr(trainer, "backend", None)
        out["completed_steps"] = trainer.completed_steps
    return out


def run_training(cfg, *, address: str | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None, fault=None,
                 on_step: Callable[[StepStats], None] | None = None) -> dict:
    """Train ``cfg.train.steps`` steps; returns the summary (see :func:`summarize`)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    trainer = Trainer(cfg, address=address, fault=fault, log=log)
    source = BatchSource(cfg, trainer.vocab_size)
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

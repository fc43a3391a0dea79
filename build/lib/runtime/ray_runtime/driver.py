"""The driver: batches in, balanced data-parallel DFS steps out.

:class:`Trainer` owns W :class:`~runtime.ray_runtime.worker.DFSWorker` actors (one per GPU,
or CPU workers; started by :mod:`.actors`). For each batch it

1. validates the batch on the driver (bad input fails here, before any worker is touched);
2. builds the batch's prefix tree and the plan: which sequences each worker trains
   (:func:`dta.planning.workers.assign_workers`, pure metadata);
3. sends each worker its sequences (token ids and per-token metadata as numpy arrays) and
   the whole batch's loss normalizers, waits for all of them (:func:`.failures.gather`),
   and aggregates their stats (:mod:`.stats`).

A worker failure fails the step with a :class:`~.errors.StepFailed` that names the worker
and the step. Workers apply the update only after the gradient collective, so when a worker
dies before it, no replica has changed. The process group is broken after any failure:
:meth:`Trainer.recover` replaces every worker and restores the last checkpoint.

The driver does not know where batches come from: :func:`.run.run_training` takes a batch
source from its caller.
"""
from __future__ import annotations

import os
import time
from typing import Callable

from dta.batch import Batch, BatchError
from dta.config.schema import as_dict
from dta.losses import batch_totals
from dta.options import AUTO, NO_CUT, WalkOptions
from dta.planning.workers import WorkerPlan, assign_workers, default_cost_model
from dta.tree import PrefixTree
from runtime.checkpoints import checkpoint as ckpt
from runtime.engine import RunSettings, resolve_run_config
from runtime.errors import StepFailed, TrainingError, WorkerError
from runtime.ray_runtime.actors import WorkerGroup, start_workers
from runtime.ray_runtime.cluster import ClusterHandle, start_or_join
from runtime.ray_runtime.failures import call_workers, failure_message, gather
from runtime.ray_runtime.model_info import model_limits, required_fields
from runtime.ray_runtime.stats import StepStats, step_stats
from runtime.ray_runtime.worker import FAULT_ENV, parse_fault


class Trainer:
    """W DFS workers on Ray; ``step(batch)`` is one synchronized optimizer update."""

    def __init__(self, cfg, *, address: str | None = None, fault=None,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.address = address
        self.fault = parse_fault(fault if fault is not None else os.environ.get(FAULT_ENV))
        self.log = log or (lambda msg: None)
        self.vocab_size, self.max_positions, self.hf_config = model_limits(cfg)
        # the run's resolved settings (layout and walk; auto decided by the memory model on
        # the first batch): built once in resolve_sharding, handed to every worker unchanged
        self._settings: RunSettings | None = None
        self.required = required_fields(cfg)
        self.cost_model = default_cost_model(self.hf_config)
        self.cluster: ClusterHandle | None = None
        self.group: WorkerGroup | None = None
        self.completed_steps = 0
        self.broken: str | None = None
        self.history: list[StepStats] = []
        self.timings: dict[str, float] = {}
        self._generation = 0
        self.run_id: str | None = None  # the checkpoint folder's run (set by run_training)
        self.progress = False  # a tokens bar inside each step (set by run_training)
        self._board = None

    # ---------------------------------------------------------------- lifecycle --
    @property
    def settings(self) -> RunSettings:
        """The run's resolved settings (resolved now, without a batch, if not yet)."""
        if self._settings is None:
            self.resolve_sharding()
        return self._settings

    @property
    def walk(self) -> WalkOptions:
        """The run's walk settings: the object every worker walks with."""
        return self.settings.walk

    @property
    def sharding_report(self) -> dict | None:
        """The memory model's report, when it chose (train.sharding=auto, or an auto block
        under train.memory_budget_gib)."""
        return self.settings.report

    @property
    def sharded(self) -> bool:
        """Sharded state (zero1/fsdp on several workers): DCP checkpoints."""
        return self.settings.layout.sharded

    def latest_checkpoint(self) -> str | None:
        if self.sharded:
            from runtime.dcp import latest_sharded
            return latest_sharded(self.cfg.train.checkpoint_dir)
        return ckpt.latest_checkpoint(self.cfg.train.checkpoint_dir)

    @property
    def num_workers(self) -> int:
        return int(self.cfg.ray.num_workers)

    @property
    def workers(self) -> list:
        return self.group.workers if self.group is not None else []

    @property
    def infos(self) -> list[dict]:
        return self.group.infos if self.group is not None else []

    @property
    def backend(self) -> str | None:
        return self.group.backend if self.group is not None else None

    def resolve_sharding(self, batch: Batch | None = None) -> str:
        """Resolve the run's settings once (``runtime.engine.resolve_run_config``):
        ``train.sharding=auto`` and ``walker.block_tokens=auto`` by the memory model on the
        first batch's tree, context parallelism priced at ``train.context_parallel``; the
        layout and the walk every worker receives. Returns the sharding mode. The config is
        left as written (checkpoints record both)."""
        if self._settings is not None:
            return self._settings.layout.sharding
        tree = PrefixTree(batch.input_ids) if batch is not None else None
        try:
            self._settings = resolve_run_config(self.cfg, self.hf_config, tree)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
        layout, walk = self._settings.layout, self._settings.walk
        if str(self.cfg.train.sharding) == AUTO:
            self.log(f"train.sharding=auto -> {layout.sharding} (priced at "
                     f"train.context_parallel={layout.context_parallel})")
        if self.cfg.train.context_parallel == AUTO:
            self.log(f"train.context_parallel=auto -> {layout.context_parallel}")
        if self.cfg.walker.block_tokens == AUTO:
            block = walk.block_tokens
            self.log(f"walker.block_tokens=auto -> {'no cut' if block == NO_CUT else block}")
        return layout.sharding

    def start(self) -> "Trainer":
        """Ray, then the workers; a failure on the way undoes what was started."""
        self.resolve_sharding()
        try:
            t0 = time.perf_counter()
            self.log("starting Ray" + (f" (joining {self.address})" if self.address else
                                       " (a private local instance on 127.0.0.1)"))
            self.cluster = start_or_join(self.cfg.ray, address=self.address)
            self.timings["ray_start_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            self.log(f"Ray ready in {self.timings['ray_start_s']:.1f} s; starting "
                     f"{self.num_workers} workers (each builds its model replica)")
            self._start_workers()
            self.timings["workers_start_s"] = time.perf_counter() - t1
            self.cluster.tighten()  # the workers' session folders too
        except BaseException:
            self.close()
            raise
        return self

    def _start_workers(self) -> None:
        self._generation += 1
        self.group = start_workers(self.cfg, self.num_workers, fault=self.fault,
                                   generation=self._generation, settings=self.settings)
        self.broken = None
        self.log(f"{self.num_workers} workers ({self.backend}, "
                 f"{'GPU' if self.backend == 'nccl' else 'CPU'}) ready")

    def _kill_workers(self) -> None:
        if self.group is not None:
            self.group.kill()
            self.group = None

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

    @property
    def context_parallel(self) -> int:
        """Ranks per tree (train.context_parallel): ranks [g·C, (g+1)·C) form group g."""
        return self.settings.layout.context_parallel

    def plan(self, batch: Batch, tree: PrefixTree | None = None) -> WorkerPlan:
        """Trees balanced over the data-parallel groups (ray.num_workers / context_parallel):
        the ranks of a context-parallel group walk the same share."""
        tree = tree or PrefixTree(batch.input_ids, min_shared=self.walk.min_shared)
        return assign_workers(tree, self.settings.layout.data_parallel, self.cost_model)

    # ---------------------------------------------------------------------- step --
    def step(self, batch: Batch, step: int | None = None) -> StepStats:
        if self.broken:
            raise TrainingError(f"the workers are unusable after a failure ({self.broken}); "
                                "call recover() to restart them from the last checkpoint")
        if not self.workers:
            raise TrainingError("the trainer is not started (use `with Trainer(cfg) as t:`)")
        step = self.completed_steps if step is None else int(step)
        self.validate(batch)
        if batch.trained_tokens() == 0:  # the workers skip the update (see DFSWorker.step)
            from dta.train import warn_no_trained_token

            warn_no_trained_token(len(batch), step)
        t0 = time.perf_counter()
        tree = PrefixTree(batch.input_ids, min_shared=self.walk.min_shared)
        plan = self.plan(batch, tree)
        totals = batch_totals(batch)
        board, bar = self._step_bar(step, plan)
        refs = {}
        for rank, w in enumerate(self.workers):
            ids = plan.workers[rank // self.context_parallel]  # its data-parallel group's share
            part = batch.subset(ids) if ids else None
            refs[w.step.remote(step, part, totals, board)] = rank
        try:
            results, failures = gather(refs, float(self.cfg.ray.step_timeout_s),
                                       on_tick=None if bar is None else bar.tick)
        finally:
            if bar is not None:
                bar.close()
        if failures:
            last = self.latest_checkpoint()
            message, culprit, verb, applied = failure_message(step, results, failures,
                                                              self.infos, last)
            self.broken = f"step {step}, worker {culprit} {verb}"
            raise StepFailed(message, step, failures, applied)
        stats = step_stats(step, batch, tree.stats(), plan, results, time.perf_counter() - t0)
        self.completed_steps = step + 1
        self.history.append(stats)
        return stats

    def _step_bar(self, step: int, plan):
        """(board, bar) for a tokens bar inside the step, or (None, None)."""
        if not self.progress:
            return None, None
        import ray

        from runtime.ray_runtime.progress import ProgressBoard

        if self._board is None:
            self._board = ray.remote(num_cpus=0)(ProgressBoard).remote()
        total = int(sum(getattr(plan, "unique_tokens", None) or [])) or None
        return self._board, _TokensBar(self._board, step, total)

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
        directory = directory or self.cfg.train.checkpoint_dir
        if not directory:
            raise TrainingError("no checkpoint directory: set train.checkpoint_dir")
        if self.broken:
            raise TrainingError(f"refusing to checkpoint unusable workers ({self.broken})")
        meta = {"config": as_dict(self.cfg), "num_workers": self.num_workers,
                "settings": self.settings.record(),  # what auto resolved to, the walk
                "plan": {"method": self.history[-1].plan_method if self.history else None,
                         "cost_model": repr(self.cost_model)},
                "history": [s.brief() for s in self.history], **(extra or {})}
        keep = int(getattr(self.cfg.train, "keep_last", 0) or 0) or None
        directory = os.path.abspath(directory)
        refused = ckpt.foreign_folder(directory)  # before any rank enters a collective
        if refused:
            raise ckpt.CheckpointError(refused)
        action = f"saving checkpoint {ckpt.step_name(self.completed_steps)} in {directory!r}"
        try:  # sharded: every rank writes its shards (DCP); replicated: rank 0
            return self._call(action, lambda w: w.save_checkpoint.remote(
                directory, self.completed_steps, meta, self.run_id, keep))[0]
        except WorkerError as exc:
            last = self.latest_checkpoint()
            raise exc.extend(f"the newest complete checkpoint is still {last!r} (resume from "
                             "it with train.resume=true)" if last else
                             "no checkpoint was written") from exc.__cause__

    def export_hf(self, path: str) -> str:
        """Write the trained model with ``save_pretrained`` (rank 0; replicas are identical;
        sharded, every worker takes part in gathering the full state and rank 0 writes)."""
        if self.broken:
            raise TrainingError(f"refusing to export unusable workers ({self.broken})")
        path = os.path.abspath(path)
        return self._call(f"exporting the model (save_pretrained) to {path!r}",
                          lambda w: w.export_hf.remote(path))[0]

    def load(self, path: str) -> dict:
        path = os.path.abspath(path)
        metas = self._call(f"loading checkpoint {path!r}",
                           lambda w: w.load_checkpoint.remote(path), ranks="all")
        self.completed_steps = int(metas[0]["step"])
        return metas[0]

    def recover(self, path: str | None = None) -> dict | None:
        """Replace every worker (new process group) and restore the last checkpoint (or
        ``path``); without a checkpoint, the initial weights (only valid before step 0)."""
        path = path or self.latest_checkpoint()
        self._kill_workers()
        self._start_workers()
        if path:
            return self.load(path)
        if self.completed_steps:
            raise TrainingError(f"no checkpoint to recover from after {self.completed_steps} "
                                "completed steps (set train.checkpoint_dir)")
        return None

    def param_norms(self) -> list[float]:
        """Each worker's L2 norm of all parameters (one collective where sharded)."""
        return self._call("computing the parameter norm", lambda w: w.param_norm.remote(),
                          "all")

    def call(self, action: str, fn, ranks=None) -> list:
        """``fn(worker)`` run inside the workers of ``ranks`` (Ray's ``__ray_call__``: "all";
        default every rank if sharded, else rank 0), their results by rank; a failure is one
        line naming ``action`` (what tests and tools read of the workers' state)."""
        return self._call(action, lambda w: w.__ray_call__.remote(fn), ranks)

    def _call(self, action: str, call, ranks=None) -> list:
        """``call(worker)`` on ``ranks`` ("all"; default: every rank if sharded, else rank
        0); a failure is one line (:func:`.failures.call_workers`). A failed collective
        (several sharded ranks) or a dead or hung worker leaves the group unusable."""
        if ranks is None:
            ranks = "all" if self.sharded else [0]
        ranks = list(range(len(self.workers))) if ranks == "all" else list(ranks)
        try:
            return call_workers(self.workers, self.infos, action, call, ranks=ranks)
        except WorkerError as exc:
            if (self.sharded and len(ranks) > 1) or any(k != "raised" for k, _ in
                                                        exc.failures.values()):
                self.broken = f"{action} failed"
            raise


class _TokensBar:
    """A tqdm bar of the tokens the workers have walked in this step."""

    def __init__(self, board, step: int, total: int | None):
        import sys

        from tqdm import tqdm

        self.board, self.step = board, step
        self.bar = tqdm(total=total, desc=f"step {step}", unit="tok", leave=False,
                        file=sys.stderr, dynamic_ncols=True, unit_scale=True)

    def tick(self) -> None:
        import ray

        try:
            walked = ray.get(self.board.walked.remote(self.step), timeout=1.0)
        except Exception:
            return
        self.bar.update(max(0, walked - self.bar.n))

    def close(self) -> None:
        self.bar.close()

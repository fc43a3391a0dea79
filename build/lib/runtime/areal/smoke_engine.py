"""``SmokeInferenceEngine``: an in-process AReaL ``InferenceEngine`` on Hugging Face
``generate`` — **for smoke runs and tests only** (CPU, tiny models).

It lets an AReaL + DTA configuration run end to end on a laptop in a minute, before going to
GPUs with SGLang or vLLM: ``DTAPPOTrainer(config, dataset, inference_engine=...)`` trains with
it instead of launching ``RemoteSGLangEngine``. It is deliberately simple and *not* a serving
engine:

* one model, in this process, on the CPU (or the given device); requests run one at a time;
  one training process (world size 1): a disk update reaches rank 0's engine only, as it
  reaches the shared servers of a real run;
* ``rollout_batch`` / ``prepare_batch`` run the workflow's episodes **synchronously, in data
  order** (no staleness window, no overlap with training: every trajectory is on-policy);
  ``submit`` queues an episode and ``wait`` runs the queue;
* sampling is reproducible: request ``k`` after ``set_version(v)`` samples with the seed
  ``(seed, v, k)``, so a resumed run regenerates exactly what an uninterrupted one generates;
* weights arrive like they arrive at an SGLang server: ``update_weights_from_disk(meta)``
  returns a future that waits for AReaL's name-resolve "weights ready" record
  (``names.update_weights_from_disk(experiment, trial, version)``), then loads the HF weights
  from ``meta.path`` (and deletes the directory when ``meta.clear_checkpoint_after_load``).
  Every load is recorded in :attr:`SmokeInferenceEngine.updates`. NCCL (``xccl``) updates
  need a real inference server and are refused.

Log-probs are ``log_softmax(logits / temperature)`` of the sampled tokens, the quantity the
train engine recomputes.
"""
from __future__ import annotations

import asyncio
import hashlib
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import torch
from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import ModelRequest, ModelResponse, WeightUpdateMeta

__all__ = ["SmokeInferenceEngine"]

_RECORD_TIMEOUT_S = 120.0  # what AReaL's remote client waits for the "weights ready" record


class SmokeInferenceEngine(InferenceEngine):
    """See the module doc. ``config`` is AReaL's ``InferenceEngineConfig`` (its
    ``experiment_name`` / ``trial_name`` key the weight-update records); ``model_path`` a
    local HF directory."""

    def __init__(self, config, model_path: str, *, seed: int = 1, device: str = "cpu",
                 dtype: str = "float32", lora_path: str | None = None):
        self.config = config
        self.model_path = str(model_path)
        self.lora_path = lora_path  # LoRA: the initial adapter served on the base
        self.seed = int(seed)
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.model = None
        self.updates: list[dict[str, Any]] = []  # one entry per weight load
        self._version = 0
        self._requests_at_version = 0
        self._initialized = False
        self._paused = False
        self._queue: list[tuple[int, dict, Any, Any]] = []
        self._next_task = 0
        self._data_generator = None
        self._pool: ThreadPoolExecutor | None = None
        # PPOTrainer reads rollout.workflow_executor.staleness_manager after a recovery;
        # synchronous rollouts have no staleness window
        self._executor = SimpleNamespace(staleness_manager=None)

    # ----------------------------------------------------------------- lifecycle --
    def initialize(self, engine_id: str | None = None, addr=None,
                   train_data_parallel_size: int | None = None, **kwargs):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.dtype, local_files_only=True).to(self.device).eval()
        if self.lora_path is not None:
            from runtime.areal.checkpoint import load_adapter

            self.model, _ = load_adapter(self.model, self.lora_path, what="initial adapter")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smoke-weights")
        self._initialized = True

    def destroy(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.model, self._pool, self._initialized = None, None, False

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def workflow_executor(self):
        return self._executor

    # ----------------------------------------------------------------- versions --
    def set_version(self, version: int) -> None:
        self._version = int(version)
        self._requests_at_version = 0

    def get_version(self) -> int:
        return self._version

    # --------------------------------------------------------------- generation --
    def _request_seed(self) -> int:
        key = f"{self.seed}/{self._version}/{self._requests_at_version}".encode()
        self._requests_at_version += 1
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """One completion of ``req.input_ids`` with HF ``generate`` (see the module doc)."""
        if not self._initialized:
            raise RuntimeError("SmokeInferenceEngine is not initialized: call initialize()")
        g = req.gconfig
        if g.n_samples != 1:
            raise ValueError("inference engines generate one sample per request "
                             f"(gconfig.n_samples={g.n_samples}); submit several requests")
        max_new = min(g.max_tokens - len(req.input_ids), g.max_new_tokens)
        if max_new <= 0:
            raise RuntimeError(f"no room to generate: max_tokens={g.max_tokens}, prompt "
                               f"length {len(req.input_ids)}, max_new_tokens={g.max_new_tokens}")
        stop = list(g.stop_token_ids or [])
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if not g.ignore_eos and eos is not None:
            stop += [eos] if isinstance(eos, int) else list(eos)
        start = time.perf_counter()
        seed = self._request_seed()
        prompt = torch.tensor([req.input_ids], dtype=torch.long, device=self.device)
        kwargs = dict(max_new_tokens=max_new, min_new_tokens=g.min_new_tokens,
                      do_sample=not g.greedy, output_logits=True,
                      return_dict_in_generate=True,
                      pad_token_id=self.model.generation_config.pad_token_id or 0,
                      eos_token_id=stop or None, attention_mask=torch.ones_like(prompt))
        if not g.greedy:
            kwargs.update(temperature=g.temperature, top_p=g.top_p,
                          top_k=g.top_k if 0 < g.top_k < 10**8 else 0)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(prompt, **kwargs)
        tokens = out.sequences[0, prompt.shape[1]:].tolist()
        temperature = 1.0 if g.greedy else float(g.temperature)
        logprobs = [float(torch.log_softmax(logits[0].float() / temperature, -1)[t])
                    for logits, t in zip(out.logits, tokens)]
        stopped = bool(tokens) and tokens[-1] in stop
        latency = time.perf_counter() - start
        return ModelResponse(input_tokens=list(req.input_ids), output_tokens=tokens,
                             output_logprobs=logprobs,
                             output_versions=[self._version] * len(tokens),
                             stop_reason="stop" if stopped else "length", latency=latency,
                             ttft=latency, tokenizer=req.tokenizer)

    # ----------------------------------------------------------------- workflows --
    def _resolve_workflow(self, workflow, workflow_kwargs, group_size: int):
        from areal.api.workflow_api import RolloutWorkflow
        from areal.infra.remote_inf_engine import GroupedRolloutWorkflow
        from areal.utils import logging
        from areal.utils.dynamic_import import import_from_string

        if isinstance(workflow, str):
            workflow = import_from_string(workflow)
        if isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
            workflow = workflow(**(workflow_kwargs or {}))
        if not isinstance(workflow, RolloutWorkflow):
            raise TypeError(f"SmokeInferenceEngine runs RolloutWorkflow episodes; got "
                            f"{type(workflow).__name__} (agent workflows need AReaL's proxy)")
        if group_size > 1:
            workflow = GroupedRolloutWorkflow(workflow, group_size,
                                              logging.getLogger("SmokeInferenceEngine"))
        return workflow

    def _run_episode(self, workflow, data, task_id: int, is_eval: bool = False):
        from areal.infra import workflow_context
        from areal.infra.workflow_context import WorkflowContext

        async def episode():
            workflow_context.set(WorkflowContext(is_eval=is_eval, task_id=task_id))
            return await workflow.arun_episode(self, data)

        return asyncio.run(episode())

    def _task_id(self) -> int:
        self._next_task += 1
        return self._next_task - 1

    def submit(self, data, workflow, workflow_kwargs=None, should_accept_fn=None,
               group_size: int = 1, task_id: int | None = None, is_eval: bool = False,
               **kwargs) -> int:
        task_id = self._task_id() if task_id is None else task_id
        self._queue.append((task_id, data, self._resolve_workflow(workflow, workflow_kwargs,
                                                                  group_size),
                            (should_accept_fn, is_eval)))
        return task_id

    def wait(self, count: int, timeout: float | None = None, raise_timeout: bool = True):
        """Run queued episodes in submission order; returns ``count`` results (None for a
        rejected one)."""
        if count > len(self._queue):
            if raise_timeout:
                raise TimeoutError(f"waiting for {count} results, {len(self._queue)} queued")
            return []
        results = []
        for task_id, data, workflow, (accept, is_eval) in self._queue[:count]:
            traj = self._run_episode(workflow, data, task_id, is_eval)
            results.append(traj if traj is not None and (accept is None or accept(traj))
                           else None)
        del self._queue[:count]
        return results

    def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size: int = 1):
        """Every item's episode, in order; the accepted trajectories."""
        workflow = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        out = [self._run_episode(workflow, item, self._task_id()) for item in data]
        return [t for t in out if t is not None]

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None,
                      group_size: int = 1, dynamic_bs: bool = False):
        """The next ``dataloader.batch_size`` accepted trajectories, items taken in data order
        from the dataloader (cycled over epochs; the iterator is kept across calls, as AReaL's
        executor keeps its generator, so the dataloader's state is what was consumed)."""
        from areal.utils.data import cycle_dataloader

        workflow = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        if isinstance(should_accept_fn, str):
            from areal.utils.dynamic_import import import_from_string

            should_accept_fn = import_from_string(should_accept_fn)
        if self._data_generator is None:
            self._data_generator = (item for batch in cycle_dataloader(dataloader)
                                    for item in batch)
        accepted, attempts = [], 0
        while len(accepted) < dataloader.batch_size:
            if dynamic_bs and attempts >= dataloader.batch_size:
                break
            traj = self._run_episode(workflow, next(self._data_generator), self._task_id())
            attempts += 1
            if traj is not None and (should_accept_fn is None or should_accept_fn(traj)):
                accepted.append(traj)
        return accepted

    # ------------------------------------------------------------- weight updates --
    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future:
        """A future that waits for the trainer's "weights ready" record of the current
        version, then loads ``meta.path`` (see the module doc)."""
        if meta.type != "disk" or meta.path is None:
            raise ValueError(f"a disk weight update needs type 'disk' and a path; got "
                             f"type {meta.type!r}, path {meta.path!r}")
        if self.config.experiment_name is None or self.config.trial_name is None:
            raise RuntimeError("experiment_name and trial_name must be set in the inference "
                               "engine config for disk weight updates")
        return self._pool.submit(self._load_from_disk, meta, self._version)

    def _load_from_disk(self, meta: WeightUpdateMeta, version: int) -> float:
        from areal.utils import name_resolve, names

        from runtime.areal.checkpoint import is_adapter_dir, load_adapter, load_hf_weights

        key = names.update_weights_from_disk(self.config.experiment_name,
                                             self.config.trial_name, version)
        saved_at = float(name_resolve.wait(key, timeout=_RECORD_TIMEOUT_S))
        if is_adapter_dir(meta.path):  # LoRA (meta.use_lora): the adapter on the base
            self.model, state = load_adapter(self.model, meta.path, what="adapter folder")
        else:
            state = load_hf_weights(self.model, meta.path, what="weights folder")
        self.updates.append(dict(version=meta.version, path=meta.path, record=key,
                                 checksum=float(sum(t.double().sum() for t in state.values()
                                                    if t.is_floating_point()))))
        if meta.clear_checkpoint_after_load:
            shutil.rmtree(meta.path, ignore_errors=True)
        return time.time() - saved_at

    def init_weights_update_group(self, meta, rank_ids=None) -> Future:
        raise NotImplementedError("SmokeInferenceEngine takes disk weight updates only "
                                  "(actor.weight_update_mode=disk); xccl needs SGLang/vLLM")

    def update_weights_from_distributed(self, meta, param_specs) -> Future:
        raise NotImplementedError("SmokeInferenceEngine takes disk weight updates only "
                                  "(actor.weight_update_mode=disk); xccl needs SGLang/vLLM")

    # --------------------------------------------------------------- flow control --
    # Rollouts run synchronously inside prepare_batch / rollout_batch / wait, so nothing is
    # ever generating while the trainer updates weights: pausing only records the state.
    def pause_generation(self):
        self._paused = True

    def continue_generation(self):
        self._paused = False

    def pause(self):
        self._paused = True

    def resume(self):
        self._paused = False

    def offload(self):
        self.model.to("cpu")

    def onload(self, tags=None):
        self.model.to(self.device)

    def export_stats(self) -> dict[str, float]:
        from areal.utils import stats_tracker

        return stats_tracker.export_all(reduce_group=None)

"""``DTATrainEngine``: AReaL's ``TrainEngine`` on DTA's depth-first prefix-tree walker.

``train_batch`` keeps the semantics of AReaL's ``FSDPEngine.train_batch`` (areal 1.0.4,
``engine/fsdp_engine.py:760``): one optimizer step on a right-padded ``[B, S]`` batch (or a
list of them), ``loss_fn(logprobs, entropy, mb, vocab_min_logits=, vocab_max_logits=)`` on
packed 1-D tensors with ``cu_seqlens``, the gradient of ``Σ loss_weight_fn(mb) · loss /
Σ loss_weight_fn`` over the whole batch (all data-parallel ranks), gradient clipping, and a
skipped update on a non-finite gradient norm. The difference is how the gradient is computed:
every sequence is its own micro-batch and the batch is walked as one prefix tree
(``runtime/areal/walks.py``), so a shared prefix is forwarded once.

The gradient is FSDPEngine's with one sequence per micro-batch (to rounding: tests/test_areal.py
checks it against FSDPEngine in float32 and a per-sequence reference in float64). The model
stays in eval mode (the walks need one deterministic forward: no dropout); AReaL's config
rejects float64, ``DTAOptions(dtype="float64")`` overrides it for verification. The engine
core (``runtime.engine``, docs/engine.md) builds, shards, walks, reduces (SUM: each rank's
loss scaled by ``loss_weight_fn(mb) / Σ_all loss_weight_fn``), clips, steps and holds the state.

This class is the whole adapter: every AReaL member, each a translation into the core.
The translations are pure functions, one module per kind: ``options.py`` (DTAOptions),
``parallel.py`` (AReaL's allocation as the core's layout), ``translate.py`` (the config as
the core's inputs), ``optimizer.py`` (AReaL's optimizer and LR scheduler), ``walks.py`` (the
batches and losses as the core's walks), ``checkpoint.py`` (``SaveLoadMeta`` onto the core's
checkpoints, ``runtime.checkpoints``), ``rollout.py`` (weight updates), ``convert.py``
(AReaL's tensors). Colocated offload (``offload()`` / ``onload()``, AReaL's colocated
rollout) is the sharding mode's own move of everything it holds (``Sharding.to``: every
layout); ``actor.dta.offload=optimizer`` is another thing, the optimizer stepped in host
memory (``runtime.sharding.offload``).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from areal.api.cli_args import TrainEngineConfig
from areal.api.engine_api import TrainEngine
from areal.api.io_struct import DeviceRuntimeInfo, FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal.utils import stats_tracker

from runtime.areal import checkpoint as ckpt
from runtime.areal import rollout, walks
from runtime.areal.optimizer import build_lr_scheduler
from runtime.areal.options import DTAOptions
from runtime.areal.parallel import init_default_group, layout_of, strategy_of
from runtime.areal.translate import check_config, make_core, requested_walk
from runtime.checkpoints.hf import local_tokenizer
from runtime.engine import ParallelLayout, ProcessGroups, comm, settle
from runtime.engine.layout import build_groups

__all__ = ["DTAOptions", "DTATrainEngine"]

logger = logging.getLogger("DTATrainEngine")


class DTATrainEngine(TrainEngine):
    """An AReaL ``TrainEngine`` that trains by depth-first prefix-tree walks (see module doc).
    Built as ``FSDPEngine``: AReaL's ``TrainEngineConfig`` (or ``PPOActorConfig``) and
    optional :class:`DTAOptions`, ``create_process_group()`` (initializing
    ``torch.distributed`` when it is not; ``destroy`` ends what it began), then
    ``initialize(None, FinetuneSpec(...))``. ``fsdp:dNcM``: N data-parallel groups of M
    context-parallel ranks, the state held as ``actor.dta.sharding`` says (unset: ``fsdp``
    over N > 1, as AReaL's ``fsdp:dN``)."""

    # AReaL (after 1.0.4) hands R3 routing to an engine with ``_r3_enabled`` through these
    # attributes (areal/engine/r3/transport.py: PPOActor pops the keys from the batch and sets
    # them around each forward / train_batch call); 1.0.4 leaves the keys in the batch.
    _r3_enabled = True
    _r3_pending_routed_experts = None
    _r3_pending_valid = None

    def __init__(self, config: TrainEngineConfig, dta: DTAOptions | None = None):
        self.config = config
        self.optimizer_config = config.optimizer
        self.dta = dta or getattr(config, "dta", None) or DTAOptions()
        if isinstance(self.dta, dict):
            self.dta = DTAOptions(**self.dta)
        self.use_lora = check_config(config)
        # the walk actor.dta asks for; settled for the layout once (create_process_group)
        self.walk = requested_walk(config, self.dta)
        self.settings = None
        self.layout: ParallelLayout | None = None  # AReaL's allocation as the core's layout
        self.groups = ProcessGroups()
        self.own_global_group = False  # this engine initialized torch.distributed
        self.core = None  # the engine core (runtime.engine.EngineCore), made by initialize
        self.lr_scheduler = self.tokenizer = None
        self.device = torch.device("cpu")
        self._version = 0
        self._initialized = False
        self._training = True
        self._last: dict[str, float] = {}
        self.is_offload = False  # colocated: the mode's state parked in host memory
        self._offload_depth = 0
        self.rollout_engine = self.rollout_coordinator = self.weight_update_group = None

    @classmethod
    def from_pretrained(cls, model: str, experiment_name: str, trial_name: str, dp_size: int = 1,
                        tp_size: int = 1, dtype: str = "bfloat16",
                        learning_rate: float | None = None, use_lora: bool = False,
                        lora_rank: int = 32, lora_alpha: int = 16,
                        dta: DTAOptions | None = None, **kwargs) -> "DTATrainEngine":
        """The engine on a local HF directory without assembling a ``TrainEngineConfig``, as
        ``FSDPEngine.from_pretrained``: ``backend="fsdp:d{dp}t{tp}"``, an optimizer only when
        ``learning_rate`` is given (else inference only); other keywords go to the config."""
        from areal.api.cli_args import OptimizerConfig

        config = TrainEngineConfig(
            path=model, experiment_name=experiment_name, trial_name=trial_name,
            backend=f"fsdp:d{dp_size}t{tp_size}", dtype=dtype,
            optimizer=None if learning_rate is None else OptimizerConfig(lr=learning_rate),
            use_lora=use_lora, lora_rank=lora_rank, lora_alpha=lora_alpha, **kwargs)
        return cls(config, dta)

    # ------------------------------------------------------------------ lifecycle --
    def create_process_group(self, parallel_strategy=None):
        """The layout (``parallel.layout_of``) and its groups, once, initializing
        ``torch.distributed`` if needed (``env://`` when ``WORLD_SIZE`` > 1, else a
        one-process file-store group: AReaL's loop, its rollout coordination and its RPC
        workers all call collectives on the default group); then the walk settled for it."""
        strategy = strategy_of(getattr(self.config, "backend", None), parallel_strategy)
        if self.layout is None:
            self.own_global_group = init_default_group() or self.own_global_group
            self.layout = layout_of(
                self.dta.sharding, world=comm.world_size(), rank=comm.rank(),
                context_parallel=int(getattr(strategy, "context_parallel_size", 1) or 1),
                data_parallel=getattr(strategy, "data_parallel_size", None),
                where=getattr(self.config, "backend", None) or parallel_strategy,
                trains=self.optimizer_config is not None,
                expert_parallel=int(getattr(strategy, "expert_parallel_size", 1) or 1),
                **self.dta.layout_settings())
            self.groups = build_groups(self.layout)
        if self.settings is None or self.settings.layout is not self.layout:
            self.settings = settle(self.walk, self.layout)
            self.walk = self.settings.walk

    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None,
                   *args, **kwargs):
        """Load the model from ``config.path`` (a local Hugging Face directory; nothing is
        downloaded) into the engine core, and build AReaL's optimizer and LR scheduler."""
        if addr is not None:
            raise ValueError(f"DTATrainEngine does not support remote initialization "
                             f"(addr={addr!r}); pass addr=None")
        self._ensure_groups()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.core = make_core(self.config, self.dta, self.settings, self.groups, self.device)
        self.model_config = self.model.config
        self.tokenizer = local_tokenizer(self.config.path)
        if self.optimizer_config is not None:
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optimizer_config,
                                                   ft_spec)
        self._initialized = True

    @property
    def model(self):
        return self.core.model if self.core is not None else None

    @property
    def optimizer(self):
        return self.core.optimizer if self.core is not None else None

    @property
    def policy(self) -> str:
        return self.walk.policy

    @property
    def initialized(self) -> bool:
        return self._initialized

    def destroy(self):
        self._initialized = False
        self.lr_scheduler = self.core = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if dist.is_initialized() and self.own_global_group:
            comm.barrier(self.groups.cpu)
            dist.destroy_process_group()
            self.own_global_group = False
        self.layout, self.groups = None, ProcessGroups()

    def train(self, mode: bool = True):
        """Records the mode. The model stays in eval mode: the DFS walks need one
        deterministic forward (no dropout) to produce the exact gradient."""
        self._require_model()
        self._training = bool(mode)
        return self

    # ------------------------------------------------------- layout and groups --
    def _layout(self) -> ParallelLayout:
        return self.layout if self.layout is not None else ParallelLayout()

    # what AReaL asks about the process groups, answered by the layout and its groups
    rank = property(lambda self: self._layout().rank)
    world_size = property(lambda self: self._layout().world)
    sharding = property(lambda self: self._layout().sharding, doc="The sharding mode run.")
    data_parallel_group = property(lambda self: self.groups.data)
    data_parallel_rank = property(lambda self: self._layout().dp_rank)
    data_parallel_world_size = property(lambda self: self._layout().data_parallel)
    context_and_model_parallel_group = property(lambda self: self.groups.context)

    def current_data_parallel_head(self) -> int:
        return self._layout().head

    def is_data_parallel_head(self) -> bool:
        return self._layout().is_head

    @property
    def cpu_group(self):
        if not self._initialized:
            raise RuntimeError("the engine is not initialized: call initialize() first")
        return self.groups.cpu

    # ------------------------------------------------------------------ optimizer --
    def optimizer_zero_grad(self):
        self._require_optimizer()
        self.core.zero_grad()

    def optimizer_step(self):
        """The core's step (the SUM over the ranks, the clip by ``gradient_clipping``, the
        step or the skip of a non-finite norm): ``{update_successful, grad_norm, lr}``."""
        self._require_optimizer()
        norm, updated = self.core.optimizer_step(self.optimizer_config.gradient_clipping)
        return dict(update_successful=float(updated), grad_norm=float(norm),
                    lr=self.lr_scheduler.get_last_lr()[0])

    def lr_scheduler_step(self):
        if self.lr_scheduler is None:
            raise RuntimeError("no LR scheduler (the engine's config has optimizer=None)")
        self.lr_scheduler.step()

    # ------------------------------------------------------------ train / forward --
    def _sequences(self, input_, device=None):
        return walks.sequences(input_, routed=self._r3_pending_routed_experts,
                               valid=self._r3_pending_valid, model_type=self._model_type(),
                               device=device)

    def _walk_loss(self, input_, loss_fn, loss_weight_fn, *, train: bool):
        ids, mbs, routing, _ = self._sequences(input_, self.device)
        scales = walks.loss_scales(mbs, loss_weight_fn, device=self.device,
                                   group=self.groups.data)
        losses, self._last = walks.walk_loss(self.core, self.config, ids, mbs, loss_fn, scales,
                                             train=train, routing=routing, device=self.device)
        return losses, len(mbs)

    def train_batch(self, input_, loss_fn: Callable[..., torch.Tensor],
                    loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> dict[str, float]:
        """One optimizer step on the batch (see the module doc). Returns FSDPEngine's keys:
        ``update_successful``, ``grad_norm``, ``lr`` and ``num_micro_batches`` (the number of
        loss_fn calls: one per sequence)."""
        self._require_optimizer()
        self._ensure_ready()
        self.core.zero_grad()
        _, n = self._walk_loss(input_, loss_fn, loss_weight_fn, train=True)
        stats = self.optimizer_step()
        stats["num_micro_batches"] = n
        return stats

    @torch.no_grad()
    def eval_batch(self, input_, loss_fn: Callable[..., torch.Tensor],
                   loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor | None:
        """Σ over sequences of ``loss_fn × loss_weight_fn(mb) / Σ loss_weight_fn``,
        summed over data-parallel ranks (FSDPEngine.eval_batch)."""
        self._require_model()
        self._ensure_ready()
        losses, _ = self._walk_loss(input_, loss_fn, loss_weight_fn, train=False)
        return comm.all_reduce(torch.stack(losses).sum(dtype=torch.float32), self.groups.data)

    @torch.no_grad()
    def forward_batch(self, input_, output_seqlens: list[int] | None = None,
                      aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat):
        """Log-probs aligned as FSDPEngine's (:func:`runtime.areal.walks.forward_logprobs`):
        dict input gives a ``[B, max L_i]`` tensor, list input one per trajectory."""
        self._require_model()
        self._ensure_ready()
        ids, _, routing, meta = self._sequences(input_)
        out, self._last = walks.forward_logprobs(self.core, self.config, input_, ids, routing,
                                                 meta, output_seqlens, aggregate_fn)
        return out

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        """AReaL's micro-batch interface: forward only, no prefix sharing
        (:func:`runtime.areal.walks.forward_backward`)."""
        self._require_model()
        walks.forward_backward(self.core, mb_list, process_output_fn, forward_only=forward_only,
                               device=self.device)

    # ------------------------------------------------------------------ save / load --
    def save(self, meta: SaveLoadMeta):
        """``hf`` or ``dcp`` (:func:`runtime.areal.checkpoint.save`)."""
        self._require_model()
        with self._offload_aware():
            ckpt.save(self.core, meta, version=self.get_version(),
                      lr_scheduler=self.lr_scheduler, use_lora=self.use_lora)
        comm.barrier(self.groups.cpu)

    def load(self, meta: SaveLoadMeta):
        """The inverse of :meth:`save` (:func:`runtime.areal.checkpoint.load`)."""
        self._require_model()
        with self._offload_aware():
            ckpt.load(self.core, meta, lr_scheduler=self.lr_scheduler)
        comm.barrier(self.groups.cpu)

    # ---------------------------------------------------- rollout and weight updates --
    def connect_engine(self, engine, meta: WeightUpdateMeta):
        """Connect the inference engine the rollouts run on and the weights go to (AReaL's
        ``DistRolloutCoordinator`` on it; ``xccl``: the weight-update group)."""
        from areal.infra.dist_rollout import DistRolloutCoordinator

        rollout.check_update_type(meta)
        self._ensure_groups()  # the coordinator's barriers need process groups
        self.rollout_engine = engine
        self.rollout_coordinator = DistRolloutCoordinator(rollout_engine=engine, train_engine=self)
        if meta.type == "xccl" and self.weight_update_group is None:
            self.weight_update_group, self._weight_update_address = \
                rollout.init_weight_update_group(engine, meta, rank=self.rank)
        comm.barrier(self.groups.cpu)

    def _check_connected(self):
        if self.rollout_engine is None or self.rollout_coordinator is None:
            raise RuntimeError("no inference engine connected: call connect_engine(engine, "
                               "meta) before rollout_batch / prepare_batch / update_weights")

    def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size: int = 1):
        """AReaL's synchronous rollout of ``data`` on the connected inference engine."""
        self._check_connected()
        return self.rollout_coordinator.rollout_batch(
            data, workflow=workflow, workflow_kwargs=workflow_kwargs, group_size=group_size)

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None,
                      group_size: int = 1, dynamic_bs: bool = False):
        """The next training batch from the connected inference engine (AReaL's
        staleness-controlled ``prepare_batch``)."""
        self._check_connected()
        return self.rollout_coordinator.prepare_batch(
            dataloader, workflow=workflow, workflow_kwargs=workflow_kwargs,
            should_accept_fn=should_accept_fn, group_size=group_size, dynamic_bs=dynamic_bs)

    def update_weights(self, meta: WeightUpdateMeta):
        """Push the current weights to the connected inference engine (``disk`` or ``xccl``:
        :mod:`runtime.areal.rollout`)."""
        self._check_connected()
        self._require_model()
        with self._offload_aware():
            rollout.update(self, meta)

    def set_version(self, version: int):
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    # ------------------------------------------------------------ colocated offload --
    def offload(self) -> None:
        """Everything the sharding mode holds on the accelerator -- parameters, gradients,
        masters, optimizer state, under every layout -- to host memory (``Sharding.to``),
        so the colocated rollout can use the accelerator (AReaL's ``enable_offload``)."""
        self._require_model()
        if not self.is_offload:
            self.core.sharding.to("host")
            self.is_offload = True
        comm.barrier(self.groups.cpu)

    def onload(self) -> None:
        """Everything :meth:`offload` moved back to the device."""
        self._require_model()
        if self.is_offload:
            self.core.sharding.to("device")
            self.is_offload = False
        comm.barrier(self.groups.cpu)

    @contextlib.contextmanager
    def _offload_aware(self):
        """Onload for the duration of an operation that needs the weights, and offload again
        after it if the engine was offloaded (re-entrant: only the outermost call moves)."""
        if not self.is_offload and self._offload_depth == 0:
            yield
            return
        self._offload_depth += 1
        if self._offload_depth == 1:
            self.onload()
        try:
            yield
        finally:
            self._offload_depth -= 1
            if self._offload_depth == 0:
                self.offload()

    def _ensure_ready(self):
        """Onload an offloaded engine before it computes (as FSDPEngine._ensure_ready)."""
        if self.is_offload:
            self.onload()

    # ------------------------------------------------------------------ stats / misc --
    def export_stats(self) -> dict[str, float]:
        """``stats_tracker.export_all`` plus the last batch's tree statistics
        (``tree_token_ratio``, ``tree_*_tokens``, ``tree_sequences``, ``tree_depth``,
        ``dta_forwarded_tokens``, ``dta_loss``: :func:`runtime.areal.walks.walk`)."""
        out = stats_tracker.export_all(reduce_group=self.groups.data)
        out.update(self._last)
        return out

    def get_device_stats(self) -> DeviceRuntimeInfo:
        return DeviceRuntimeInfo.get_current()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole weights in the compute dtype, on CPU (sharded: gathered, every rank)."""
        self._require_model()
        return self.core.full_state_dict()

    def param_norm(self) -> float:
        """L2 norm of what the optimizer steps (the fp32 masters where kept; a collective)."""
        self._require_model()
        return self.core.param_norm()

    # what AReaL's single controller calls on a worker beyond the ABC (areal 1.0.4,
    # infra/controller/train_controller.py: at the end of every step, and the perf tracer)
    def clear_batches(self, shard_ids: list[str]) -> None:
        """Drop the given RTensor shards from this worker's client-side fetch buffer."""
        from areal.infra.rpc.rtensor import clear_fetch_buffer

        clear_fetch_buffer(shard_ids)

    def fetch_buffer_stats(self) -> dict[str, int]:
        """``{"num_entries": n}`` of this worker's fetch buffer (the controller's leak check)."""
        from areal.infra.rpc.rtensor import fetch_buffer_stats

        return fetch_buffer_stats()

    def save_perf_tracer(self, step: int | None = None, force: bool = False) -> None:
        from areal.utils import perf_tracer

        perf_tracer.save(step=step, force=force)

    def config_perf_tracer(self, config, rank: int, role: str) -> None:
        from areal.utils import perf_tracer

        if not perf_tracer.is_configured():
            perf_tracer.configure(config, rank=rank, role=role)

    # ------------------------------------------------------------------- helpers --
    def _model_type(self) -> str:
        return getattr(self.model.config, "model_type", "") if self.model is not None else ""

    def _ensure_groups(self) -> None:
        if self.layout is None:
            self.create_process_group()

    def _require_model(self):
        if self.core is None:
            raise RuntimeError("the engine is not initialized: call initialize() first")

    def _require_optimizer(self):
        self._require_model()
        if self.optimizer is None:
            raise RuntimeError(ckpt.NO_OPTIMIZER)

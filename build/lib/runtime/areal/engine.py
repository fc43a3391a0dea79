"""``DTATrainEngine``: AReaL's ``TrainEngine`` on DTA's depth-first prefix-tree walker.

``train_batch`` keeps the semantics of AReaL's ``FSDPEngine.train_batch`` (areal 1.0.4,
``engine/fsdp_engine.py:760``): one optimizer step on a right-padded ``[B, S]`` batch (or a
list of them), ``loss_fn(logprobs, entropy, mb, vocab_min_logits=, vocab_max_logits=)`` on
packed 1-D tensors with ``cu_seqlens``, the gradient of ``Σ loss_weight_fn(mb) · loss /
Σ loss_weight_fn`` over the whole batch (all data-parallel ranks), gradient clipping, and a
skipped update on a non-finite gradient norm. The difference is how the gradient is computed:
every sequence is its own micro-batch and the batch is walked as one prefix tree
(``runtime/areal/walks.py``), so a shared prefix is forwarded once.

The gradient is the one FSDPEngine computes with one sequence per micro-batch (to floating
point rounding; tests/test_areal.py checks it against FSDPEngine in float32 and against a
per-sequence reference in float64). For token-decomposable losses (PPO/GRPO, SFT) it is also
what any other micro-batching gives, and for sequence-level ones (GSPO) because each call sees
whole sequences.

The model always stays in eval mode: the two walks must run the same deterministic forward, so
dropout is never active (``train(mode)`` records the mode only). AReaL's config rejects
float64; ``DTAOptions(dtype="float64")`` overrides it for verification.

It is an adapter of the engine core (``runtime.engine``, docs/engine.md): AReaL's config
(``fsdp:dNcM`` + ``actor.dta``) and batch format are translated, and the core builds the model
(LoRA by its one rule), shards it (replicate / zero1 / fsdp, fp32 masters under bf16
compute), walks with the run's one ``WalkOptions``, reduces (SUM over the ranks: each rank's
loss is scaled by ``loss_weight_fn(mb) / Σ_all loss_weight_fn``, the gradient FSDPEngine's
× DP-size average gives), clips, steps or skips, and holds the state.

The modules, one thing each: ``options.py`` (DTAOptions), ``parallel.py`` (AReaL's
allocation as the core's layout, its groups, what AReaL asks of them), ``translate.py``
(the config as the core's inputs), ``optimizer.py`` (AReaL's optimizer and LR scheduler),
``walks.py`` (the DFS walks), ``checkpoint.py`` / ``dcp.py`` (save/load), ``rollout.py``
(inference-engine connection, weight updates, versions), ``offload.py``, ``workers.py``
(what AReaL's single controller calls on a worker).
"""
from __future__ import annotations

import gc
import logging
import os
from typing import Any, Callable

import torch
from areal.api.cli_args import TrainEngineConfig
from areal.api.engine_api import TrainEngine
from areal.api.io_struct import DeviceRuntimeInfo, FinetuneSpec
from areal.utils import stats_tracker

from runtime.areal import convert
from runtime.areal.checkpoint import CheckpointMixin, local_tokenizer
from runtime.areal.offload import OffloadMixin
from runtime.areal.optimizer import build_lr_scheduler
from runtime.areal.options import DTAOptions
from runtime.areal.parallel import GroupsMixin
from runtime.areal.rollout import RolloutMixin
from runtime.areal.translate import make_core, requested_walk
from runtime.areal.walks import WalksMixin
from runtime.areal.workers import WorkerMixin
from runtime.engine import comm, settle

__all__ = ["DTAOptions", "DTATrainEngine"]

logger = logging.getLogger("DTATrainEngine")


class DTATrainEngine(WalksMixin, CheckpointMixin, RolloutMixin, OffloadMixin, WorkerMixin,
                     GroupsMixin, TrainEngine):
    """An AReaL ``TrainEngine`` that trains by depth-first prefix-tree walks (see module doc).

    Construct with AReaL's ``TrainEngineConfig`` (or ``PPOActorConfig``) and optional
    :class:`DTAOptions`; then ``create_process_group()`` (optional for a single process) and
    ``initialize(None, FinetuneSpec(...))`` as with ``FSDPEngine``. ``fsdp:dNcM``: N
    data-parallel groups of M context-parallel ranks; the state is held as
    ``actor.dta.sharding`` says (``replicate``, ``zero1``, ``fsdp``; unset: ``fsdp`` over
    N > 1, as AReaL's ``fsdp:dN``). Like FSDPEngine, the engine initializes
    ``torch.distributed`` when it is not (one process: a file-store group, nothing listens)
    and destroys it in ``destroy``.
    """

    def __init__(self, config: TrainEngineConfig, dta: DTAOptions | None = None):
        self.config = config
        self.optimizer_config = config.optimizer
        self.dta = dta or getattr(config, "dta", None) or DTAOptions()
        if isinstance(self.dta, dict):
            self.dta = DTAOptions(**self.dta)
        if getattr(config, "is_critic", False):
            raise NotImplementedError("DTATrainEngine trains actors / language models; critics "
                                      "(is_critic=True) are not supported")
        fsdp = getattr(config, "fsdp", None)
        if fsdp is not None and bool(getattr(fsdp, "offload_params", False)):
            raise NotImplementedError("fsdp.offload_params=True: DTATrainEngine keeps the "
                                      "parameters on the device (actor.dta.offload=optimizer "
                                      "keeps the optimizer state in host memory)")
        self.use_lora = bool(getattr(config, "use_lora", False))
        if self.use_lora and getattr(config, "peft_type", "lora") != "lora":
            raise NotImplementedError(f"DTATrainEngine trains LoRA adapters only "
                                      f"(peft_type={config.peft_type!r})")
        # the walk actor.dta asks for; settled for the layout once (create_process_group)
        self.walk = requested_walk(config, self.dta)
        self.settings = None
        self.core = None  # the engine core (runtime.engine.EngineCore), made by initialize
        self.lr_scheduler = None
        self.tokenizer = None
        self.device = torch.device("cpu")
        self._version = 0
        self._initialized = False
        self._training = True
        self._last: dict[str, float] = {}

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
        """The layout and its groups (:class:`~runtime.areal.parallel.GroupsMixin`), and the
        walk settled for it (what the sharding mode needs of the walk, put in once)."""
        super().create_process_group(parallel_strategy)
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
        self._destroy_groups()

    def train(self, mode: bool = True):
        """Records the mode. The model stays in eval mode: the DFS walks need one
        deterministic forward (no dropout) to produce the exact gradient."""
        self._require_model()
        self._training = bool(mode)
        return self

    # ------------------------------------------------------------------ optimizer --
    def optimizer_zero_grad(self):
        self._require_optimizer()
        self.core.zero_grad()

    def optimizer_step(self):
        """The core's step: the one gradient reduction (a SUM over the ranks), the clip by
        the global norm (``optimizer.gradient_clipping``), the step -- or, on a non-finite
        norm, the gradients discarded and the step skipped. Returns ``{update_successful,
        grad_norm, lr}`` like FSDPEngine. Replicated, the model's ``.grad`` hold the clipped
        gradients afterwards (the masters', cast); sharded, they were reduce-scattered."""
        self._require_optimizer()
        norm, updated = self.core.optimizer_step(self.optimizer_config.gradient_clipping)
        return dict(update_successful=float(updated), grad_norm=float(norm),
                    lr=self.lr_scheduler.get_last_lr()[0])

    def lr_scheduler_step(self):
        if self.lr_scheduler is None:
            raise RuntimeError("no LR scheduler (the engine's config has optimizer=None)")
        self.lr_scheduler.step()

    # ------------------------------------------------------------ train / forward --
    def train_batch(self, input_, loss_fn: Callable[..., torch.Tensor],
                    loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> dict[str, float]:
        """One optimizer step on the batch (see the module doc). Returns FSDPEngine's keys:
        ``update_successful``, ``grad_norm``, ``lr`` and ``num_micro_batches`` (the number of
        loss_fn calls: one per sequence)."""
        self._require_optimizer()
        self._ensure_ready()
        self.core.zero_grad()
        ids, mbs, routing, _ = self._sequences(input_, self.device)
        scales = self._loss_scales(mbs, loss_weight_fn)
        self._walk_loss(ids, mbs, loss_fn, scales, train=True, routing=routing)
        stats = self.optimizer_step()
        stats["num_micro_batches"] = len(mbs)
        return stats

    @torch.no_grad()
    def eval_batch(self, input_, loss_fn: Callable[..., torch.Tensor],
                   loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor | None:
        """Σ over sequences of ``loss_fn × loss_weight_fn(mb) / Σ loss_weight_fn``,
        summed over data-parallel ranks (FSDPEngine.eval_batch)."""
        self._require_model()
        self._ensure_ready()
        ids, mbs, routing, _ = self._sequences(input_, self.device)
        scales = self._loss_scales(mbs, loss_weight_fn)
        losses = self._walk_loss(ids, mbs, loss_fn, scales, train=False, routing=routing)
        return comm.all_reduce(torch.stack(losses).sum(dtype=torch.float32), self.groups.data)

    @torch.no_grad()
    def forward_batch(self, input_, output_seqlens: list[int] | None = None,
                      aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat):
        """Log-probs aligned as FSDPEngine's: ``out[i, t] = log p(ids[i, t+1] | ids[i, :t+1])``
        for ``t < L_i - 1``; ``out[i, L_i - 1]`` is the log-prob of the wrap label (AReaL's roll
        artefact with one sequence per micro-batch); padding is 0. Dict input gives a
        ``[B, max L_i]`` tensor, list input a list of per-trajectory tensors."""
        self._require_model()
        self._ensure_ready()
        ids, _, routing, meta = self._sequences(input_)
        lengths = [len(s) for s in ids]
        if meta is not None:
            inferred = [d["attention_mask"].shape[-1] for d in input_]
            if output_seqlens is not None and output_seqlens != inferred:
                raise ValueError(f"output_seqlens mismatch for list input: given {output_seqlens}, "
                                 f"inferred {inferred} from attention_mask shapes.")
            output_seqlens = inferred if len(inferred) == len(ids) else lengths
        if output_seqlens is None:
            output_seqlens = lengths
        res = self._walk(ids, routing)
        outputs = [convert.areal_view(lp, n) for lp, n in zip(res.logprobs, lengths)]
        result = convert.pad_outputs(outputs, list(output_seqlens), aggregate_fn)
        return result if meta is None else convert.split_batch(result, meta)

    # ------------------------------------------------------------------ stats / misc --
    def export_stats(self) -> dict[str, float]:
        """``stats_tracker.export_all`` (what loss functions recorded), plus the last batch's
        tree statistics: ``tree_token_ratio`` (total tokens / unique prefix-tree tokens),
        ``tree_total_tokens``, ``tree_unique_tokens``, ``tree_sequences``, ``tree_depth``,
        ``dta_forwarded_tokens`` (what the walks forwarded) and ``dta_loss`` (last train or
        eval batch, this rank)."""
        out = stats_tracker.export_all(reduce_group=self.groups.data)
        out.update(self._last)
        return out

    def get_device_stats(self) -> DeviceRuntimeInfo:
        return DeviceRuntimeInfo.get_current()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole weights in the compute dtype, on CPU (the state the rollout
        receives). Sharded, they are gathered: every rank calls it, each gets them."""
        self._require_model()
        return self.core.full_state_dict()

    def param_norm(self) -> float:
        """L2 norm of the parameters the optimizer steps (the fp32 masters where there are
        any; sharded: a collective)."""
        self._require_model()
        return self.core.param_norm()

    # ------------------------------------------------------------------- helpers --
    def _model_type(self) -> str:
        return getattr(self.model.config, "model_type", "") if self.model is not None else ""

    def _ensure_ready(self):
        """Onload an offloaded engine before it computes (as FSDPEngine._ensure_ready)."""
        if self.is_offload:
            self.onload()

    def _require_model(self):
        if self.core is None:
            raise RuntimeError("the engine is not initialized: call initialize() first")

    def _require_optimizer(self):
        self._require_model()
        if self.optimizer is None:
            raise RuntimeError("no optimizer: the engine's config has optimizer=None "
                               "(inference only)")

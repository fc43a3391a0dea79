"""``DTATrainEngine``: AReaL's ``TrainEngine`` on DTA's depth-first prefix-tree walker.

``train_batch`` keeps the semantics of AReaL's ``FSDPEngine.train_batch`` (areal 1.0.4,
``engine/fsdp_engine.py:760``): one optimizer step on a right-padded ``[B, S]`` batch (or a
list of them), ``loss_fn(logprobs, entropy, mb, vocab_min_logits=, vocab_max_logits=)`` on
packed 1-D tensors with ``cu_seqlens``, each call weighted by
``loss_weight_fn(mb) / Σ loss_weight_fn × DP size`` with gradients averaged over data-parallel
ranks (sharded: the same gradient, as a sum of the unscaled shares), gradient clipping, and a
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

The engine is assembled from one-thing modules: ``options.py`` (DTAOptions), ``parallel.py``
(process groups and what AReaL asks of them, model placement, gradient reduction — the seam
for sharded layouts),
``optimizer.py`` (optimizer, LR scheduler, fp32 master weights, the clipped step),
``sharded.py`` (``zero1`` / ``fsdp`` layouts through ``runtime.sharding``),
``walks.py`` (the DFS walks), ``checkpoint.py`` (save/load), ``rollout.py`` (inference-engine
connection, weight updates, versions), ``offload.py`` (offload/onload), ``workers.py`` (what
AReaL's single controller calls on a worker).
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

from dta.model.models import load_model, resolve_dtype
from dta.tree import PrefixTree

from runtime.areal import convert
from runtime.areal.checkpoint import CheckpointMixin, local_tokenizer
from runtime.areal.offload import OffloadMixin
from runtime.areal.optimizer import MasterWeights, build_lr_scheduler, build_optimizer, step
from runtime.areal.options import DTAOptions
from runtime.areal.parallel import DataParallel, GroupsMixin
from runtime.areal.rollout import RolloutMixin
from runtime.areal.sharded import ShardedLayout, resolve_sharding
from runtime.areal.walks import WalksMixin
from runtime.areal.workers import WorkerMixin
from runtime.sharding import master_dtype_for

__all__ = ["DTAOptions", "DTATrainEngine"]

logger = logging.getLogger("DTATrainEngine")


class DTATrainEngine(WalksMixin, CheckpointMixin, RolloutMixin, OffloadMixin, WorkerMixin,
                     GroupsMixin, TrainEngine):
    """An AReaL ``TrainEngine`` that trains by depth-first prefix-tree walks (see module doc).

    Construct with AReaL's ``TrainEngineConfig`` (or ``PPOActorConfig``) and optional
    :class:`DTAOptions`; then ``create_process_group()`` (optional for a single process) and
    ``initialize(None, FinetuneSpec(...))`` as with ``FSDPEngine``. Data parallelism only
    (``fsdp:dN``): with N > 1 ranks the state is sharded over them (``actor.dta.sharding``:
    ``zero1`` or ``fsdp``, see :mod:`runtime.areal.sharded`) or replicated
    (``replicate``: gradients averaged before the step); like FSDPEngine, the engine
    initializes ``torch.distributed`` when it is not (one process: a file-store group,
    nothing listens) and destroys it in ``destroy``.
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
        self.use_lora = bool(getattr(config, "use_lora", False))
        if self.use_lora and getattr(config, "peft_type", "lora") != "lora":
            raise NotImplementedError(f"DTATrainEngine trains LoRA adapters only "
                                      f"(peft_type={config.peft_type!r})")
        self.policy = self.dta.policy or ("recompute" if config.gradient_checkpointing
                                          else "retain")
        # the walk's settings, built once (the sharded layout may add what its mode needs)
        self.walk = self.dta.walk_options(policy=self.policy,
                                          temperature=float(config.temperature))
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self.tokenizer = None
        self.device = torch.device("cpu")
        self.master: MasterWeights | None = None  # fp32 master weights, if any
        self.parallel = DataParallel()
        self.layout: ShardedLayout | None = None  # zero1 / fsdp; None: replicas
        self.sharding = "replicate"
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
    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None,
                   *args, **kwargs):
        """Load the model from ``config.path`` (a local Hugging Face directory; nothing is
        downloaded) and build the optimizer and LR scheduler like ``FSDPEngine``."""
        if addr is not None:
            raise ValueError(f"DTATrainEngine does not support remote initialization "
                             f"(addr={addr!r}); pass addr=None")
        if not self.parallel.ready:
            self.create_process_group()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        compute = resolve_dtype(self.dta.dtype or self.config.dtype)
        storage = resolve_dtype(self.dta.dtype or self.config.optimizer_dtype)
        # context parallel (fsdp:dNcC): unset, the layout is that of the N data-parallel
        # groups (d1cC: replicate); a sharded actor.dta.sharding shards over the whole world
        # (the C ranks of a group hold identical gradients, each group counted once)
        ranks = (self.parallel.world_size if self.dta.sharding is not None
                 else self.parallel.data_parallel_size)
        self.sharding = resolve_sharding(self.dta.sharding, ranks,
                                         trains=self.optimizer_config is not None)
        if self.use_lora and self.sharding == "fsdp":
            raise NotImplementedError("DTATrainEngine with use_lora=True runs replicated or "
                                      "zero1 (actor.dta.sharding=replicate | zero1), not fsdp: "
                                      "the adapters' state is small")
        if self.sharding != "replicate":
            if storage != master_dtype_for(compute):
                raise ValueError(f"actor.dta.sharding={self.sharding} keeps "
                                 f"{master_dtype_for(compute)} master weights for "
                                 f"dtype={compute}; set optimizer_dtype accordingly (got "
                                 f"{storage})")
            self._initialize_sharded(compute, ft_spec)
            return
        # FSDP2 keeps master weights in optimizer_dtype, read from the checkpoint in it (not
        # through the compute dtype); so do we, then the model holds their cast
        self.model = self.parallel.prepare_model(self._load(storage), self.device).eval()
        self.model_config = self.model.config
        self.tokenizer = local_tokenizer(self.config.path)
        params = self._trainable()
        if storage != compute:
            self.master = MasterWeights(params, storage)
            self.model.to(compute)  # the parameter objects stay: the masters map onto them
        if self.optimizer_config is not None:
            self.optimizer = build_optimizer(self.master.master if self.master else params,
                                             self.optimizer_config)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optimizer_config,
                                                   ft_spec)
        self._initialized = True

    def _load(self, dtype: torch.dtype):
        path = self.config.path
        if self.config.init_from_scratch:
            import transformers

            cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, dtype=dtype, attn_implementation=self.config.attn_impl)
        else:
            model = load_model(path, dtype=dtype, attn_implementation=self.config.attn_impl)
        return self._wrap_lora(model) if self.use_lora else model

    def _wrap_lora(self, model):
        """LoRA adapters as ``FSDPEngine._apply_peft_wrapper`` adds them: ``lora_rank``,
        ``lora_alpha``, ``target_modules`` (empty or ``["all-linear"]``: every linear layer
        but the head), bias ``none``, adapters in the storage dtype (fp32 masters), the base
        frozen."""
        from dta.model.lora import apply_lora

        targets = list(self.config.target_modules or [])
        targets = "all-linear" if targets in ([], ["all-linear"]) else targets
        return apply_lora(model, r=int(self.config.lora_rank),
                          alpha=float(self.config.lora_alpha), target_modules=targets)

    def _initialize_sharded(self, compute: torch.dtype, ft_spec) -> None:
        """The model built in the master dtype on the device, then sharded (zero1 / fsdp) over
        the data-parallel group with AReaL's optimizer over the shards."""
        oc = self.optimizer_config
        model = self._load(master_dtype_for(compute)).to(self.device).eval()
        C = self.parallel.context_parallel
        if C > 1:  # sharded over the whole world; the model walks on its context group
            model = self.parallel.prepare_model(model, self.device)
        mixed = self.sharding == "fsdp"  # DTensor layers + flat vocabulary shards

        def make_optimizer(params):
            return build_optimizer(list(params), oc, multi_tensor=not mixed)

        self.layout = ShardedLayout(self.sharding, model, make_optimizer,
                                    compute_dtype=compute, policy=self.policy,
                                    # None: the world (context parallel), else the DP group
                                    group=None if C > 1 else self.parallel.dp_group,
                                    context_parallel=C)
        self.model, self.optimizer = self.layout.model, self.layout.optimizer
        if self.layout.walk_options:
            self.walk = self.walk.replace(**self.layout.walk_options)
        self.model_config = self.model.config
        self.tokenizer = local_tokenizer(self.config.path)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, oc, ft_spec)
        self._initialized = True

    @property
    def initialized(self) -> bool:
        return self._initialized

    def destroy(self):
        self._initialized = False
        self.optimizer = self.lr_scheduler = self.model = None
        self.master = self.layout = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.parallel.destroy()

    def train(self, mode: bool = True):
        """Records the mode. The model stays in eval mode: the DFS walks need one
        deterministic forward (no dropout) to produce the exact gradient."""
        self._require_model()
        self._training = bool(mode)
        return self

    # ------------------------------------------------------------------ optimizer --
    def optimizer_zero_grad(self):
        self._require_optimizer()
        if self.layout is not None:
            self.layout.zero_grad()
            return
        self.optimizer.zero_grad()
        self.model.zero_grad(set_to_none=True)

    def optimizer_step(self):
        """Average gradients over data-parallel ranks, clip by the global norm
        (``optimizer.gradient_clipping``), step — or, on a non-finite norm, zero the
        gradients and skip. Returns ``{update_successful, grad_norm, lr}`` like FSDPEngine.
        Sharded (zero1 / fsdp), the ranks' gradients are summed (``train_batch`` scales them
        for it), the step runs on the fp32 master shards, and the model's ``.grad`` is not
        kept (it was reduce-scattered into the shards)."""
        self._require_optimizer()
        if self.layout is not None:  # context parallel: the layout's reduction counts it
            norm, updated = self.layout.step(self.optimizer_config.gradient_clipping)
        else:
            self.parallel.reduce_gradients(self._trainable())
            norm, updated = step(self._trainable(), self.optimizer,
                                 self.optimizer_config.gradient_clipping, self.master,
                                 self.model)
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
        self.optimizer_zero_grad()
        ids, mbs, routing, _ = self._sequences(input_, self.device)
        # replicas average the ranks' gradients (× DP size, as FSDPEngine); shards sum them
        multiplier = self.parallel.data_parallel_size if self.layout is None else 1
        scales = self._loss_scales(mbs, loss_weight_fn, multiplier=multiplier)
        self._walk(ids, mbs, loss_fn, scales, train=True, routing=routing)
        stats = self.optimizer_step()
        stats["num_micro_batches"] = len(mbs)
        return stats

    @torch.no_grad()
    def eval_batch(self, input_, loss_fn: Callable[..., torch.Tensor],
                   loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor | None:
        """Σ over sequences of ``loss_fn × loss_weight_fn(mb) / Σ loss_weight_fn``,
        all-reduced over data-parallel ranks (FSDPEngine.eval_batch)."""
        self._require_model()
        self._ensure_ready()
        ids, mbs, routing, _ = self._sequences(input_, self.device)
        scales = self._loss_scales(mbs, loss_weight_fn, multiplier=1)
        with self._walk_session():
            losses = self._walk(ids, mbs, loss_fn, scales, train=False, routing=routing)
        return self.parallel.all_reduce(torch.stack(losses).sum(dtype=torch.float32))

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
        batch = self._walk_batch(ids, routing=routing)
        tree = PrefixTree(batch.input_ids, min_shared=self.walk.min_shared)
        with self._walk_session():
            res = self._walker().forward(tree, batch)
        self._record_tree(ids, tree, res.tokens)
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
        out = stats_tracker.export_all(reduce_group=self.parallel.dp_group)
        out.update(self._last)
        return out

    def get_device_stats(self) -> DeviceRuntimeInfo:
        return DeviceRuntimeInfo.get_current()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's whole weights in the compute dtype, on CPU (the state the rollout
        receives). Sharded, it gathers them: every rank calls it, each gets them."""
        self._require_model()
        if self.layout is not None:
            return self.layout.full_state_dict()
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def param_norm(self) -> float:
        """L2 norm of the parameters the optimizer steps (the fp32 masters where there are
        any; sharded: a collective)."""
        self._require_model()
        if self.layout is not None:
            return self.layout.param_norm()
        params = self.master.master if self.master is not None else self._trainable()
        with torch.no_grad():
            return float(sum(p.double().pow(2).sum() for p in params) ** 0.5)

    # ------------------------------------------------------------------- helpers --
    def _walk_session(self):
        """Under fsdp, the ranks' decoder calls are matched for a walk outside
        ``train_batch``; otherwise a no-op."""
        import contextlib

        return self.layout.walk_session() if self.layout is not None else \
            contextlib.nullcontext()

    def _trainable(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def _model_type(self) -> str:
        return getattr(self.model.config, "model_type", "") if self.model is not None else ""

    def _max_positions(self):
        return getattr(self.model.config, "max_position_embeddings", None)

    def _ensure_ready(self):
        """Onload an offloaded engine before it computes (as FSDPEngine._ensure_ready)."""
        if self.is_offload:
            self.onload()

    def _require_model(self):
        if self.model is None:
            raise RuntimeError("the engine is not initialized: call initialize() first")

    def _require_optimizer(self):
        self._require_model()
        if self.optimizer is None:
            raise RuntimeError("no optimizer: the engine's config has optimizer=None "
                               "(inference only)")

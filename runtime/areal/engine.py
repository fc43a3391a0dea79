"""``DTATrainEngine``: AReaL's ``TrainEngine`` on DTA's depth-first prefix-tree walker.

``train_batch`` keeps the semantics of AReaL's ``FSDPEngine.train_batch`` (areal 1.0.4,
``engine/fsdp_engine.py:760``): one optimizer step on a right-padded ``[B, S]`` batch (or a
list of them), ``loss_fn(logprobs, entropy, mb, vocab_min_logits=, vocab_max_logits=)`` on
packed 1-D tensors with ``cu_seqlens``, each call weighted by
``loss_weight_fn(mb) / Σ loss_weight_fn × DP size`` with gradients averaged over data-parallel
ranks, gradient clipping, and a skipped update on a non-finite gradient norm. The difference is
how the gradient is computed: every sequence is its own micro-batch (AReaL's loss_fn is called
once per sequence, in AReaL's packed layout, inside a :class:`dta.losses.SequenceLoss`), and
the batch is walked as one prefix tree, so a shared prefix is forwarded once:

1. a forward-only walk records every sequence's log-probs, entropies and logit min/max;
2. each sequence's AReaL loss is evaluated on them and linearized (its gradient with respect
   to the log-probs and entropies: ``dta.objective.linearize``);
3. a training walk backpropagates that linear surrogate, which has the same gradient.

The gradient is the one FSDPEngine computes with one sequence per micro-batch (to floating
point rounding; tests/test_areal.py checks it against FSDPEngine in float32 and against a
per-sequence reference in float64). For token-decomposable losses (PPO/GRPO, SFT) it is also
what any other micro-batching gives, and for sequence-level ones (GSPO) because each call sees
whole sequences.

The model always stays in eval mode: the two walks must run the same deterministic forward, so
dropout is never active (``train(mode)`` records the mode only). AReaL's config rejects
float64; ``DTAOptions(dtype="float64")`` overrides it for verification.
"""
from __future__ import annotations

import dataclasses
import gc
import glob
import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from areal.api.cli_args import TrainEngineConfig
from areal.api.engine_api import TrainEngine
from areal.api.io_struct import DeviceRuntimeInfo, FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal.utils import stats_tracker

from dta.losses import SequenceLoss
from dta.models import load_model, resolve_dtype
from dta.objective import linearize
from dta.train import clip_and_step
from dta.tree import PrefixTree
from dta.walk import POLICIES, Walker

from runtime.areal import convert

__all__ = ["DTAOptions", "DTATrainEngine"]

logger = logging.getLogger("DTATrainEngine")


@dataclasses.dataclass
class DTAOptions:
    """The walker's options, beside AReaL's ``TrainEngineConfig``.

    policy: ``retain`` keeps each node's graph along the current path; ``recompute`` keeps
        only K/V and re-forwards a node at pop (less memory, one more forward). Default:
        ``recompute`` when ``config.gradient_checkpointing`` is set, else ``retain``.
    logits_chunk: rows of ``[rows, vocab]`` logits materialized at a time.
    min_shared: the shortest prefix worth sharing in the tree.
    dtype: the model's and the optimizer's dtype, overriding ``config.dtype`` and
        ``config.optimizer_dtype`` (e.g. ``float64`` for verification, which AReaL rejects).
    """

    policy: str | None = None
    logits_chunk: int = 1024
    min_shared: int = 1
    dtype: str | None = None

    def __post_init__(self):
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"unknown DTA policy {self.policy!r}; choose one of {POLICIES}")
        if self.logits_chunk < 1 or self.min_shared < 1:
            raise ValueError("logits_chunk and min_shared must be >= 1")


class _Params:
    """What ``dta.train.clip_and_step`` needs of a model: ``parameters()``."""

    def __init__(self, params):
        self.params = list(params)

    def parameters(self):
        return iter(self.params)


class DTATrainEngine(TrainEngine):
    """An AReaL ``TrainEngine`` that trains by depth-first prefix-tree walks (see module doc).

    Construct with AReaL's ``TrainEngineConfig`` (or ``PPOActorConfig``) and optional
    :class:`DTAOptions`; then ``create_process_group()`` (optional for a single process) and
    ``initialize(None, FinetuneSpec(...))`` as with ``FSDPEngine``. Data parallelism only:
    when ``torch.distributed`` is initialized (or ``WORLD_SIZE`` > 1), every rank is a
    data-parallel replica and gradients are averaged before the step.
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
        if getattr(config, "use_lora", False):
            raise NotImplementedError("DTATrainEngine does not support LoRA (use_lora=True)")
        self.policy = self.dta.policy or ("recompute" if config.gradient_checkpointing
                                          else "retain")
        self.model = None
        self.optimizer = None
        self.lr_scheduler = None
        self.tokenizer = None
        self.device = torch.device("cpu")
        self._master: list[torch.nn.Parameter] | None = None  # fp32 master weights, if any
        self._version = 0
        self._initialized = False
        self._groups_ready = False
        self.own_global_group = False
        self._dp_group = self._mp_group = self._cpu_group = None
        self.rank, self.world_size = 0, 1
        self._training = True
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------ process groups --
    def create_process_group(self, parallel_strategy=None):
        """Data-parallel groups: the whole world when ``torch.distributed`` is initialized
        (it is initialized here, as FSDPEngine does, when ``WORLD_SIZE`` > 1), else none —
        a single process needs no process group."""
        strategy = parallel_strategy
        backend = getattr(self.config, "backend", None)
        if strategy is None and isinstance(backend, str) and ":" in backend:
            from areal.api.alloc_mode import ModelAllocation

            strategy = ModelAllocation.from_str(backend).parallel
        if strategy is not None:
            for name in ("tensor_parallel_size", "pipeline_parallel_size",
                         "context_parallel_size", "expert_parallel_size"):
                if getattr(strategy, name, 1) > 1:
                    raise NotImplementedError(
                        f"DTATrainEngine is data-parallel only; {name}="
                        f"{getattr(strategy, name)} (from {backend or parallel_strategy!r})")
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from areal.infra.platforms import current_platform

            dist.init_process_group(backend=current_platform.communication_backend)
            self.own_global_group = True
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self._dp_group = dist.group.WORLD
            self._cpu_group = dist.new_group(backend="gloo")
            for r in range(self.world_size):  # every rank creates every group
                group = dist.new_group([r])
                if r == self.rank:
                    self._mp_group = group
        dp = getattr(strategy, "data_parallel_size", None)
        if dp not in (None, self.world_size):
            raise ValueError(f"data-parallel size {dp} (from {backend!r}) differs from the "
                             f"{self.world_size} process(es) running")
        self._groups_ready = True

    @property
    def data_parallel_group(self):
        return self._dp_group

    @property
    def data_parallel_rank(self) -> int:
        return self.rank

    @property
    def data_parallel_world_size(self) -> int:
        return self.world_size

    def current_data_parallel_head(self) -> int:
        return self.rank  # no model/context parallelism: every rank heads its own replica

    def is_data_parallel_head(self) -> bool:
        return True

    @property
    def context_and_model_parallel_group(self):
        return self._mp_group

    @property
    def cpu_group(self):
        assert self._initialized, "the engine is not initialized"
        return self._cpu_group

    # ------------------------------------------------------------------ lifecycle --
    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None,
                   *args, **kwargs):
        """Load the model from ``config.path`` (a local Hugging Face directory; nothing is
        downloaded) and build the optimizer and LR scheduler like ``FSDPEngine``."""
        assert addr is None, "DTATrainEngine does not support remote initialization"
        if not self._groups_ready:
            self.create_process_group()
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        compute = resolve_dtype(self.dta.dtype or self.config.dtype)
        storage = resolve_dtype(self.dta.dtype or self.config.optimizer_dtype)
        path = self.config.path
        if self.config.init_from_scratch:
            import transformers

            cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
            self.model = transformers.AutoModelForCausalLM.from_config(
                cfg, dtype=compute, attn_implementation=self.config.attn_impl).eval()
        else:
            self.model = load_model(path, dtype=compute, attn_implementation=self.config.attn_impl)
        self.model.to(self.device).eval()
        self.model_config = self.model.config
        self.tokenizer = _local_tokenizer(path)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if storage != compute:  # FSDP2 keeps master weights in optimizer_dtype; so do we
            self._master = [torch.nn.Parameter(p.detach().to(storage).clone()) for p in params]
        self._create_optimizer(self._master or params, ft_spec)
        self._initialized = True

    def _create_optimizer(self, params, ft_spec: FinetuneSpec | None) -> None:
        oc = self.optimizer_config
        if oc is None:
            return
        if ft_spec is None:
            raise ValueError("initialize() needs a FinetuneSpec (its total_train_steps drives "
                             "the LR scheduler), as FSDPEngine does")
        from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

        if oc.type == "adam":
            try:
                self.optimizer = torch.optim.AdamW(params, lr=oc.lr, weight_decay=oc.weight_decay,
                                                   betas=(oc.beta1, oc.beta2), eps=oc.eps,
                                                   fused=True)
            except (RuntimeError, ValueError):  # a device/dtype without the fused kernel
                self.optimizer = torch.optim.AdamW(params, lr=oc.lr, weight_decay=oc.weight_decay,
                                                   betas=(oc.beta1, oc.beta2), eps=oc.eps)
        elif oc.type == "adam_bf16":
            from areal.engine.fsdp_utils.optimizer import AnyPrecisionAdamW

            self.optimizer = AnyPrecisionAdamW(params, lr=oc.lr, weight_decay=oc.weight_decay,
                                               betas=(oc.beta1, oc.beta2), eps=oc.eps,
                                               momentum_dtype="bfloat16",
                                               variance_dtype="bfloat16")
        elif oc.type == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=oc.lr, weight_decay=oc.weight_decay)
        else:
            raise ValueError(f"unknown optimizer type {oc.type!r}; choose adam, adam_bf16 or sgd")
        total = ft_spec.total_train_steps
        warmup = int(oc.warmup_steps_proportion * total)
        if oc.lr_scheduler_type == "cosine":
            from areal.engine.fsdp_utils import get_cosine_schedule_with_warmup

            self.lr_scheduler = get_cosine_schedule_with_warmup(
                self.optimizer, warmup, total, min_lr_ratio=oc.min_lr_ratio)
        elif oc.lr_scheduler_type == "linear":
            self.lr_scheduler = get_linear_schedule_with_warmup(self.optimizer, warmup, total)
        elif oc.lr_scheduler_type == "constant":
            self.lr_scheduler = get_constant_schedule_with_warmup(self.optimizer, warmup)
        else:
            raise ValueError(f"unknown lr scheduler type {oc.lr_scheduler_type!r}")

    @property
    def initialized(self) -> bool:
        return self._initialized

    def destroy(self):
        self._initialized = False
        self.optimizer = self.lr_scheduler = self.model = None
        self._master = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if dist.is_initialized() and self.own_global_group:
            if self._cpu_group is not None:
                dist.barrier(group=self._cpu_group)
            dist.destroy_process_group()
            self.own_global_group = False

    def train(self, mode: bool = True):
        """Records the mode. The model stays in eval mode: the DFS walks need one
        deterministic forward (no dropout) to produce the exact gradient."""
        self._require_model()
        self._training = bool(mode)
        return self

    # --------------------------------------------------------- rollout / weights --
    def connect_engine(self, engine, meta: WeightUpdateMeta):
        raise NotImplementedError(
            "DTATrainEngine does not drive an inference engine (SGLang/vLLM): run the rollout "
            "with AReaL's inference engine and hand the batches to train_batch / "
            "PPOActor.ppo_update; move weights through disk with "
            "save(SaveLoadMeta(path, 'hf', with_optim=False)) and the inference engine's "
            "update_weights_from_disk")

    def update_weights(self, meta: WeightUpdateMeta):
        raise NotImplementedError(
            "DTATrainEngine has no connected inference engine to push weights to (xccl or "
            "disk); save the weights in HF format with save() and load them on the server")

    def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size: int = 1):
        raise NotImplementedError("DTATrainEngine does not run rollouts; use AReaL's "
                                  "inference engine (e.g. RemoteSGLangEngine.rollout_batch)")

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None,
                      group_size: int = 1, dynamic_bs: bool = False):
        raise NotImplementedError("DTATrainEngine does not run rollouts; use AReaL's "
                                  "inference engine (e.g. RemoteSGLangEngine.prepare_batch)")

    def set_version(self, version: int):
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    # -------------------------------------------------------------- checkpoints --
    def _optim_path(self, path: str) -> str:
        return os.path.join(path, f"optim_world_size_{self.world_size}_rank_{self.rank}.pt")

    def save(self, meta: SaveLoadMeta):
        """``hf``: ``model.save_pretrained`` (rank 0; weights in the compute dtype, as
        FSDPEngine exports them) plus the tokenizer/processor when given; ``with_optim`` adds
        ``optim_world_size_{W}_rank_{r}.pt`` as FSDPEngine does."""
        self._require_model()
        if meta.weight_format != "hf":
            raise NotImplementedError(f"DTATrainEngine saves weight_format 'hf' only, got "
                                      f"{meta.weight_format!r}")
        os.makedirs(meta.path, exist_ok=True)
        if self.rank == 0:
            self.model.save_pretrained(meta.path)
            if meta.tokenizer is not None:
                meta.tokenizer.save_pretrained(meta.path)
            if meta.processor is not None:
                meta.processor.save_pretrained(meta.path)
        if meta.with_optim:
            self._require_optimizer()
            torch.save(self.optimizer.state_dict(), self._optim_path(meta.path))
        self._barrier()

    def load(self, meta: SaveLoadMeta):
        """The inverse of :meth:`save`: weights from the directory's safetensors (a local
        path only), the optimizer state when ``with_optim``."""
        self._require_model()
        if meta.weight_format != "hf":
            raise NotImplementedError(f"DTATrainEngine loads weight_format 'hf' only, got "
                                      f"{meta.weight_format!r}")
        state = _local_state_dict(meta.path)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"checkpoint {meta.path!r} does not match the model: missing "
                             f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
        if self._master is not None:
            with torch.no_grad():
                for m, p in zip(self._master, self._trainable()):
                    m.copy_(p)
        if meta.with_optim:
            self._require_optimizer()
            self.optimizer.load_state_dict(torch.load(self._optim_path(meta.path),
                                                      weights_only=False))
        self._barrier()

    # ------------------------------------------------------------------ optimizer --
    def optimizer_zero_grad(self):
        self._require_optimizer()
        self.optimizer.zero_grad()
        self.model.zero_grad(set_to_none=True)

    def optimizer_step(self):
        """Average gradients over data-parallel ranks, clip by the global norm
        (``optimizer.gradient_clipping``), step — or, on a non-finite norm, zero the
        gradients and skip. Returns ``{update_successful, grad_norm, lr}`` like FSDPEngine."""
        self._require_optimizer()
        self._reduce_gradients()
        if self._master is not None:
            for m, p in zip(self._master, self._trainable()):
                m.grad = None if p.grad is None else p.grad.detach().to(m.dtype)
        params = self._master if self._master is not None else self._trainable()
        norm, updated = clip_and_step(_Params(params), self.optimizer,
                                      self.optimizer_config.gradient_clipping)
        if not updated:
            self.model.zero_grad(set_to_none=True)
        elif self._master is not None:
            with torch.no_grad():
                for m, p in zip(self._master, self._trainable()):
                    p.copy_(m)
        return dict(update_successful=float(updated), grad_norm=float(norm),
                    lr=self.lr_scheduler.get_last_lr()[0])

    def lr_scheduler_step(self):
        assert self.lr_scheduler is not None, "no LR scheduler (no optimizer configured)"
        self.lr_scheduler.step()

    # ------------------------------------------------------------ train / forward --
    def train_batch(self, input_, loss_fn: Callable[..., torch.Tensor],
                    loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> dict[str, float]:
        """One optimizer step on the batch (see the module doc). Returns FSDPEngine's keys:
        ``update_successful``, ``grad_norm``, ``lr`` and ``num_micro_batches`` (the number of
        loss_fn calls: one per sequence)."""
        self._require_optimizer()
        self.optimizer_zero_grad()
        ids, mbs = self._sequences(input_)
        scales = self._loss_scales(mbs, loss_weight_fn, multiplier=self.world_size)
        self._walk(ids, mbs, loss_fn, scales, train=True)
        stats = self.optimizer_step()
        stats["num_micro_batches"] = len(mbs)
        return stats

    @torch.no_grad()
    def eval_batch(self, input_, loss_fn: Callable[..., torch.Tensor],
                   loss_weight_fn: Callable[[dict[str, Any]], torch.Tensor]) -> torch.Tensor | None:
        """Σ over sequences of ``loss_fn × loss_weight_fn(mb) / Σ loss_weight_fn``,
        all-reduced over data-parallel ranks (FSDPEngine.eval_batch)."""
        self._require_model()
        ids, mbs = self._sequences(input_)
        scales = self._loss_scales(mbs, loss_weight_fn, multiplier=1)
        losses = self._walk(ids, mbs, loss_fn, scales, train=False)
        loss = torch.stack(losses).sum(dtype=torch.float32)
        if self._dp_group is not None:
            dist.all_reduce(loss, group=self._dp_group)
        return loss

    @torch.no_grad()
    def forward_batch(self, input_, output_seqlens: list[int] | None = None,
                      aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat):
        """Log-probs aligned as FSDPEngine's: ``out[i, t] = log p(ids[i, t+1] | ids[i, :t+1])``
        for ``t < L_i - 1``; ``out[i, L_i - 1]`` is the log-prob of the wrap label (AReaL's roll
        artefact with one sequence per micro-batch); padding is 0. Dict input gives a
        ``[B, max L_i]`` tensor, list input a list of per-trajectory tensors."""
        self._require_model()
        batched, meta = convert.normalize_input(input_)
        ids, _ = convert.split_sequences(batched, model_type=self._model_type())
        lengths = [len(s) for s in ids]
        if meta is not None:
            inferred = [d["attention_mask"].shape[-1] for d in input_]
            if output_seqlens is not None and output_seqlens != inferred:
                raise ValueError(f"output_seqlens mismatch for list input: given {output_seqlens}, "
                                 f"inferred {inferred} from attention_mask shapes.")
            output_seqlens = inferred if len(inferred) == len(ids) else lengths
        if output_seqlens is None:
            output_seqlens = lengths
        batch = self._walk_batch(ids)
        walker = self._walker()
        tree = PrefixTree(batch.input_ids, min_shared=self.dta.min_shared)
        res = walker.forward(tree, batch)
        self._record_tree(ids, tree, res.tokens)
        outputs = [convert.areal_view(lp, n) for lp, n in zip(res.logprobs, lengths)]
        result = convert.pad_outputs(outputs, list(output_seqlens), aggregate_fn)
        return result if meta is None else convert.split_batch(result, meta)

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        """AReaL's micro-batch interface, without prefix sharing: for each micro-batch the
        packed logits ``[T, V]`` (every packed segment, padding included, forwarded on its own,
        so sequences never attend to each other), then ``process_output_fn(logits, ctx)`` with
        FSDPEngine's context keys, and ``backward()`` on its result unless ``forward_only``.
        ``train_batch`` / ``forward_batch`` / ``eval_batch`` are the DFS paths."""
        self._require_model()
        for item in mb_list:
            padded = item.padded_mb
            ids = padded["input_ids"].reshape(-1).to(self.device)
            pos = padded.get("position_ids")
            pos = None if pos is None else pos.reshape(-1).to(self.device)
            cu = [int(c) for c in padded["cu_seqlens"]]
            with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
                parts = []
                for a, b in zip(cu[:-1], cu[1:]):
                    if b > a:
                        p = torch.arange(b - a, device=self.device) if pos is None else pos[a:b]
                        parts.append(self.model(input_ids=ids[a:b][None],
                                                position_ids=p[None]).logits[0])
                logits = torch.cat(parts)
                ctx = dict(model_inputs=padded, mb_input=item.orig_mb,
                           pad_length=item.padding_length, ulysses_pad_size=0, trie_node=None)
                loss = process_output_fn(logits, ctx)
                if not forward_only and loss is not None:
                    loss.backward()

    # ------------------------------------------------------------------- the walk --
    def _sequences(self, input_):
        batched, _ = convert.normalize_input(input_)
        return convert.split_sequences(batched, model_type=self._model_type(), device=self.device)

    def _loss_scales(self, mbs, loss_weight_fn, multiplier: int) -> list[float]:
        """``loss_weight_fn(mb) / Σ_all loss_weight_fn × multiplier`` per sequence, computed
        as FSDPEngine does (the total in float32, all-reduced over data-parallel ranks)."""
        weights = [loss_weight_fn(mb) for mb in mbs]
        total = torch.stack([torch.as_tensor(w) for w in weights]).sum().detach().clone().to(
            dtype=torch.float32, device=self.device)
        if self._dp_group is not None:
            dist.all_reduce(total, group=self._dp_group)
        if not total > 0:
            raise ValueError(f"the total loss weight of the batch is {float(total)}; it must be "
                             "positive (does any sequence have a trainable token?)")
        return [0.0 if w == 0 else float(w / total * multiplier) for w in weights]

    def _walk_batch(self, ids, scales=None):
        cfg = self.config
        labels = [convert.wrap_label(s, pad_to_maximum=cfg.pad_to_maximum,
                                     max_tokens_per_mb=cfg.mb_spec.max_tokens_per_mb) for s in ids]
        batch = convert.walk_batch(ids, scales, labels=labels, max_positions=self._max_positions())
        batch.validate(vocab_size=self.model.config.vocab_size,
                       max_positions=self._max_positions(), required=(convert.SEQ_INDEX,))
        return batch

    def _walk(self, ids, mbs, loss_fn, scales, *, train: bool) -> list[torch.Tensor]:
        """Evaluate ``loss_fn`` once per sequence (scaled) on the forward walk's tensors; with
        ``train``, accumulate the exact gradient of the scaled sum by a training walk."""
        batch = self._walk_batch(ids, scales)
        walker = self._walker()
        tree = PrefixTree(batch.input_ids, min_shared=self.dta.min_shared)
        fwd = walker.forward(tree, batch, minmax=True)
        temperature = float(self.config.temperature)
        lengths = [len(s) for s in ids]
        values: list[torch.Tensor] = []

        def per_sequence(lp, ent, fields):
            i = int(fields[convert.SEQ_INDEX][0])
            if scales[i] == 0:  # FSDPEngine skips loss_fn for a zero-weight micro-batch
                return lp.sum() * 0.0
            n = lengths[i]
            # AReaL reports the min/max of the raw logits; the walker's are divided by T
            vmin = (convert.areal_view(fwd.vocab_min[i], n) * temperature).float()
            vmax = (convert.areal_view(fwd.vocab_max[i], n) * temperature).float()
            loss = loss_fn(convert.areal_view(lp, n), convert.areal_view(ent, n), mbs[i],
                           vocab_min_logits=vmin, vocab_max_logits=vmax)
            values.append((loss * scales[i]).detach())
            return loss

        loss = SequenceLoss(per_sequence, (convert.SEQ_INDEX,))
        forwarded = fwd.tokens
        if train:
            with torch.enable_grad():
                objective, total = linearize(batch, loss, "sum", fwd.logprobs, fwd.entropy)
                res = walker.train(tree, objective)
            forwarded += res.tokens + res.recomputed_tokens
        else:
            _, total = linearize(batch, loss, "sum", fwd.logprobs, fwd.entropy)
        self._record_tree(ids, tree, forwarded, loss=total)
        return values or [torch.zeros((), device=self.device)]

    def _walker(self) -> Walker:
        return Walker(self.model, policy=self.policy, logits_chunk=self.dta.logits_chunk,
                      temperature=float(self.config.temperature))

    def _record_tree(self, ids, walked: PrefixTree, forwarded: int, loss: float | None = None):
        stats = PrefixTree(ids, min_shared=self.dta.min_shared).stats()
        self._last = dict(tree_token_ratio=float(stats.sharing_ratio),
                          tree_total_tokens=float(stats.total_tokens),
                          tree_unique_tokens=float(stats.unique_tokens),
                          tree_sequences=float(stats.sequences),
                          tree_depth=float(stats.depth),
                          dta_forwarded_tokens=float(forwarded))
        if loss is not None:
            self._last["dta_loss"] = float(loss)

    # ------------------------------------------------------------------ stats / misc --
    def export_stats(self) -> dict[str, float]:
        """``stats_tracker.export_all`` (what loss functions recorded), plus the last batch's
        tree statistics: ``tree_token_ratio`` (total tokens / unique prefix-tree tokens),
        ``tree_total_tokens``, ``tree_unique_tokens``, ``tree_sequences``, ``tree_depth``,
        ``dta_forwarded_tokens`` (what the walks forwarded) and ``dta_loss`` (last train or
        eval batch, this rank)."""
        out = stats_tracker.export_all(reduce_group=self._dp_group)
        out.update(self._last)
        return out

    def offload(self) -> None:
        raise NotImplementedError("DTATrainEngine does not offload (torch_memory_saver); its "
                                  "memory is bounded by one root-to-leaf path instead")

    def onload(self) -> None:
        raise NotImplementedError("DTATrainEngine does not offload, so there is nothing to onload")

    def get_device_stats(self) -> DeviceRuntimeInfo:
        return DeviceRuntimeInfo.get_current()

    # ------------------------------------------------------------------- helpers --
    def _trainable(self):
        return [p for p in self.model.parameters() if p.requires_grad]

    def _model_type(self) -> str:
        return getattr(self.model.config, "model_type", "") if self.model is not None else ""

    def _max_positions(self):
        return getattr(self.model.config, "max_position_embeddings", None)

    def _require_model(self):
        if self.model is None:
            raise RuntimeError("the engine is not initialized: call initialize() first")

    def _require_optimizer(self):
        self._require_model()
        if self.optimizer is None:
            raise RuntimeError("no optimizer: the engine's config has optimizer=None "
                               "(inference only)")

    def _reduce_gradients(self):
        if self._dp_group is None or self.world_size == 1:
            return
        for p in self._trainable():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self._dp_group)
            p.grad.div_(self.world_size)

    def _barrier(self):
        if self._cpu_group is not None:
            dist.barrier(group=self._cpu_group)


def _local_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # a weights-only directory: training needs no tokenizer
        return None


def _local_state_dict(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path!r} is not a local directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path!r}")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


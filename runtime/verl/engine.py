"""``DTAEngine``: verl's ``BaseEngine`` on DTA's depth-first prefix-tree walk, registered in
verl's ``EngineRegistry`` as backend ``dta`` for language models (cuda and cpu) -- an
adapter of the engine core (``runtime.engine``, docs/engine.md).

``forward_backward_batch(data, loss_function, forward_only)`` keeps the contract of verl's
``FSDPEngineWithLMHead`` (verl 0.9.1): ``batch_num_tokens`` and ``dp_size`` are set on the
batch, ``loss_function(model_output=, data=, dp_group=)`` returns ``(loss, metrics)``, the
loss's gradient is accumulated, and the result is ``{"model_output", "loss", "metrics"}`` with
nested ``log_probs`` (and ``entropy`` when ``calculate_entropy``) in the batch's row order.
What differs is how: every row is its own micro-batch (verl's layout, one row) and the batch
is walked as one prefix tree, so a prefix shared by many rows (a GRPO group's prompt, the
earlier turns of a multi-turn conversation) is forwarded once: verl's ``loss_function`` runs
once per row (opaque, inside a :class:`dta.losses.SequenceLoss`) on a forward walk's
log-probs, and the engine core trains it (``EngineCore.walk_sequences``: the forward walk,
the loss linearized, the training walk -- the same gradient). This module only translates
verl's batch and loss.

verl's loss aggregation (``agg_loss``: ``token-mean``, ``seq-mean-token-sum``,
``seq-mean-token-mean``, ``seq-mean-token-sum-norm``) normalizes each micro-batch by the
global batch's ``batch_num_tokens`` / ``global_batch_size`` / horizon, so per-row losses sum to
the batch's loss exactly; :func:`runtime.verl.batch.batch_normalizers` fills the ones the
caller left unset from the whole batch.

What the engine core does (``runtime.engine.EngineCore``): build the model (LoRA by its one
rule), apply context parallelism (``ulysses_sequence_parallel_size``) and the sharding mode
(``dta_sharding``: replicate / zero1 / fsdp) by the layout (:func:`runtime.verl.config.
settings_of`), walk with the run's one ``WalkOptions`` (at each batch's temperature:
``core.walker(temperature=)``), the one gradient reduction (a SUM over the world), clip, step
or skip, checkpoints and the full state. verl's losses multiply by ``dp_size`` because verl's
FSDP averages gradients over the data-parallel ranks; the core sums them, so the surrogate
the training walk backpropagates is divided by the data-parallel size (verl's reported losses
are left as verl computes them). The model stays in eval mode (one deterministic forward for
both walks: no dropout).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

import runtime.verl.batch as vb
from dta.losses import SequenceLoss
from dta.model.lora import is_peft_model, merged_weights
from runtime.engine import EngineCore, build_model, comm
from runtime.errors import ShardingRefused
from runtime.verl.checkpoint import load_checkpoint, save_checkpoint
from runtime.verl.config import check_engine_config, dtypes, model_spec, settings_of, sharding_keys

__all__ = ["DTAEngine", "DTAEngineWithLMHead"]


class DTAEngine(BaseEngine):
    """verl's engine interface on DTA's walk (see the module doc). Built by verl as
    ``EngineRegistry.new("language_model", "dta", model_config=, engine_config=,
    optimizer_config=, checkpoint_config=)`` inside an initialized process group."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config=None):
        super().__init__()
        check_engine_config(engine_config)
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.spec = model_spec(model_config)
        self.dtype, self.master_dtype = dtypes(engine_config)  # compute, masters (or None)
        self.settings = self.core = self.lr_scheduler = None
        self.mode = None
        self.adapters_off = False  # inside disable_adapter(): the reference policy
        self.device = torch.device("cpu")
        self.last: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle --
    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        """``optimizer_offload``: the optimizer state lives in host memory and steps there
        (it never moves: :meth:`to` leaves it)."""
        return self.core is not None and self.core.layout.offload != "none"

    def initialize(self):
        """The run's settings (layout + walk) from verl's configs, then the engine core:
        the model from ``model_config.local_path`` (LoRA adapters when ``lora_rank > 0``)
        computing in ``mixed_precision.param_dtype`` with ``model_dtype`` masters where they
        differ (:func:`runtime.verl.config.dtypes`), parallelized and sharded by the layout;
        verl's optimizer and LR scheduler over what the sharding mode steps (the masters
        where kept)."""
        self.settings = settings_of(self.engine_config, self.model_config,
                                    world=comm.world_size(), rank=comm.rank())
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        trains = not self.engine_config.forward_only and self.optimizer_config is not None
        try:
            self.core = EngineCore(self._build, layout=self.settings.layout,
                                   walk=self.settings.walk,
                                   make_optimizer=self._optimizer if trains else _never_stepped,
                                   compute_dtype=self.dtype,
                                   master_dtype=self.master_dtype if trains else None,
                                   device=self.device)  # forward only: no masters
        except ShardingRefused as exc:  # the sharding mode's refusal, with the keys that chose it
            keys = sharding_keys(self.engine_config, self.model_config, self.settings.layout)
            raise ShardingRefused(f"{keys}: {exc}") from None
        self.core.parallelize()
        if trains:
            from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

            self.rank = comm.rank()
            # verl's schedule, built by verl's own code (it reads only optimizer_config)
            self.lr_scheduler = FSDPEngine._build_lr_scheduler(self, self.core.optimizer)

    def _build(self, dtype):
        model = build_model(self.spec, dtype).eval()
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.do_sample = False
        return model

    def _optimizer(self, params):
        from verl.workers.config.optimizer import build_optimizer

        return build_optimizer(list(params), self.optimizer_config)

    @property
    def module(self):
        """The model as the core holds it (sharded parameters are DTensors under fsdp)."""
        return self._core().model

    @property
    def optimizer(self):
        return None if self.core is None else self.core.optimizer

    @property
    def options(self):
        """The walk's settings (``dta.options.WalkOptions``), resolved once for the layout."""
        return self._core().walk

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """The model stays on the engine's device; the optimizer state where it lives (the
        device, or host memory under ``optimizer_offload``: a move of it alone is a no-op)."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        offloaded = optimizer and not model and self.is_optimizer_offload_enabled
        if torch.device(device).type != self.device.type and not offloaded:
            raise NotImplementedError(f"the dta engine keeps its state on {self.device} "
                                      f"(no offload to {device})")

    # ------------------------------------------------------------ data parallel --
    def get_data_parallel_rank(self):
        return self._core().layout.dp_rank

    def get_data_parallel_size(self):
        return self._core().layout.data_parallel

    def get_data_parallel_group(self):
        return self._core().groups.data

    def is_mp_src_rank_with_outputs(self):
        """Whether this rank heads its context-parallel group (verl collects the outputs of
        those: every rank of a group holds the group's outputs)."""
        return self._core().layout.is_head

    # ---------------------------------------------------------------- optimizer --
    def optimizer_zero_grad(self):
        """Clear the gradients and open the step (fsdp: the ranks' matched decoder calls)."""
        self._core().zero_grad()

    def optimizer_step(self):
        """The core's step: the one gradient reduction (a SUM over the world), the clip by
        ``optimizer_config.clip_grad``, the update -- or the skip of a non-finite norm.
        Returns the norm before clipping."""
        if self.lr_scheduler is None:
            raise RuntimeError("a forward-only dta engine (no optimizer_config) has no step")
        norm, _ = self._core().optimizer_step(self.optimizer_config.clip_grad)
        return norm

    def lr_scheduler_step(self):
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # ----------------------------------------------------------------- the walk --
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable,
                               forward_only=False) -> dict[str, Any]:
        """The batch as one prefix tree (see the module doc); ``loss_function`` once per row,
        or none (forward only: log-probs and entropy)."""
        core = self._core()
        if self.adapters_off and not forward_only:
            raise NotImplementedError("the dta engine trains the LoRA adapters: training inside "
                                      "disable_adapter() is refused (verl uses it for the "
                                      "reference policy's log-probs)")
        rows = vb.sequences(data)
        group, dp = core.groups.data, core.layout.data_parallel
        if "loss_mask" in data.keys():
            vb.batch_normalizers(data, rows, group, dp, self.device)
        mbs = [mb.to(self.device) for mb in vb.one_sequence_batches(data)]  # as verl's engines
        batch = vb.walk_batch(rows, max_positions=getattr(core.model.config,
                                                          "max_position_embeddings", None))
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        lengths = [len(r) for r in rows]
        losses: list[float] = [0.0] * len(rows)
        metrics: dict[str, list] = {}

        def per_row(lp, ent, fields):
            i = int(fields[vb.SEQ_INDEX][0])
            out = {"log_probs": vb.nested([vb.verl_view(lp, lengths[i])])}
            if entropy:
                out["entropy"] = vb.nested([vb.verl_view(ent, lengths[i])])
            loss, row_metrics = loss_function(model_output=out, data=mbs[i], dp_group=group)
            losses[i] = float(loss.detach())
            append_to_dict(metrics, row_metrics)
            return loss / dp  # verl's x dp_size, for an average; the core sums

        loss = None if loss_function is None else \
            SequenceLoss(per_row, (vb.SEQ_INDEX,), uses_entropy=entropy)
        res = core.walk_sequences(batch, loss, train=loss is not None and not forward_only,
                                  reduction="sum", temperature=vb.temperature_of(data),
                                  adapters=not self.adapters_off, counted=lengths)
        outputs = {"log_probs": [vb.verl_view(lp, n).detach()
                                 for lp, n in zip(res.logprobs, lengths)]}
        if entropy:
            outputs["entropy"] = [vb.verl_view(e, n).detach() for e, n in zip(res.entropy, lengths)]
        self.last = dict(tree_token_ratio=float(res.tree.sharing_ratio),
                         tree_unique_tokens=float(res.tree.unique_tokens),
                         tree_total_tokens=float(res.tree.total_tokens),
                         dta_forwarded_tokens=float(res.forwarded_tokens),
                         context_parallel_sent_bytes=float(res.sent_bytes))
        model_output = {k: vb.nested(v) for k, v in outputs.items()}
        return {"model_output": model_output, "loss": losses, "metrics": metrics}

    # ------------------------------------------------------------------ weights --
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """The weights the rollout loads, ``(Hugging Face name, whole tensor)`` per parameter in
        the compute dtype on the engine's device: the core's full tensors (under fsdp each is
        gathered as the generator reaches it: every rank iterates it to the end, as verl's
        FSDP engine's), or a LoRA model's base with the adapters merged (verl's
        ``lora.merge``; LoRA runs replicate / zero1, whose model holds every weight); no PEFT
        config."""
        core = self._core()
        if is_peft_model(core.model):  # dta.model.lora's one merge
            return merged_weights(core.model), None
        return core.named_full_tensors(), None  # fsdp: one gather per tensor, every rank

    @contextlib.contextmanager
    def disable_adapter(self):
        """The base model (LoRA adapters off) inside the context: verl's reference policy's
        log-probs, walked on the base sharing the weights (``EngineCore.walk_sequences(
        adapters=False)``)."""
        self.adapters_off = True
        try:
            yield
        finally:
            self.adapters_off = False

    # -------------------------------------------------------------- checkpoints --
    def save_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None,
                        global_step: int = 0, max_ckpt_to_keep: Optional[int] = None, **kwargs):
        if hdfs_path is not None:
            raise NotImplementedError("the dta engine saves to a local path (hdfs_path unset)")
        save_checkpoint(self._core(), self.lr_scheduler, local_path, step=global_step,
                        keep=max_ckpt_to_keep)

    def load_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None,
                        del_local_after_load: bool = True, **kwargs):
        if hdfs_path is not None:
            raise NotImplementedError("the dta engine loads from a local path (hdfs_path unset)")
        load_checkpoint(self._core(), self.lr_scheduler, local_path)

    # ------------------------------------------------------------------ helpers --
    def _core(self) -> EngineCore:
        if self.core is None:
            raise RuntimeError("the dta engine is not initialized: call initialize() first")
        return self.core

    def release_gradients(self):
        """Free the gradients without a collective (leaving train mode; the next step's
        ``optimizer_zero_grad`` clears the rest)."""
        for p in self._core().model.parameters():
            p.grad = None


def _never_stepped(params):
    """A forward-only engine's optimizer (the sharding modes build one): never stepped."""
    return torch.optim.SGD(list(params), lr=0.0)


class _ModeCtx(BaseEngineCtx):
    """verl's mode context: records the mode (the model itself stays in eval mode); leaving
    train mode frees the gradients, as FSDP's does."""

    def __enter__(self):
        self.engine.mode = self.mode

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None) and \
                self.engine.core is not None:
            self.engine.release_gradients()
        self.engine.mode = None


@EngineRegistry.register(model_type="language_model", backend="dta", device=["cuda", "cpu"])
class DTAEngineWithLMHead(DTAEngine):
    """The registered class: ``strategy: dta`` for an actor / reference language model."""

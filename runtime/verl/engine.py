"""``DTAEngine``: verl's ``BaseEngine`` on DTA's depth-first prefix-tree walk, registered in
verl's ``EngineRegistry`` as backend ``dta`` for language models (cuda and cpu).

``forward_backward_batch(data, loss_function, forward_only)`` keeps the contract of verl's
``FSDPEngineWithLMHead`` (verl 0.9.1): ``batch_num_tokens`` and ``dp_size`` are set on the
batch, ``loss_function(model_output=, data=, dp_group=)`` returns ``(loss, metrics)``, the
loss's gradient is accumulated, and the result is ``{"model_output", "loss", "metrics"}`` with
nested ``log_probs`` (and ``entropy`` when ``calculate_entropy``) in the batch's row order.
What differs is how: every row is its own micro-batch (verl's layout, one row) and the batch
is walked as one prefix tree, so a prefix shared by many rows (a GRPO group's prompt, the
earlier turns of a multi-turn conversation) is forwarded once:

1. a forward-only walk records every row's log-probs and entropies;
2. verl's ``loss_function`` runs once per row on them (opaque, inside a
   :class:`dta.losses.SequenceLoss`) and is linearized (``dta.objective.linearize``);
3. a training walk backpropagates the linear surrogate, which has the same gradient.

verl's loss aggregation (``agg_loss``: ``token-mean``, ``seq-mean-token-sum``,
``seq-mean-token-mean``, ``seq-mean-token-sum-norm``) normalizes each micro-batch by the
global batch's ``batch_num_tokens`` / ``global_batch_size`` / horizon, so per-row losses sum to
the batch's loss exactly; :func:`runtime.verl.batch.batch_normalizers` fills the ones the
caller left unset from the whole batch. Data parallelism: full replicas over verl's process
group (``torch.distributed`` WORLD), gradients averaged before the step as FSDP's are.
The model stays in eval mode (one deterministic forward for both walks: no dropout).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict

from dta.losses import SequenceLoss
from dta.model.lora import apply_lora, is_peft_model
from dta.model.models import load_model
from dta.objective import linearize
from dta.train import checked_walker, clip_and_step
from dta.tree import PrefixTree

from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

import runtime.verl.batch as vb
from runtime.verl.checkpoint import load_checkpoint, save_checkpoint
from runtime.verl.config import check_engine_config, model_dtype, walk_options
from runtime.verl.lora import ReferencePolicy, merged_weights

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
        self.options = walk_options(engine_config, gradient_checkpointing=bool(
            getattr(model_config, "enable_gradient_checkpointing", False)))
        self.dtype = model_dtype(engine_config)
        self.lora = int(getattr(model_config, "lora_rank", 0) or 0) > 0
        self.mode = None
        self.module = self.optimizer = self.lr_scheduler = None
        self.device = torch.device("cpu")
        self.last: dict[str, float] = {}

    # ----------------------------------------------------------------- lifecycle --
    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def is_mp_src_rank_with_outputs(self):
        return True

    def initialize(self):
        """Load the model from ``model_config.local_path`` in ``model_dtype`` (LoRA adapters
        when ``lora_rank > 0``), then verl's optimizer and LR scheduler over what trains."""
        if not dist.is_initialized():
            raise RuntimeError("the dta engine runs inside verl's process group: initialize "
                               "torch.distributed first (verl's workers do)")
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        path = self.model_config.local_path or self.model_config.path
        model = load_model(path, dtype=self.dtype, attn_implementation="sdpa")
        if self.lora:
            model = self._wrap_lora(model)
        self.module = model.to(self.device).eval()
        self.policy = ReferencePolicy(self.module)
        if getattr(self.module, "generation_config", None) is not None:
            self.module.generation_config.do_sample = False
        if not self.engine_config.forward_only and self.optimizer_config is not None:
            from verl.workers.config.optimizer import build_optimizer
            from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

            self.optimizer = build_optimizer(self._trainable(), self.optimizer_config)
            self.rank = dist.get_rank()
            # verl's schedule, built by verl's own code (it reads only optimizer_config)
            self.lr_scheduler = FSDPEngine._build_lr_scheduler(self, self.optimizer)

    def _wrap_lora(self, model):
        """verl's ``lora_rank`` / ``lora_alpha`` / ``target_modules`` (``all-linear``: every
        linear layer but the head); the base frozen, dropout-free (``dta.model.lora``)."""
        targets = self.model_config.target_modules
        targets = "all-linear" if targets in (None, "all-linear", ["all-linear"]) else \
            list(targets)
        return apply_lora(model, r=int(self.model_config.lora_rank),
                          alpha=float(self.model_config.lora_alpha), target_modules=targets)

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if torch.device(device).type != self.device.type:
            raise NotImplementedError(f"the dta engine keeps its state on {self.device} "
                                      f"(no offload to {device})")

    # ------------------------------------------------------------ data parallel --
    def get_data_parallel_rank(self):
        return dist.get_rank()

    def get_data_parallel_size(self):
        return dist.get_world_size()

    def get_data_parallel_group(self):
        return dist.group.WORLD

    # ---------------------------------------------------------------- optimizer --
    def optimizer_zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)
        self.module.zero_grad(set_to_none=True)

    def optimizer_step(self):
        """Average the gradients over the data-parallel ranks (FSDP's reduction), clip by
        ``optimizer_config.clip_grad``, step -- or skip on a non-finite norm. Returns the
        norm before clipping."""
        params = self._trainable()
        if dist.get_world_size() > 1:  # one flat all-reduce (on the device: NCCL)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat /= dist.get_world_size()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        norm, _ = clip_and_step(self.module, self.optimizer, self.optimizer_config.clip_grad)
        return norm

    def lr_scheduler_step(self):
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # ----------------------------------------------------------------- the walk --
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable,
                               forward_only=False) -> dict[str, Any]:
        """The batch as one prefix tree (see the module doc); ``loss_function`` once per row,
        or none (forward only: log-probs and entropy)."""
        model = self.policy.current
        if self.policy.off and not forward_only:
            raise NotImplementedError("the dta engine trains the LoRA adapters: training inside "
                                      "disable_adapter() is refused (verl uses it for the "
                                      "reference policy's log-probs)")
        for key in ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"):
            if tu.get_non_tensor_data(data, key, False):
                raise NotImplementedError(f"the batch asks for {key}=True: the dta engine "
                                          "returns log-probs and entropy only")
        rows = vb.sequences(data)
        if "loss_mask" in data.keys():
            vb.batch_normalizers(data, rows, self.get_data_parallel_group(), self.device)
        # each row's micro-batch on the engine's device, as verl's engines move theirs
        mbs = [mb.to(self.device) for mb in vb.one_sequence_batches(data)]
        options = self.options.replace(temperature=vb.temperature_of(data))
        max_positions = getattr(model.config, "max_position_embeddings", None)
        batch = vb.walk_batch(rows, max_positions=max_positions)
        batch.validate(vocab_size=model.config.vocab_size, max_positions=max_positions,
                       required=(vb.SEQ_INDEX,))
        walker = checked_walker(model, options=options)
        tree = PrefixTree(batch.input_ids, min_shared=options.min_shared)
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        with torch.no_grad():
            fwd = walker.forward(tree, batch)
        lengths = [len(r) for r in rows]
        outputs = {"log_probs": [vb.verl_view(fwd.logprobs[i], n).detach()
                                 for i, n in enumerate(lengths)]}
        if entropy:
            outputs["entropy"] = [vb.verl_view(fwd.entropy[i], n).detach()
                                  for i, n in enumerate(lengths)]
        losses: list[float] = [0.0] * len(rows)
        metrics: dict[str, list] = {}

        def per_row(lp, ent, fields):
            i = int(fields[vb.SEQ_INDEX][0])
            n = lengths[i]
            out = {"log_probs": vb.nested([vb.verl_view(lp, n)])}
            if entropy:
                out["entropy"] = vb.nested([vb.verl_view(ent, n)])
            loss, row_metrics = loss_function(model_output=out, data=mbs[i],
                                              dp_group=self.get_data_parallel_group())
            losses[i] = float(loss.detach())
            append_to_dict(metrics, row_metrics)
            return loss

        forwarded = fwd.tokens
        if loss_function is not None:
            seq_loss = SequenceLoss(per_row, (vb.SEQ_INDEX,), uses_entropy=entropy)
            if forward_only:
                linearize(batch, seq_loss, "sum", fwd.logprobs, fwd.entropy)
            else:
                with torch.enable_grad():
                    objective, _ = linearize(batch, seq_loss, "sum", fwd.logprobs, fwd.entropy)
                    res = walker.train(tree, objective)
                forwarded += res.tokens + res.recomputed_tokens
        stats = PrefixTree(rows, min_shared=options.min_shared).stats()
        self.last = dict(tree_token_ratio=float(stats.sharing_ratio),
                         tree_unique_tokens=float(stats.unique_tokens),
                         tree_total_tokens=float(stats.total_tokens),
                         dta_forwarded_tokens=float(forwarded))
        model_output = {k: vb.nested(v) for k, v in outputs.items()}
        return {"model_output": model_output, "loss": losses, "metrics": metrics}

    # ------------------------------------------------------------------ weights --
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """The weights the rollout loads, by Hugging Face name: the whole model's state (a LoRA
        model's adapters merged into the base, as verl's ``lora.merge``), and no PEFT config."""
        if is_peft_model(self.module):
            return merged_weights(self.module), None
        state = self.module.state_dict()
        return ((name, t.detach()) for name, t in state.items()), None

    def disable_adapter(self):
        """The base model (LoRA adapters off) inside the context: verl's reference policy's
        log-probs, walked on a base view sharing the weights (:mod:`runtime.verl.lora`)."""
        return self.policy.disabled()

    # -------------------------------------------------------------- checkpoints --
    def save_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None,
                        global_step: int = 0, max_ckpt_to_keep: Optional[int] = None, **kwargs):
        if hdfs_path is not None:
            raise NotImplementedError("the dta engine saves to a local path (hdfs_path unset)")
        save_checkpoint(local_path, self._named_trainable(), self.optimizer, self.lr_scheduler,
                        step=global_step, keep=max_ckpt_to_keep)

    def load_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None,
                        del_local_after_load: bool = True, **kwargs):
        if hdfs_path is not None:
            raise NotImplementedError("the dta engine loads from a local path (hdfs_path unset)")
        load_checkpoint(local_path, self._named_trainable(), self.optimizer, self.lr_scheduler)

    # ------------------------------------------------------------------ helpers --
    def _trainable(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def _named_trainable(self):
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]


class _ModeCtx(BaseEngineCtx):
    """verl's mode context: records the mode (the model itself stays in eval mode); leaving
    train mode zeroes the gradients, as FSDP's does."""

    def __enter__(self):
        self.engine.mode = self.mode

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None) and \
                self.engine.optimizer is not None:
            self.engine.optimizer_zero_grad()
        self.engine.mode = None


@EngineRegistry.register(model_type="language_model", backend="dta", device=["cuda", "cpu"])
class DTAEngineWithLMHead(DTAEngine):
    """The registered class: ``strategy: dta`` for an actor / reference language model."""

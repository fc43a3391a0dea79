"""One training step by DFS: validate, build the tree, walk, clip, step.

``accumulate_gradients`` is the piece a distributed runtime needs (it all-reduces ``.grad``
between it and the optimizer step); ``DFSTrainer`` is the single-process loop.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from dta.batch import Batch
from dta.model.lora import check_peft_model
from dta.losses import SequenceLoss, TokenLoss, Totals
from dta.objective import Objective, linearize
from dta.planning.blocks import DEFAULT_BLOCK_TOKENS
from dta.model.routing import MoERouters, check_routing, check_shared_routing
from dta.selfcheck import ensure_self_check
from dta.tree import PrefixTree, TreeStats
from dta.walk import Walker, WalkResult


class NoTrainedTokenWarning(UserWarning):
    """A batch without any trained token: the optimizer was not stepped."""


@dataclass
class StepResult:
    loss: float
    walk: WalkResult | None  # None when nothing was walked (no trained token)
    tree: TreeStats
    grad_norm: float | None = None
    updated: bool | None = None


def validate_for_model(batch: Batch, model, loss=None) -> None:
    cfg = model.config
    batch.validate(vocab_size=cfg.vocab_size,
                   max_positions=getattr(cfg, "max_position_embeddings", None),
                   required=loss.fields if loss is not None else ())
    check_routing(batch, MoERouters(model))  # routed_experts fit the model's MoE layers


def accumulate_gradients(model, batch: Batch, loss: TokenLoss | SequenceLoss, *,
                         reduction: str = "token_mean", totals: Totals | None = None,
                         policy: str = "retain", temperature: float = 1.0,
                         logits_chunk: int = 1024, min_shared: int = 1, record: bool = False,
                         progress=None, router_aux_loss: str = "refuse",
                         router_aux_loss_coef: float = 0.0, self_check: bool = True,
                         block_tokens: int | None = DEFAULT_BLOCK_TOKENS, **walk_kw) -> StepResult:
    """Add the batch's loss gradient into the parameters' ``.grad`` by one DFS walk.

    totals: normalizers of the mean reductions over the whole global batch, when this call
    sees only part of it (a data-parallel worker); default: this batch's own.
    router_aux_loss_coef: > 0 adds each sequence's router load-balancing loss (docs/moe.md);
    router_aux_loss: "refuse" | "exclude" (with the coefficient 0); self_check: probe the model
    once (cached) and refuse one the walker would train wrong; see ``dta.walk.Walker``.
    block_tokens: a node longer than this is walked as a chain of blocks, so no call (and
    under recompute no live graph) is longer (``dta.planning.blocks``); None or 0: no cut.
    walk_kw: the walker's packing options (``packing``, ``pack_tokens``, ``block_tokens``,
    ``head_rows``, ``pack_cost``, ``native_gqa``; see :class:`dta.walk.Walker`).
    """
    validate_for_model(batch, model, loss)
    check_routing(batch, MoERouters(model), aux_loss=router_aux_loss_coef > 0)
    tree = PrefixTree(batch.input_ids, min_shared=min_shared)
    check_shared_routing(batch, tree)  # one routing per shared token, before any forward
    walker = checked_walker(model, self_check, policy=policy, logits_chunk=logits_chunk,
                            temperature=temperature, router_aux_loss=router_aux_loss,
                            router_aux_loss_coef=router_aux_loss_coef,
                            block_tokens=block_tokens, **walk_kw)
    if isinstance(loss, SequenceLoss):
        fwd = walker.forward(tree, batch)
        objective, value = linearize(batch, loss, reduction, fwd.logprobs, fwd.entropy, totals)
        res = walker.train(tree, objective, record=record, progress=progress)
        res.loss = value + res.aux_loss  # the opaque loss, and the router aux loss (docs/moe.md)
    else:
        res = walker.train(tree, Objective(batch, loss, reduction, totals), record=record,
                           progress=progress)
    return StepResult(res.loss, res, tree.stats())


def forward_logprobs(model, batch: Batch, *, temperature: float = 1.0, logits_chunk: int = 1024,
                     minmax: bool = False, self_check: bool = True,
                     block_tokens: int | None = DEFAULT_BLOCK_TOKENS, **walk_kw) -> WalkResult:
    """Per-sequence, per-token log-probs and entropy with K/V reuse and no graph (no call
    longer than ``block_tokens``; None or 0: nodes uncut)."""
    validate_for_model(batch, model)
    tree = PrefixTree(batch.input_ids)
    return checked_walker(model, self_check, logits_chunk=logits_chunk, temperature=temperature,
                          block_tokens=block_tokens, **walk_kw).forward(tree, batch, minmax=minmax)


def checked_walker(model, self_check: bool = True, **walker_kw) -> Walker:
    """A :class:`Walker` for ``model``, after the self-check (``dta.selfcheck``: once per model
    object, cached) refused a model the walker would train wrong; ``self_check=False`` skips
    the probe. A PEFT model other than dropout-free LoRA is refused first (``dta.model.lora``)."""
    check_peft_model(model)
    if self_check:
        ensure_self_check(model)
    return Walker(model, **walker_kw)


class DFSTrainer:
    """model + optimizer + loss; ``step(batch)`` is one optimizer update. block_tokens and
    walk_kw: the walker's options (:func:`accumulate_gradients`)."""

    def __init__(self, model, optimizer, loss, *, reduction: str = "token_mean",
                 policy: str = "retain", max_grad_norm: float | None = None,
                 block_tokens: int | None = DEFAULT_BLOCK_TOKENS, **walk_kw):
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.reduction, self.policy, self.max_grad_norm = reduction, policy, max_grad_norm
        self.walk_kw = {"block_tokens": block_tokens, **walk_kw}

    def step(self, batch: Batch, progress=None) -> StepResult:
        """One update. A batch with no trained token (every loss-mask flag 0) changes
        nothing — no gradient, no optimizer step (AdamW would still decay the weights and
        move its moments) — warns, and returns ``updated=False``."""
        validate_for_model(batch, self.model, self.loss)  # before any gradient is touched
        if batch.trained_tokens() == 0:
            warn_no_trained_token(len(batch))
            tree = PrefixTree(batch.input_ids)
            return StepResult(0.0, None, tree.stats(), grad_norm=0.0, updated=False)
        self.optimizer.zero_grad(set_to_none=True)
        result = accumulate_gradients(self.model, batch, self.loss, reduction=self.reduction,
                                      policy=self.policy, progress=progress, **self.walk_kw)
        result.grad_norm, result.updated = clip_and_step(self.model, self.optimizer,
                                                         self.max_grad_norm)
        return result


def warn_no_trained_token(sequences: int, step: int | None = None) -> None:
    where = f"step {step}: " if step is not None else ""
    warnings.warn(f"{where}the batch ({sequences} sequences) has no trained token (every "
                  "loss_mask flag is 0): the optimizer was not stepped, nothing changed",
                  NoTrainedTokenWarning, stacklevel=3)


def clip_and_step(model, optimizer, max_grad_norm: float | None) -> tuple[float, bool]:
    """Clip (if asked), and step only on a finite gradient norm; returns (norm, updated)."""
    params = [p for p in model.parameters() if p.grad is not None]
    limit = max_grad_norm if max_grad_norm else float("inf")
    norm = float(torch.nn.utils.clip_grad_norm_(params, limit)) if params else 0.0
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm, False
    optimizer.step()
    return norm, True

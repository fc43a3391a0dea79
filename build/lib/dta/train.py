"""One training step by DFS: validate, build the tree, walk, clip, step.

:func:`walk_batch` is the heart every step shares: one prefix tree per batch, the forward
walk where the loss needs it (an opaque per-sequence loss, or no training), the loss, its
linearization and the training walk, and what they report (per-sequence log-probs, the
loss, the tree's stats, the tokens forwarded, the context-parallel bytes sent).
``accumulate_gradients`` is the piece a distributed runtime needs (it reduces ``.grad``
between it and the optimizer step); ``DFSTrainer`` is the single-process loop; an engine
core walks a host framework's loss (AReaL's, verl's) through :func:`walk_batch` too.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from dta.batch import Batch
from dta.losses import SequenceLoss, TokenLoss, Totals
from dta.model.routing import MoERouters, check_routing
from dta.objective import Objective, evaluate, linearize
from dta.options import WalkOptions
from dta.selfcheck import ensure_self_check
from dta.tree import PrefixTree, TreeStats
from dta.walk import Walker, WalkResult


class NoTrainedTokenWarning(UserWarning):
    """A batch without any trained token: the optimizer was not stepped."""


@dataclass
class StepResult:
    loss: float
    walk: WalkResult | None  # the training walk, or the forward-only one; None: nothing walked
    tree: TreeStats
    grad_norm: float | None = None
    updated: bool | None = None
    # per sequence, token-aligned (index j: the prediction of token j; 0 at j = 0): what the
    # forward walk recorded (None where no forward walk ran: a token loss trained directly)
    logprobs: list | None = None
    entropy: list | None = None
    vocab_min: list | None = None  # the logits' min / max over the vocabulary (``minmax``)
    vocab_max: list | None = None
    forwarded_tokens: int = 0  # every walk's tokens: forward, training, recomputed at pops
    sent_bytes: int = 0  # what the context-parallel exchange sent (0 without one)


def validate_for_model(batch: Batch, model, loss=None, *, aux_loss: bool = False) -> None:
    """The batch fits the model (vocabulary, positions, the loss's fields, replayed routing;
    with the router aux loss every token's routing): raises before anything is touched."""
    cfg = model.config
    batch.validate(vocab_size=cfg.vocab_size,
                   max_positions=getattr(cfg, "max_position_embeddings", None),
                   required=loss.fields if loss is not None else ())
    check_routing(batch, MoERouters(model), aux_loss=aux_loss)  # fits the model's MoE layers


def accumulate_gradients(model, batch: Batch, loss: TokenLoss | SequenceLoss, *,
                         reduction: str = "token_mean", totals: Totals | None = None,
                         options: WalkOptions | None = None, record: bool = False,
                         progress=None, self_check: bool = True, **settings) -> StepResult:
    """Add the batch's loss gradient into the parameters' ``.grad`` by one DFS walk.

    options: the walk's settings (:class:`dta.options.WalkOptions`), passed to the walker
    unchanged; or give them as keywords (``policy="recompute"``, ``block_tokens=...``: the
    WalkOptions fields), which build it (beside ``options``: replace its fields).
    totals: normalizers of the mean reductions over the whole global batch, when this call
    sees only part of it (a data-parallel worker); default: this batch's own.
    self_check: probe the model once (cached) and refuse one the walker would train wrong.
    """
    options = WalkOptions.given(options, settings)
    validate_for_model(batch, model, loss, aux_loss=options.router_aux_coef > 0)
    return _accumulate(model, batch, loss, reduction, totals, options, record, progress,
                       self_check)


def _accumulate(model, batch, loss, reduction, totals, options, record, progress,
                self_check) -> StepResult:
    """:func:`accumulate_gradients` on a batch already validated for the model."""
    return walk_batch(checked_walker(model, options, self_check), batch, loss, train=True,
                      reduction=reduction, totals=totals, record=record, progress=progress)


def walk_batch(walker: Walker, batch: Batch, loss: TokenLoss | SequenceLoss | None = None, *,
               train: bool, reduction: str = "token_mean", totals: Totals | None = None,
               minmax: bool = False, record: bool = False, progress=None,
               counted: list[int] | None = None) -> StepResult:
    """One batch, one prefix tree, every walk it needs: the one step of every front door.

    - ``train`` with a token loss: the training walk (``record``: its log-probs too);
    - ``train`` with a :class:`~dta.losses.SequenceLoss` (an opaque per-sequence loss, e.g. a
      host framework's): a forward-only walk, the loss once per sequence on its log-probs,
      linearized (``dta.objective.linearize``: the same gradient), then the training walk;
    - not ``train``: the forward-only walk (no graph), and the loss's value if one is given.

    ``loss`` None: log-probs only. ``minmax``: the forward walk also records each position's
    logit min / max over the vocabulary, handed to a sequence loss beside its fields
    (``vocab_min`` / ``vocab_max``). The batch must be validated for the model (the caller's
    :func:`validate_for_model`). ``counted``: per sequence, how many leading tokens the tree
    stats count (default all: a host's wrap label appended for the walk is not its token).
    The gradient is accumulated into ``.grad`` (not cleared first)."""
    from dta.model.context_parallel import context_parallel_of

    if train and loss is None:
        raise ValueError("walk_batch(train=True) needs a loss")
    cp = context_parallel_of(walker.model)
    sent = cp.sent_bytes if cp is not None else 0
    tree = PrefixTree(batch.input_ids, min_shared=walker.options.min_shared)
    out = StepResult(0.0, None, tree.stats(counted))
    if train and not isinstance(loss, SequenceLoss):
        res = walker.train(tree, Objective(batch, loss, reduction, totals), record=record,
                           progress=progress)
        out.loss, out.logprobs, out.entropy = res.loss, res.logprobs, res.entropy
    else:
        res = fwd = walker.forward(tree, batch, minmax=minmax,
                                   progress=None if train else progress)
        out.logprobs, out.entropy = fwd.logprobs, fwd.entropy
        out.vocab_min, out.vocab_max = fwd.vocab_min, fwd.vocab_max
        out.forwarded_tokens += fwd.tokens
        outputs = {"vocab_min": fwd.vocab_min, "vocab_max": fwd.vocab_max} if minmax else None
        if train:
            with torch.enable_grad():
                objective, value = linearize(batch, loss, reduction, fwd.logprobs,
                                             fwd.entropy, totals, outputs=outputs)
                res = walker.train(tree, objective, record=record, progress=progress)
            out.loss = value + res.aux_loss  # the opaque loss and the router aux (docs/moe.md)
        elif loss is not None:
            with torch.no_grad():
                out.loss = evaluate(batch, loss, reduction, fwd.logprobs, fwd.entropy, totals,
                                    outputs=outputs)
    out.walk = res
    if train:
        out.forwarded_tokens += res.tokens + res.recomputed_tokens
    out.sent_bytes = cp.sent_bytes - sent if cp is not None else 0
    return out


def forward_logprobs(model, batch: Batch, *, minmax: bool = False, self_check: bool = True,
                     options: WalkOptions | None = None, **settings) -> WalkResult:
    """Per-sequence, per-token log-probs and entropy with K/V reuse and no graph (no call
    longer than ``block_tokens``). options / settings: as :func:`accumulate_gradients`'s."""
    options = WalkOptions.given(options, settings)
    validate_for_model(batch, model)
    return walk_batch(checked_walker(model, options, self_check), batch, train=False,
                      minmax=minmax).walk


def checked_walker(model, options: WalkOptions | None = None, self_check: bool = True,
                   **settings) -> Walker:
    """A :class:`Walker` for ``model`` (which refuses a PEFT model other than dropout-free
    LoRA, ``dta.model.lora``), after the self-check (``dta.selfcheck``: once per model
    object, cached) refused a model the walker would train wrong; ``self_check=False`` skips
    the probe."""
    walker = Walker(model, options, **settings)
    if self_check:
        ensure_self_check(model)
    return walker


class DFSTrainer:
    """model + optimizer + loss; ``step(batch)`` is one optimizer update. options / settings:
    the walk's (:func:`accumulate_gradients`), built once here and passed unchanged."""

    def __init__(self, model, optimizer, loss, *, reduction: str = "token_mean",
                 max_grad_norm: float | None = None, options: WalkOptions | None = None,
                 **settings):
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.reduction, self.max_grad_norm = reduction, max_grad_norm
        self.options = WalkOptions.given(options, settings)

    def step(self, batch: Batch, progress=None) -> StepResult:
        """One update. A batch with no trained token (every loss-mask flag 0) changes
        nothing — no gradient, no optimizer step (AdamW would still decay the weights and
        move its moments) — warns, and returns ``updated=False``."""
        validate_for_model(batch, self.model, self.loss,  # before any gradient is touched
                           aux_loss=self.options.router_aux_coef > 0)
        if batch.trained_tokens() == 0:
            warn_no_trained_token(len(batch))
            tree = PrefixTree(batch.input_ids, min_shared=self.options.min_shared)
            return StepResult(0.0, None, tree.stats(), grad_norm=0.0, updated=False)
        self.optimizer.zero_grad(set_to_none=True)
        result = _accumulate(self.model, batch, self.loss, self.reduction, None, self.options,
                             False, progress, True)
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

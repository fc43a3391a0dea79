"""Losses, defined per original occurrence of a target token.

A *token loss* maps the log-prob (and entropy) of each occurrence plus that occurrence's own
fields (advantage, behaviour log-prob, ...) to one value per occurrence; the reduction then
weights the occurrences. A *sequence loss* is an opaque function of a whole sequence's
log-probs, entropies and fields, as AReaL's actors use. Both give gradients identical to
training every sequence separately; the walker never needs to know which formula it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

REDUCTIONS = ("token_mean", "seq_mean", "sum")
# How the per-token loss terms of a batch are combined (w_i: the record's ``weight``):
#   token_mean  sum over trained tokens of w_i * term / (trained tokens in the batch)
#   seq_mean    sum over sequences with >= 1 trained token of w_i * (mean of its terms),
#               divided by the number of such sequences; a sequence with no trained token
#               neither adds a term nor counts in the normalizer
#   sum         sum over trained tokens of w_i * term
# "Trained token": loss_mask 1, token 0 excluded (nothing predicts it). Over several
# data-parallel workers the normalizers are the whole batch's (``Totals``).


class TokenLoss:
    """Per-occurrence loss: ``values(logp, entropy, fields) -> [K]`` for K occurrences."""

    fields: tuple[str, ...] = ()
    uses_entropy: bool = False

    def values(self, logp: torch.Tensor, entropy: torch.Tensor | None,
               fields: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


class NLL(TokenLoss):
    """Token negative log-likelihood (SFT)."""

    def values(self, logp, entropy, fields):
        return -logp


@dataclass
class PPO(TokenLoss):
    """Clipped surrogate (PPO/GRPO) with per-token advantages and behaviour log-probs.

    decoupled: ratio against the proximal policy ``prox_logprobs`` and the whole term
        weighted by the behaviour importance weight exp(prox - old), optionally capped
        (tokens above the cap are dropped, as AReaL does).
    dual_clip: c > 1 caps the loss of negative-advantage tokens at -c * advantage.
    """

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    decoupled: bool = False
    behav_imp_weight_cap: float | None = None
    entropy_coef: float = 0.0

    def __post_init__(self):
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        self.fields = ("advantages", "old_logprobs") + (("prox_logprobs",) if self.decoupled else ())
        self.uses_entropy = self.entropy_coef != 0.0

    def values(self, logp, entropy, fields):
        adv, old = fields["advantages"], fields["old_logprobs"]
        prox = fields["prox_logprobs"] if self.decoupled else old
        ratio = torch.exp(logp - prox)
        high = self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - self.eps_clip, 1 + high))
        if self.dual_clip is not None:
            loss = torch.where(adv < 0, torch.minimum(loss, -self.dual_clip * adv), loss)
        if self.decoupled:
            behav = torch.exp(prox - old)
            if self.behav_imp_weight_cap is not None:
                behav = torch.where(behav <= self.behav_imp_weight_cap, behav, torch.zeros_like(behav))
            loss = loss * behav
        if self.uses_entropy:
            loss = loss - self.entropy_coef * entropy
        return loss


@dataclass
class SequenceLoss:
    """Opaque per-sequence loss ``fn(logprobs, entropy, fields) -> scalar``.

    ``logprobs``/``entropy`` are 1-D tensors of the sequence's length, aligned with its tokens
    (index j: the prediction of token j; index 0 holds 0). ``fields`` holds the sequence's
    per-token fields as tensors. The reduction weighs the sequences: ``sum`` 1 each,
    ``seq_mean`` 1/N, ``token_mean`` (trainable tokens of the sequence) / (all trainable).
    """

    fn: Callable[..., torch.Tensor]
    fields: tuple[str, ...] = ()
    uses_entropy: bool = True


LOSSES: dict[str, Callable[..., TokenLoss]] = {"nll": NLL, "ppo": PPO}


def make_loss(name: str, **kw) -> TokenLoss:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name](**kw)


@dataclass(frozen=True)
class Totals:
    """Normalizers of mean reductions over the *whole* batch (all workers)."""

    trainable_tokens: float  # sum of loss-mask weights
    trainable_sequences: int  # sequences with at least one trainable token


def batch_totals(batch) -> Totals:
    masks = [batch.loss_mask(i) for i in range(len(batch))]
    return Totals(float(sum(m.sum() for m in masks)), int(sum(bool(m.any()) for m in masks)))


def token_weights(batch, reduction: str, totals: Totals | None = None) -> list[np.ndarray]:
    """Per sequence, per target token: the weight of its loss term (0 where not trained)."""
    seq_w = sequence_weights(batch, reduction, totals)
    out = []
    for i in range(len(batch)):
        mask = batch.loss_mask(i)
        if reduction == "sum":
            out.append(mask * seq_w[i])
        else:  # a mean: the sequence's weight spread over its trainable tokens
            out.append(mask * (seq_w[i] / mask.sum()) if mask.any() else mask * 0.0)
    return out


def sequence_weights(batch, reduction: str, totals: Totals | None = None) -> np.ndarray:
    """Per sequence: the weight of its (summed-over-tokens or opaque) loss. ``seq_mean``
    divides by the sequences with at least one trained token (``Totals.trainable_sequences``),
    not by all sequences: a sequence with nothing to train does not dilute the others."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {REDUCTIONS}")
    totals = totals or batch_totals(batch)
    mask_sums = np.array([batch.loss_mask(i).sum() for i in range(len(batch))])
    user = np.ones(len(batch)) if batch.weight is None else np.asarray(batch.weight, float)
    if reduction == "sum":
        w = np.ones(len(batch))
    elif reduction == "seq_mean":
        w = (mask_sums > 0) / max(totals.trainable_sequences, 1)
    else:  # token_mean: a sequence's share of all trainable tokens
        w = mask_sums / max(totals.trainable_tokens, 1e-300)
    return w * user

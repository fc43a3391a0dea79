"""Unpacked reference training: one sequence at a time, the model's own full forward.

This is what DFS must equal. It shares nothing with the walker but the loss formulas: the
logits come from ``model(input_ids).logits`` over the whole sequence, no cache, no tree.
MoE: a sequence's ``routed_experts`` are forced in its forward (the replay is the model
fact of ``dta/model/routing.py``), and with ``router_aux_loss_coef > 0`` the sequence's own
load-balancing loss (:func:`sequence_aux_loss`, Hugging Face's formula over that sequence's
router logits of every MoE layer) is added, times the coefficient and the sequence's weight,
and differentiated by autograd.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dta.batch import Batch
from dta.losses import SequenceLoss, TokenLoss, Totals, sequence_weights
from dta.model.routing import MoERouters
from dta.objective import Objective, opaque_sequence_weights


def sequence_aux_loss(routed, num_experts: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` for one sequence (no padding): the MoE layers' router
    logits concatenated into [layers · n, E] rows; f = the mean over rows of the experts each
    row used (one-hot, summed over k), P = the mean over rows of softmax(logits);
    E · Σ_e f_e P_e."""
    layers = sorted(routed.logits)
    logits = torch.cat([routed.logits[layer] for layer in layers])
    experts = torch.cat([routed.experts[layer] for layer in layers])
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(logits.to(dtype), dim=-1)
    f = torch.nn.functional.one_hot(experts, num_experts).sum(1).to(dtype).mean(0)
    return num_experts * (f * probs.mean(0)).sum()


@dataclass
class ReferenceResult:
    loss: float
    logprobs: list  # per sequence [n]; index j predicts token j, 0 at j = 0
    entropy: list


def sequence_logprobs(model, ids: np.ndarray, temperature: float = 1.0):
    """Per-token log-probs and entropies of one whole sequence, with graph."""
    device = next(model.parameters()).device
    x = torch.as_tensor(ids, device=device).unsqueeze(0)
    logits = model(input_ids=x).logits[0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = logits / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    zero = logits.new_zeros(1)
    logp = torch.cat([zero, logsm[:-1].gather(-1, x[0, 1:, None])[:, 0]])
    ent = torch.cat([zero, -(logsm.exp() * logsm).sum(-1)[:-1]])
    return logp, ent


def unpacked_gradients(model, batch: Batch, loss: TokenLoss | SequenceLoss, *,
                       reduction: str = "token_mean", totals: Totals | None = None,
                       temperature: float = 1.0, backward: bool = True,
                       router_aux_loss_coef: float = 0.0, progress=None) -> ReferenceResult:
    """Accumulate the batch's gradient into ``.grad``, one sequence per forward/backward."""
    if isinstance(loss, SequenceLoss):
        coef = sequence_weights(batch, reduction, totals)
        omegas = opaque_sequence_weights(batch, reduction, totals)  # the aux loss's weights
        objective = None
    else:
        objective = Objective(batch, loss, reduction, totals)
        omegas = objective.sequence_weights
    moe = MoERouters(model)
    device = next(model.parameters()).device
    total, lps, ents = 0.0, [], []
    for i, ids in enumerate(batch.input_ids):
        forced = None if batch.routed_experts is None else \
            torch.as_tensor(batch.routed_experts[i], device=device)
        with torch.set_grad_enabled(backward), moe.scope(), \
                moe.call(forced, capture=router_aux_loss_coef > 0) as routed:
            logp, ent = sequence_logprobs(model, ids, temperature)
            if objective is not None:
                value = objective.sequence_loss(i, logp, ent)
            else:
                fields = {k: torch.as_tensor(batch.fields[k][i], dtype=logp.dtype, device=logp.device)
                          for k in loss.fields}
                value = loss.fn(logp, ent, fields) * float(coef[i])
            omega = float(omegas[i])
            if router_aux_loss_coef > 0 and omega != 0:
                value = value + router_aux_loss_coef * omega * \
                    sequence_aux_loss(routed, moe.num_experts).to(value.dtype)
        if backward and value.requires_grad:
            value.backward()
        total += float(value.detach())
        lps.append(logp.detach())
        ents.append(ent.detach())
        if progress is not None:
            progress(len(ids))
    return ReferenceResult(total, lps, ents)

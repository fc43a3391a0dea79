"""Unpacked reference training: one sequence at a time, the model's own full forward.

This is what DFS must equal. It shares nothing with the walker but the loss formulas: the
logits come from ``model(input_ids).logits`` over the whole sequence, no cache, no tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dta.batch import Batch
from dta.losses import SequenceLoss, TokenLoss, Totals, sequence_weights
from dta.objective import Objective


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
                       progress=None) -> ReferenceResult:
    """Accumulate the batch's gradient into ``.grad``, one sequence per forward/backward."""
    if isinstance(loss, SequenceLoss):
        coef = sequence_weights(batch, reduction, totals)
        objective = None
    else:
        objective = Objective(batch, loss, reduction, totals)
    total, lps, ents = 0.0, [], []
    for i, ids in enumerate(batch.input_ids):
        with torch.set_grad_enabled(backward):
            logp, ent = sequence_logprobs(model, ids, temperature)
            if objective is not None:
                value = objective.sequence_loss(i, logp, ent)
            else:
                fields = {k: torch.as_tensor(batch.fields[k][i], dtype=logp.dtype, device=logp.device)
                          for k in loss.fields}
                value = loss.fn(logp, ent, fields) * float(coef[i])
        if backward and value.requires_grad:
            value.backward()
        total += float(value.detach())
        lps.append(logp.detach())
        ents.append(ent.detach())
        if progress is not None:
            progress(len(ids))
    return ReferenceResult(total, lps, ents)

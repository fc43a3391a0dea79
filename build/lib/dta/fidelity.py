"""Low-precision fidelity: DFS in bf16 against per-sequence training in bf16, both measured
against the float64 truth (``dta verify --dtype bfloat16 --against float64``).

Exactness (``dta.verify``) compares DFS with per-sequence training *in one dtype*; in bf16 both
round, differently, and neither is the truth. The question users ask is whether tree training
in bf16 is as accurate as standard training in bf16. So three copies of one set of weights
train one batch: per-sequence training in float64 (the truth: the bf16 weights cast up, so only
the computation's rounding is measured, never the weights'), per-sequence training in the low
dtype (what standard training computes) and DFS in the low dtype. Each low side's error against
the truth, per quantity:

  rel_l2   ||x - t|| / ||t||          over every value at once (all positions of all sequences;
                                      all gradient tensors together)
  max      max |x - t| / max |t|      the worst single value, scaled by the largest truth
  loss     |x - t| / |t|

for the log-probs (a forward-only pass over every position: the walk's forward against each
sequence's own forward), the loss and the gradients -- and ``ratio`` = DFS error / per-sequence
error. A ratio near 1 says DFS rounds like standard training; DFS's tolerance claim for bf16
is a ratio <= 1.5 on log-probs and gradients (docs/gpu.md).
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch

from dta.batch import Batch
from dta.losses import SequenceLoss, TokenLoss
from dta.model.models import make_truly_float64
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients, forward_logprobs, validate_for_model

QUANTITIES = ("logprobs", "loss", "grad")
CLAIM = 1.5  # DFS's low-precision error may be at most this times per-sequence training's


@dataclass
class Errors:
    """One low-precision side's errors against the truth (module doc)."""

    logprobs_rel_l2: float
    logprobs_max: float
    loss_rel: float
    grad_rel_l2: float
    grad_max: float


@dataclass
class FidelityReport:
    dtype: str
    against: str
    sequences: int
    tokens: int
    parameters: int
    dfs: Errors
    per_sequence: Errors
    ratio: dict = field(default_factory=dict)  # dfs / per_sequence, per error
    loss_truth: float = 0.0

    def worst_ratio(self, keys=("logprobs_rel_l2", "grad_rel_l2")) -> float:
        vals = [self.ratio[k] for k in keys]
        return math.nan if any(math.isnan(v) for v in vals) else max(vals)

    def passed(self, claim: float = CLAIM) -> bool:
        """DFS's log-prob and gradient errors (relative L2) at most ``claim`` x per-sequence
        training's; NaN/inf anywhere fails."""
        r = self.worst_ratio()
        return math.isfinite(r) and r <= claim

    def as_dict(self) -> dict:
        return {**asdict(self), "worst_ratio": self.worst_ratio(), "claim": CLAIM}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def _errs(x: torch.Tensor, t: torch.Tensor) -> tuple[float, float]:
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(t).all())):
        return math.nan, math.nan
    d = (x - t).abs()
    return float(d.norm() / t.norm().clamp_min(1e-300)), float(d.max() / t.abs().max().clamp_min(1e-300))


def _grads(model) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _side(logprobs, loss: float, grads, truth) -> Errors:
    lp = _errs(_flat(logprobs), truth["logprobs"])
    g = _errs(_flat(grads), truth["grads"])
    loss_rel = abs(loss - truth["loss"]) / max(abs(truth["loss"]), 1e-300) \
        if math.isfinite(loss) else math.nan
    return Errors(lp[0], lp[1], loss_rel, g[0], g[1])


def fidelity(model, batch: Batch, loss: TokenLoss | SequenceLoss, *,
             dtype: torch.dtype = torch.bfloat16, against: torch.dtype = torch.float64,
             reduction: str = "token_mean", options=None, **settings) -> FidelityReport:
    """Train ``batch`` three ways from ``model``'s weights rounded to ``dtype`` (module doc);
    the model itself is not changed. options / settings: the DFS side's walk settings
    (:class:`dta.options.WalkOptions`, or its fields as keywords)."""
    validate_for_model(batch, model, loss)
    base = copy.deepcopy(model).to(dtype)
    truth_model = copy.deepcopy(base).to(against)
    if against == torch.float64:
        for m in truth_model.modules():  # torch's grouped_mm (MoE experts) has no float64 kernel
            cfg = getattr(m, "config", None)
            if getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
                cfg._experts_implementation = "eager"
        make_truly_float64(truth_model)
    ref_model, dfs_model = base, copy.deepcopy(base)
    for m in (truth_model, ref_model, dfs_model):
        m.zero_grad(set_to_none=True)
    t = unpacked_gradients(truth_model, batch, loss, reduction=reduction)
    truth = dict(logprobs=_flat(t.logprobs), loss=float(t.loss), grads=_flat(_grads(truth_model)))
    del truth_model
    r = unpacked_gradients(ref_model, batch, loss, reduction=reduction)
    per_seq = _side(r.logprobs, float(r.loss), _grads(ref_model), truth)
    d = accumulate_gradients(dfs_model, batch, loss, reduction=reduction, options=options,
                             **settings)
    fwd = forward_logprobs(dfs_model, batch, options=options, **settings)
    dfs = _side(fwd.logprobs, float(d.loss), _grads(dfs_model), truth)
    ratio = {}
    for k in asdict(dfs):
        a, b = getattr(dfs, k), getattr(per_seq, k)
        ratio[k] = math.nan if math.isnan(a) or math.isnan(b) else (a / b if b > 0 else
                                                                    (1.0 if a == 0 else math.inf))
    return FidelityReport(dtype=str(dtype).replace("torch.", ""),
                          against=str(against).replace("torch.", ""),
                          sequences=len(batch.input_ids),
                          tokens=int(sum(len(s) for s in batch.input_ids)),
                          parameters=sum(p.numel() for p in model.parameters()), dfs=dfs,
                          per_sequence=per_seq, ratio=ratio, loss_truth=truth["loss"])

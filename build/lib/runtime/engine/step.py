"""The step after the walk: reduce the gradients, clip, then step or skip.

:func:`reduce_gradients` is the project's one gradient reduction: the sharding mode's SUM
over the world (all-reduce, reduce-scatter; fsdp's layers were reduce-scattered inside the
backward). Every rank's gradient is its share of the global batch's
loss (the walk normalizes by the whole batch's totals; a context-parallel rank's is its rows'
and heads' part), so the SUM is the gradient.

:func:`optimizer_step` adds the one clip rule (``torch.nn.utils.clip_grad_norm_``'s factor
``min(max / (norm + 1e-6), 1)`` by the global norm; no clipping for ``None`` / 0) and the one
non-finite rule (the gradients are discarded, nothing is updated, the norm is returned).
"""
from __future__ import annotations

import math

from runtime.sharding.common import clip_coefficient

__all__ = ["reduce_gradients", "optimizer_step"]


def reduce_gradients(mode) -> None:
    """The mode's SUM over the world."""
    mode.reduce_gradients()


def optimizer_step(mode, max_grad_norm) -> tuple[float, bool]:
    """Reduce, clip by the global norm, step; returns ``(norm before clipping, updated)``.
    Every rank calls it (collectives inside)."""
    reduce_gradients(mode)
    norm = mode.grad_norm()
    if not math.isfinite(norm):
        mode.discard_gradients()
        return norm, False
    coef = clip_coefficient(norm, max_grad_norm)
    if coef != 1.0:
        mode.scale_gradients(coef)
    mode.apply_update()
    return norm, True

"""GRPO advantages from per-sequence rewards, as AReaL computes them.

AReaL (``PPOActor.compute_advantages`` with no critic, no KL, ``discount = gae_lambda = 1``)
gives every trained token of a sequence the sequence's processed reward
``clip((reward + reward_bias) * reward_scaling, ±reward_clip)`` and then normalizes these
token-level advantages with ``adv_norm`` (``areal.utils.data.Normalization``):

* ``mean_level``: ``batch`` (all trained tokens), ``group`` (the trained tokens of the
  sequence's group) or None (no centering);
* ``std_level``: the same levels for the (unbiased, as AReaL's default ``std_unbiased``)
  standard deviation; the result is ``(a - mean) / (std + eps)`` (no ``eps`` without std).

Statistics are over trained tokens (loss-mask weighted), exactly as AReaL's masked
normalization, so a long answer weighs more than a short one. Groups come from the records'
``group_id``; records without one are grouped in consecutive blocks of ``group_size``, as
AReaL's fixed-size groups. Untrained tokens get advantage 0 (no loss term reads them).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["process_rewards", "grpo_advantages"]


def process_rewards(rewards, *, scaling: float = 1.0, bias: float = 0.0,
                    clip: float = 20.0) -> np.ndarray:
    r = (np.asarray(rewards, dtype=np.float64) + bias) * scaling
    return np.clip(r, -clip, clip)


def _groups(n: int, group_ids: Sequence | None, group_size: int) -> list[np.ndarray]:
    if group_ids is not None and all(g is not None for g in group_ids):
        order: dict = {}
        for i, g in enumerate(group_ids):
            order.setdefault(g, []).append(i)
        return [np.array(v) for v in order.values()]
    if group_ids is not None and any(g is not None for g in group_ids):
        i = next(k for k, g in enumerate(group_ids) if g is None)
        raise ValueError(f"sequence {i} has no group_id while others have one")
    if n % group_size:
        raise ValueError(f"{n} sequences do not split into groups of group_size {group_size} "
                         "(and the records carry no group_id)")
    return [np.arange(s, s + group_size) for s in range(0, n, group_size)]


def _mean(values: np.ndarray, weights: np.ndarray) -> float:
    """Mean of per-sequence values, each repeated ``weights`` (trained tokens) times."""
    count = float(weights.sum())
    return float((values * weights).sum() / count) if count else 0.0


def _std(values: np.ndarray, weights: np.ndarray, mean: np.ndarray) -> float:
    """Unbiased std of the same, around the (per-sequence) mean that is subtracted."""
    count = float(weights.sum())
    if count <= 1:
        return 1.0
    return float(np.sqrt(((values - mean) ** 2 * weights).sum() / (count - 1)))


def grpo_advantages(rewards, loss_masks: Sequence[np.ndarray], *, group_ids=None,
                    mean_level: str | None = "group", std_level: str | None = "group",
                    group_size: int = 1, eps: float = 1e-5, scaling: float = 1.0,
                    bias: float = 0.0, clip: float = 20.0) -> list[np.ndarray]:
    """Per sequence, per token: the advantage (0 where the loss mask is 0)."""
    r = process_rewards(rewards, scaling=scaling, bias=bias, clip=clip)
    masks = [np.asarray(m, dtype=np.float64) for m in loss_masks]
    if len(masks) != len(r):
        raise ValueError(f"{len(r)} rewards for {len(masks)} sequences")
    counts = np.array([m.sum() for m in masks])
    groups = _groups(len(r), group_ids, group_size) if "group" in (mean_level, std_level) else []
    mean = np.zeros(len(r))
    if mean_level == "batch":
        mean[:] = _mean(r, counts)
    elif mean_level == "group":
        for g in groups:
            mean[g] = _mean(r[g], counts[g])
    std = np.ones(len(r))
    use_eps = eps
    if std_level == "batch":
        std[:] = _std(r, counts, mean)
    elif std_level == "group":
        for g in groups:
            std[g] = _std(r[g], counts[g], mean[g])
    else:
        use_eps = 0.0
    if not counts.sum():
        return [m * 0.0 for m in masks]
    return [m * ((r[i] - mean[i]) / (std[i] + use_eps)) for i, m in enumerate(masks)]

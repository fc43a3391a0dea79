"""Attention over a cached prefix, split at the cache boundary (CPU).

A forward over cached K/V (a pack over its root path) has a mask ``[T, past + T]`` whose
first ``past`` columns -- the cached keys -- are visible to every query, and whose last
``T`` columns are the pack's own tree mask (causal when the pack is one path). One dense
masked call of SDPA's CPU flash kernel reads that mask for every key of every head and
computes the masked-away pairs too. Instead, the two parts are attended separately and
merged by their log-sum-exps (the same softmax over the union of keys):

    o₁, ℓ₁ = attn(q, K[:past])            no mask; grouped-query heads folded into the rows
    o₂, ℓ₂ = attn(q, K[past:], mask₂)     causal (no mask) when mask₂ is lower-triangular
    ℓ = log(e^ℓ₁ + e^ℓ₂),   o = e^(ℓ₁−ℓ) o₁ + e^(ℓ₂−ℓ) o₂

and the backward runs the flash backward of each part with the *merged* ``o`` and ``ℓ``
(P = exp(s − ℓ) and D = rowsum(dO ∘ O) are those of the whole row), so dq = dq₁ + dq₂ and
dK = [dK₁; dK₂] exactly. Folding: head h reads K/V head h // G, so the rows of q's G heads
that share a K/V head are stacked into one query block of G·T rows (no K/V copy; the prefix
part has no mask to repeat).

:func:`split_of` decides from the mask alone (once per forward, cached by the caller):
split when every cached column is visible to every row and every row sees its own key (so
no part has an empty row). Anything else -- sliding windows over the prefix, padding, other
dtypes or devices -- keeps the single masked call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten
DTYPES = (torch.float32, torch.float64)


@dataclass
class Split:
    past: int  # cached keys, visible to every row
    inner: torch.Tensor | None  # additive [1, 1, T, T] mask of the pack's own keys; None: causal


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = visible) as SDPA converts it: 0 where visible, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def split_of(mask: torch.Tensor, dtype: torch.dtype) -> Split | None:
    """The split of a boolean ``[1, 1, T, S]`` mask (True = visible), or None."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1 or dtype not in DTYPES:
        return None
    T, S = mask.shape[-2:]
    past = S - T
    if past <= 0 or T < 1:
        return None
    m = mask[0, 0]
    own = m[:, past:]
    if not bool(m[:, :past].all()) or not bool(own.diagonal().all()):
        return None
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril_()
    if torch.equal(own, causal):
        return Split(past, None)
    return Split(past, additive_mask(own, dtype)[None, None])


def _fold(x: torch.Tensor, kv: int) -> torch.Tensor:
    """[B, H, T, ...] -> [B, KV, G·T, ...]: the G query heads of each K/V head as one block."""
    B, H, T = x.shape[:3]
    return x.reshape(B, kv, (H // kv) * T, *x.shape[3:])


class SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, past: int, inner, scale, k_pieces=None, v_pieces=None):
        B, H, T, D = q.shape
        kv = k.shape[1]
        o1, l1 = aten._scaled_dot_product_flash_attention_for_cpu(
            _fold(q, kv), k[:, :, :past], v[:, :, :past], scale=scale)[:2]
        o1, l1 = o1.reshape(B, H, T, D), l1.reshape(B, H, T)
        o2, l2 = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k[:, :, past:], v[:, :, past:], is_causal=inner is None, attn_mask=inner, scale=scale)[:2]
        lse = torch.logaddexp(l1, l2)
        out = o1.mul_((l1 - lse).exp_().unsqueeze(-1)).add_(o2.mul_((l2 - lse).exp_().unsqueeze(-1)))
        if k_pieces is None or v_pieces is None:
            k_pieces, v_pieces = (k,), (v,)
        ctx.save_for_backward(q, out, lse, inner, *k_pieces, *v_pieces)
        ctx.past, ctx.scale, ctx.pieces = past, scale, len(k_pieces)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, inner, *kv_pieces = ctx.saved_tensors
        past, scale, n = ctx.past, ctx.scale, ctx.pieces
        k, v = _joined(kv_pieces[:n]), _joined(kv_pieces[n:])  # the path's K/V, again
        kv = k.shape[1]
        dout = dout.contiguous()
        dq1, dk1, dv1 = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _fold(dout, kv), _fold(q, kv), k[:, :, :past], v[:, :, :past], _fold(out, kv),
            _fold(lse, kv), 0.0, False, scale=scale)
        dq2, dk2, dv2 = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k[:, :, past:], v[:, :, past:], out, lse, 0.0, inner is None,
            attn_mask=inner, scale=scale)
        return (dq2.add_(dq1.reshape(q.shape)), torch.cat([dk1, dk2], dim=2),
                torch.cat([dv1, dv2], dim=2), None, None, None, None, None)


def _joined(pieces) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)


def _pieces_of(joined: torch.Tensor, pieces) -> tuple | None:
    """``pieces`` if they are what ``joined`` was concatenated from (shapes along dim 2)."""
    if not pieces or sum(p.shape[2] for p in pieces) != joined.shape[2] or any(
            p.shape[:2] != joined.shape[:2] or p.shape[3:] != joined.shape[3:] or
            p.dtype != joined.dtype or p.device != joined.device for p in pieces):
        return None
    return tuple(pieces)


def split_attention(query, key, value, split: Split, scale: float | None,
                    key_pieces=None, value_pieces=None) -> torch.Tensor:
    """``softmax(q Kᵀ·scale + mask) V`` for ``split``'s mask, [B, H, T, D]. ``key_pieces`` /
    ``value_pieces``: the tensors ``key`` / ``value`` were concatenated from (along the
    positions); when given, the backward keeps those instead of ``key`` and ``value`` and joins
    them again -- the joined copy of the path's K/V is then freed after the forward."""
    kp, vp = _pieces_of(key, key_pieces), _pieces_of(value, value_pieces)
    if kp is None or vp is None:
        kp = vp = None
    return SplitAttention.apply(query, key, value, split.past, split.inner, scale, kp, vp)

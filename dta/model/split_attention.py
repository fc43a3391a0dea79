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
dK = [dK₁; dK₂] exactly. The same holds for any split of the keys, so the backward runs once
per K/V *piece* the cache joined (each frame's K/V on the path, the pack's own) and returns
each piece its gradient: the path's K/V and dK/dV are never joined in the backward.
Folding: head h reads K/V head h // G, so the rows of q's G heads that share a K/V head are
stacked into one query block of G·T rows (no K/V copy; the prefix part has no mask to
repeat).

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
    """Inputs: ``q`` and the K/V *pieces* -- the tensors the joined K/V were concatenated from
    (the path's frames and the pack's own K/V), or the joined K/V as one piece; ``joined``
    (not an autograd input) is what the forward attends to. The backward runs once per piece
    (split at the cache boundary) and hands each piece its own gradient: no path-long
    K/V or dK/dV is joined again."""

    @staticmethod
    def forward(ctx, q, past: int, inner, scale, tape, joined, n: int, *pieces):
        if tape is not None and tape.recorded:
            out, lse = tape.take(q, past)
        else:
            out, lse = _attend(q, *joined, past, inner, scale)
            if tape is not None:
                tape.keep(out, lse, past)
        ctx.save_for_backward(q, out, lse, inner, *pieces)
        ctx.past, ctx.scale, ctx.n = past, scale, n
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, inner, *pieces = ctx.saved_tensors
        past, scale, n = ctx.past, ctx.scale, ctx.n
        kv = pieces[0].shape[1]
        dout = dout.contiguous()
        folded = _fold(dout, kv), _fold(q, kv), _fold(out, kv), _fold(lse, kv)
        dq, dks, dvs, at = None, [], [], 0
        for k, v in zip(pieces[:n], pieces[n:]):
            end, dk_parts, dv_parts = at + k.shape[2], [], []
            for a, b in ((at, min(end, past)), (max(at, past), end)):
                if a >= b:
                    continue
                ks, vs = k[:, :, a - at:b - at], v[:, :, a - at:b - at]
                if b <= past:  # cached keys: every row sees them; grouped heads folded
                    dqi, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        folded[0], folded[1], ks, vs, folded[2], folded[3], 0.0, False,
                        scale=scale)
                    dqi = dqi.reshape(q.shape)
                else:  # the pack's own keys: causal, or its tree mask
                    dqi, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        dout, q, ks, vs, out, lse, 0.0, inner is None, attn_mask=inner,
                        scale=scale)
                dq = dqi if dq is None else dq.add_(dqi)
                dk_parts.append(dk)
                dv_parts.append(dv)
            dks.append(_joined(dk_parts))
            dvs.append(_joined(dv_parts))
            at = end
        return (dq, None, None, None, None, None, None, *dks, *dvs)


def _attend(q, k, v, past: int, inner, scale):
    """The split forward: ``(out, lse)`` over the cached keys and the pack's own, merged."""
    B, H, T, D = q.shape
    kv = k.shape[1]
    o1, l1 = aten._scaled_dot_product_flash_attention_for_cpu(
        _fold(q, kv), k[:, :, :past], v[:, :, :past], scale=scale)[:2]
    o1, l1 = o1.reshape(B, H, T, D), l1.reshape(B, H, T)
    o2, l2 = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k[:, :, past:], v[:, :, past:], is_causal=inner is None, attn_mask=inner, scale=scale)[:2]
    lse = torch.logaddexp(l1, l2)
    out = o1.mul_((l1 - lse).exp_().unsqueeze(-1)).add_(o2.mul_((l2 - lse).exp_().unsqueeze(-1)))
    return out, lse


class Tape:
    """The split attention's results of one forward -- per call, in call order, its output and
    log-sum-exp -- kept by a pack's forward without grad and taken back by the same pack's
    re-forward with grad (memory policy *recompute*): the re-forward then skips the attention
    over the path, the bulk of a long pack's forward, and its backward reads the very ``out``
    and ``lse`` it would have recomputed (same inputs, same kernels). It costs one [T, H·D]
    output per attention layer per pack on the path, about the pack's own K/V."""

    def __init__(self):
        self._kept: list[tuple[torch.Tensor, torch.Tensor, int] | None] = []
        self._next = 0
        self.recorded = False  # a forward has kept its results (possibly none): replay them

    def keep(self, out: torch.Tensor, lse: torch.Tensor, past: int) -> None:
        self._kept.append((out.detach(), lse.detach(), past))

    def take(self, q: torch.Tensor, past: int):
        if self._next >= len(self._kept):
            raise RuntimeError(f"attention tape: the re-forward makes more split attention calls "
                               f"than the forward ({len(self._kept)})")
        out, lse, kept_past = self._kept[self._next]
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or \
                kept_past != past:
            raise RuntimeError(f"attention tape: call {self._next} of the re-forward has queries "
                               f"{tuple(q.shape)} over {past} cached keys, the forward's output "
                               f"was {tuple(out.shape)} over {kept_past}")
        self._kept[self._next] = None  # the output becomes the re-forward's (autograd's) own
        self._next += 1
        return out, lse

    def finish(self) -> None:
        """The end of a forward: a recording becomes replayable; a replay must have taken
        back every result."""
        if not self.recorded:
            self.recorded = True
            return
        if self._next != len(self._kept):
            raise RuntimeError(f"attention tape: the re-forward made {self._next} split attention "
                               f"calls, the forward {len(self._kept)}")
        self._kept = []


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
                    key_pieces=None, value_pieces=None, tape: Tape | None = None) -> torch.Tensor:
    """``softmax(q Kᵀ·scale + mask) V`` for ``split``'s mask, [B, H, T, D]. ``key_pieces`` /
    ``value_pieces``: the tensors ``key`` / ``value`` were concatenated from (along the
    positions); when given, the backward keeps those instead of ``key`` and ``value`` and
    hands each its own gradient -- the joined copy of the path's K/V is then freed after the
    forward. ``tape``: keep the result (a forward without grad), or take it back (once the
    tape has ``recorded``)."""
    kp, vp = _pieces_of(key, key_pieces), _pieces_of(value, value_pieces)
    if kp is None or vp is None:
        kp, vp = (key,), (value,)
    return SplitAttention.apply(query, split.past, split.inner, scale, tape, (key, value),
                                len(kp), *kp, *vp)

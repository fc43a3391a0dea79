"""Attention over a cached prefix, split at the cache boundary (every device).

A forward over cached K/V (a pack over its root path) has a mask ``[T, past + T]`` whose
first ``past`` columns -- the cached keys -- are visible to every query, and whose last
``T`` columns are the pack's own tree mask (causal when the pack is one path). One dense
masked call reads that mask for every key of every head, computes the masked-away pairs
too, and on a GPU keeps SDPA off its flash kernel. Instead, the two parts are attended
separately and merged by their log-sum-exps (the same softmax over the union of keys):

    o₁, ℓ₁ = attn(q, K[:past])            no mask; grouped-query heads folded into the rows
    o₂, ℓ₂ = attn(q, K[past:], mask₂)     causal when mask₂ is lower-triangular, else the
                                          pack's [T, T] tree mask
    ℓ = log(e^ℓ₁ + e^ℓ₂),   o = e^(ℓ₁−ℓ) o₁ + e^(ℓ₂−ℓ) o₂

and the backward runs the backward of each part with the *merged* ``o`` and ``ℓ``
(P = exp(s − ℓ) and D = rowsum(dO ∘ O) are those of the whole row), so dq = dq₁ + dq₂ and
dK = [dK₁; dK₂] exactly. The same holds for any split of the keys, so the backward runs once
per K/V *piece* the cache joined (each frame's K/V on the path, the pack's own) and returns
each piece its gradient: the path's K/V and dK/dV are never joined in the backward.
Folding: head h reads K/V head h // G, so the rows of q's G heads that share a K/V head are
stacked into one query block of G·T rows (no K/V copy; the prefix part has no mask to
repeat).

The kernels come from one table keyed by (device type, dtype, mask kind)
(:mod:`dta.model.attention_kernels`: SDPA's CPU flash kernel on CPU; torch's CUDA flash /
memory-efficient ops or flash-attn for the unmasked and causal parts on CUDA, FlexAttention
block masks for a tree mask): the split is the same code on every device, and no mask over
the cached keys is ever built. The per-piece functions are public, for context parallelism
(a rank attends its queries to each K/V piece it receives and merges, then runs each piece's
backward with the merged result): :func:`attend_piece`, :func:`merge`, :func:`piece_backward`.

:func:`split_of` decides from a dense boolean mask (once per forward, cached by the caller):
split when every cached column is visible to every row and every row sees its own key (so
no part has an empty row). The walk's own masks (:mod:`dta.model.packmask`) never build the
dense mask: they say ``past`` and the pack's own ``[T, T]`` mask directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dta.model.attention_kernels import CAUSAL, Kernel, additive_mask, kernels_of, merge

__all__ = ["Split", "split_of", "split_attention", "attend_piece", "piece_backward", "merge",
           "Tape", "additive_mask"]


@dataclass
class Split:
    past: int  # cached keys, visible to every row
    own: torch.Tensor | None  # bool [T, T] visibility of the pack's own keys; None: causal
    _forms: dict = field(default_factory=dict, repr=False)  # per kernel: its mask (once)

    def mask_for(self, kernel: Kernel, dtype: torch.dtype):
        """The own keys' mask in ``kernel``'s form (``CAUSAL`` for a causal pack), made once."""
        if self.own is None:
            return CAUSAL
        key = (kernel.name, dtype)
        if key not in self._forms:
            self._forms[key] = kernel.prepare(self.own, dtype)
        return self._forms[key]

    @property
    def inner(self) -> torch.Tensor | None:
        """The own keys' additive [1, 1, T, T] mask (None: causal)."""
        return None if self.own is None else additive_mask(self.own, torch.float64)[None, None]


def split_of(mask: torch.Tensor, dtype: torch.dtype | None = None) -> Split | None:
    """The split of a dense boolean ``[1, 1, T, S]`` mask (True = visible), or None."""
    if mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
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
    return Split(past, None if torch.equal(own, causal) else own.clone())


def _fold(x: torch.Tensor, kv: int) -> torch.Tensor:
    """[B, H, T, ...] -> [B, KV, G·T, ...]: the G query heads of each K/V head as one block."""
    B, H, T = x.shape[:3]
    return x.reshape(B, kv, (H // kv) * T, *x.shape[3:])


def attend_piece(q, k, v, kernel: Kernel, mask, scale):
    """One K/V piece: ``(out, lse)`` of q over ``k``/``v`` under ``mask`` (None: every key
    visible -- the grouped-query heads are then folded into rows, no K/V copy; ``CAUSAL``;
    or ``kernel``'s tree mask, :meth:`Split.mask_for`)."""
    if mask is None:
        B, H, T, D = q.shape
        kv = k.shape[1]
        out, lse = kernel.forward(_fold(q, kv), k, v, None, scale)
        return out.reshape(B, H, T, D), lse.reshape(B, H, T)
    return kernel.forward(q, k, v, mask, scale)


def piece_backward(dout, q, k, v, out, lse, kernel: Kernel, mask, scale):
    """One K/V piece's share of the gradients, given the *merged* ``out`` and ``lse`` of the
    whole row: ``(dq, dk, dv)``; the pieces' dq add up to the whole dq."""
    if mask is None:
        kv = k.shape[1]
        dq, dk, dv = kernel.backward(_fold(dout, kv), _fold(q, kv), k, v, _fold(out, kv),
                                     _fold(lse, kv), None, scale)
        return dq.reshape(q.shape), dk, dv
    return kernel.backward(dout, q, k, v, out, lse, mask, scale)


class SplitAttention(torch.autograd.Function):
    """Inputs: ``q`` and the K/V *pieces* -- the tensors the joined K/V were concatenated from
    (the path's frames and the pack's own K/V), or the joined K/V as one piece; ``joined``
    (not an autograd input) is what the forward attends to. The backward runs once per piece
    (split at the cache boundary) and hands each piece its own gradient: no path-long
    K/V or dK/dV is joined again."""

    @staticmethod
    def forward(ctx, q, split: Split, kernels, scale, tape, joined, n: int, *pieces):
        if tape is not None and tape.recorded:
            out, lse = tape.take(q, split.past)
        else:
            out, lse = _attend(q, *joined, split, kernels, scale)
            if tape is not None:
                tape.keep(out, lse, split.past)
        ctx.save_for_backward(q, out, lse, *pieces)
        ctx.split, ctx.kernels, ctx.scale, ctx.n = split, kernels, scale, n
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *pieces = ctx.saved_tensors
        split, (k_cached, k_own), scale, n = ctx.split, ctx.kernels, ctx.scale, ctx.n
        past, own_mask = split.past, split.mask_for(k_own, q.dtype)
        dout = dout.contiguous()
        dq, dks, dvs, at = None, [], [], 0
        for k, v in zip(pieces[:n], pieces[n:]):
            end, dk_parts, dv_parts = at + k.shape[2], [], []
            for a, b in ((at, min(end, past)), (max(at, past), end)):
                if a >= b:
                    continue
                ks, vs = k[:, :, a - at:b - at], v[:, :, a - at:b - at]
                if b <= past:  # cached keys: every row sees them
                    dqi, dk, dv = piece_backward(dout, q, ks, vs, out, lse, k_cached, None, scale)
                else:  # the pack's own keys: causal, or its tree mask
                    dqi, dk, dv = piece_backward(dout, q, ks, vs, out, lse, k_own, own_mask, scale)
                dq = dqi if dq is None else dq.add_(dqi)
                dk_parts.append(dk)
                dv_parts.append(dv)
            dks.append(_joined(dk_parts))
            dvs.append(_joined(dv_parts))
            at = end
        return (dq, None, None, None, None, None, None, *dks, *dvs)


def _attend(q, k, v, split: Split, kernels, scale):
    """The split forward: ``(out, lse)`` over the cached keys and the pack's own, merged."""
    k_cached, k_own = kernels
    past = split.past
    o1, l1 = attend_piece(q, k[:, :, :past], v[:, :, :past], k_cached, None, scale)
    o2, l2 = attend_piece(q, k[:, :, past:], v[:, :, past:], k_own,
                          split.mask_for(k_own, q.dtype), scale)
    return merge(o1, l1, o2, l2)


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
                    key_pieces=None, value_pieces=None, tape: Tape | None = None,
                    backend: str | None = None) -> torch.Tensor | None:
    """``softmax(q Kᵀ·scale + mask) V`` for ``split``'s mask, [B, H, T, D]; None when the
    kernel table has no row for the queries' device and dtype (the caller keeps one masked
    call). ``key_pieces`` / ``value_pieces``: the tensors ``key`` / ``value`` were concatenated
    from (along the positions); when given, the backward keeps those instead of ``key`` and
    ``value`` and hands each its own gradient -- the joined copy of the path's K/V is then
    freed after the forward. ``tape``: keep the result (a forward without grad), or take it
    back (once the tape has ``recorded``). ``backend``: :data:`dta.model.attention_kernels.BACKENDS`
    (None: the walk's)."""
    kernels = kernels_of(query, split.own is not None, backend)
    if kernels is None:
        return None
    kp, vp = _pieces_of(key, key_pieces), _pieces_of(value, value_pieces)
    if kp is None or vp is None:
        kp, vp = (key,), (value,)
    return SplitAttention.apply(query, split, kernels, scale, tape, (key, value),
                                len(kp), *kp, *vp)

"""Context-parallel attention: a pack's rows in, this rank's heads over the whole path, rows out.

One attention layer call of a pack under context parallelism (``dta.model.context_parallel``):

1. the rank's own rows' q/k/v (all heads, post-RoPE, from the model's own projections) go
   through one all-to-all: it receives every row of the pack for its heads (:class:`HeadSplit`);
2. :class:`PartialAttention` attends those queries to the path's K/V of its K/V heads --
   the pieces its frames stored (:class:`SplitHeadsLayer` holds them), each at its rows' true
   positions (a sliding window is applied there) -- and to the pack's own K/V under the
   pack's tree mask and window, giving ``(out, lse)`` of its query heads for every row;
3. one all-to-all sends each row owner its rows of that output; where ``C`` exceeds the K/V
   heads, the ranks sharing a head each attended to a share of its rows, and the row owner
   merges their partial outputs by their log-sum-exps (exact: the softmax over the union).

The rank keeps, as the pack's state for its descendants, the pack's K/V of its heads (its
rows of them where a head is shared): ~1/C of the pack's K/V. The bytes of a call are the
pack's tokens × (q, k, v, out) of the heads -- never the path's length.

Backward: autograd through the two exchanges (their reverse) and :class:`PartialAttention`,
whose backward takes ``dout`` and ``dlse`` (the merge's gradient): with P = exp(s − lse) of
the rank's own partial, ``ds = P ∘ (dout·vᵀ − rowsum(dout ∘ out) + dlse)`` -- the exact
gradient of the merged softmax. The path pieces' dK/dV stay on the rank, in its frames'
gradient accumulators. Under *recompute* the re-forward takes ``(out, lse)`` back from the
pack's tape: the exchanges run again (∝ the pack), the attention over the path does not.

The piece attention is plain tensor algebra (scores of the queries against one stored piece
at a time; float64-exact on any device, rows that see no key of a piece handled); a fused
kernel can replace :func:`_piece_forward` / :func:`_piece_backward` without changing the
protocol.
"""
from __future__ import annotations

import torch

from dta.model.hf_cache import OffsetLayer
from dta.model.placement import ContextParallelError

REFUSED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks")
_error = ContextParallelError


class HeadSplit:
    """An attention layer's ``H`` query heads over ``KV`` key/value heads on ``C`` ranks.

    ``C <= KV``: rank p holds K/V heads ``[p·KV // C, (p+1)·KV // C)`` (uneven when C does
    not divide KV) with their query heads, every row. ``C > KV``: rank p holds K/V head
    ``p·KV // C``; the ``m`` ranks sharing a head split its rows (sharer j: rows
    ``[j·T // m, (j+1)·T // m)`` of every pack) and the row owners merge their outputs.
    ``groups``: per K/V head range, the ranks whose outputs make its query heads."""

    def __init__(self, heads: int, kv_heads: int, size: int, rank: int):
        if heads % kv_heads:
            raise _error(f"context parallel: {heads} query heads over {kv_heads} K/V heads")
        self.H, self.KV, self.G, self.size, self.rank = heads, kv_heads, heads // kv_heads, size, rank
        if size <= kv_heads:
            self.kv = [(p * kv_heads // size, (p + 1) * kv_heads // size) for p in range(size)]
            self.groups = [(self.kv[p], [p]) for p in range(size)]
            self.sharers, self.index = 1, 0
        else:
            head = [p * kv_heads // size for p in range(size)]
            self.kv = [(h, h + 1) for h in head]
            self.groups = [((h, h + 1), [p for p in range(size) if head[p] == h])
                           for h in range(kv_heads)]
            ranks = self.groups[head[rank]][1]
            self.sharers, self.index = len(ranks), ranks.index(rank)
        self._columns: dict = {}

    @property
    def shared(self) -> bool:
        return self.size > self.KV

    def kv_rows(self, tokens: int) -> tuple[int, int]:
        j, m = self.index, self.sharers
        return j * tokens // m, (j + 1) * tokens // m

    def heads_of(self, p: int) -> tuple[int, int]:
        """(query heads, K/V heads) of rank p."""
        h0, h1 = self.kv[p]
        return (h1 - h0) * self.G, h1 - h0

    def columns(self, D: int, device) -> list:
        """Per rank, its columns of a row's [q (H·D) | k (KV·D) | v (KV·D)]."""
        key = (D, str(device))
        if key not in self._columns:
            cols = []
            for h0, h1 in self.kv:
                q = torch.arange(h0 * self.G * D, h1 * self.G * D)
                k = self.H * D + torch.arange(h0 * D, h1 * D)
                cols.append(torch.cat([q, k, k + self.KV * D]).to(device))
            self._columns[key] = cols
        return self._columns[key]


class SplitHeadsLayer(OffsetLayer):
    """One attention layer's cache of a pack's forward under context parallelism: the path
    pieces of this rank's heads (``dta.model.modeling.Piece``: K/V, their true positions,
    the path rows they stand for), and after the forward the pack's own K/V of its heads
    (``cells``: its node state). ``offset`` is the whole path's length. ``update`` hands the
    attention the layer (the key carries it: ``dta_attend``), where :meth:`attend` runs."""

    def __init__(self, parts: list, spread, layout):
        super().__init__(sum(p.covers for p in parts))
        self.spread, self.cp = spread, spread.cp
        self.parts = [p for p in parts if p[0].shape[2]]
        self.part = spread.part(layout.tokens)
        self.cells = None

    def update(self, key_states, value_states, *args, **kwargs):
        key_states.dta_attend = self
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.offset + (self.part.tokens if self.cells is not None else 0)

    def node_state(self, start: int, end: int, where: str) -> tuple:
        if self.cells is None:
            raise _error(f"{where}: the attention did not go through DTA's context-parallel "
                         "attention (attention implementation 'sdpa', run as 'dta_sdpa', is "
                         "required: WalkOptions.native_gqa)")
        if (start, end) != (self.offset, self.offset + self.part.tokens):
            raise _error(f"{where}: a context-parallel layer of positions {self.offset}.."
                         f"{self.offset + self.part.tokens - 1} read at {start}..{end - 1}")
        return self.cells

    def attend(self, module, query, key, value, mask, dropout: float, scaling, tape, kwargs):
        """The pack's attention for this rank's rows (module docstring): [1, rows, H, D]."""
        key.__dict__.pop("dta_attend", None)
        extra = sorted(k for k in REFUSED_KWARGS if kwargs.get(k) is not None)
        if extra:
            raise _error(f"context parallel: attention with {extra} is not supported "
                         f"({type(module).__name__})")
        if dropout and module.training:
            raise _error("context parallel: attention dropout in training")
        view = getattr(mask, "dta_pack", None)
        part, split, cp = self.part, self.spread.heads, self.cp
        T = part.tokens
        if view is None or view.past != self.offset or len(view.positions) != T:
            raise _error(f"context parallel: a pack of {T} rows over a path of {self.offset} "
                         "needs its pack view as the attention mask (dta.model.packmask)")
        H, KV, D = query.shape[1], key.shape[1], query.shape[-1]
        if (H, KV) != (split.H, split.KV):
            raise _error(f"context parallel: {type(module).__name__} has {H} query / {KV} K/V "
                         f"heads, the model config {split.H} / {split.KV}")
        rows = torch.cat([query[0], key[0], value[0]]).transpose(0, 1).reshape(query.shape[2], -1)
        x = cp.rows_to_heads(rows, split.columns(D, rows.device), part)  # [T, mine]
        hq, kv = split.heads_of(cp.rank)
        q = x[:, : hq * D].reshape(T, hq, D).transpose(0, 1).unsqueeze(0)
        k = x[:, hq * D:(hq + kv) * D].reshape(T, kv, D).transpose(0, 1).unsqueeze(0)
        v = x[:, (hq + kv) * D:].reshape(T, kv, D).transpose(0, 1).unsqueeze(0)
        a, b = split.kv_rows(T)
        k, v = k[:, :, a:b].contiguous(), v[:, :, a:b].contiguous()
        self.cells = (k, v)
        if split.shared:  # a share of the head's keys: a partial output the row owners merge
            carry = torch.promote_types(query.dtype, torch.float32)
            out, lse = self._partial(q, k, v, mask[0, 0][:, a:b], view, scaling, tape)
            y = torch.cat([out[0].transpose(0, 1).reshape(T, hq * D).to(carry),
                           lse[0].transpose(0, 1).to(carry)], dim=1)
        else:  # whole heads: the walk's own attention over [path | pack], on these heads
            y = self._whole_heads(module, q, k, v, mask, view, scaling).reshape(T, hq * D)
        widths = [split.heads_of(p)[0] * (D + split.shared) for p in range(cp.size)]
        blocks = cp.heads_to_rows(y, widths, part)
        outs = []
        for (h0, h1), ranks in split.groups:
            g = (h1 - h0) * split.G
            pieces = [(blocks[p][:, : g * D].reshape(part.real, g, D), blocks[p][:, g * D:])
                      for p in ranks]
            outs.append(pieces[0][0] if len(pieces) == 1 else _merge_rows(pieces))
        out = part.pad(torch.cat(outs, dim=1).to(query.dtype), 0)  # [rows, H, D]
        return out.unsqueeze(0), None

    def _whole_heads(self, module, q, k, v, mask, view, scaling) -> torch.Tensor:
        """[T, heads, D]: every row's attention for heads whose every path row this rank
        holds -- ``dta.model.attention.pack_attention`` (split at the cache boundary through
        the kernel table; a window short of the path: one masked call), as a process walking
        alone runs it; a root pack: one masked call over its own keys."""
        from dta.model.attention import join_path, pack_attention

        if not self.offset:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
            return out[0].transpose(0, 1)
        keys, values = join_path(self.parts, k, v)
        return pack_attention(module, q, keys, values, mask, view, 0.0, scaling)[0][0]

    def _partial(self, q, k, v, own, view, scaling, tape):
        """(out, lse) of the queries over this rank's rows of its head: the path pieces it
        stores (a window applied at their true positions) and its rows of the pack's keys."""
        scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
        path = [None if view.window is None else _bias(
            (view.positions[:, None] - torch.as_tensor(p.positions, device=q.device)[None, :])
            < view.window, q.dtype) for p in self.parts]
        return PartialAttention.apply(q, k, v, scale, _bias(own, q.dtype), path, tape,
                                      self.offset, len(self.parts),
                                      *(p[0] for p in self.parts), *(p[1] for p in self.parts))


def _merge_rows(parts):
    """[rows, heads, D] from the sharers' partial outputs and lse (differentiable)."""
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = None
    for o, l in parts:
        term = o * torch.exp(l - safe).unsqueeze(-1)
        out = term if out is None else out + term
    return out


def _bias(visible: torch.Tensor, dtype) -> torch.Tensor | None:
    """0 where visible, -inf elsewhere; None when everything is visible."""
    if bool(visible.all()):
        return None
    return torch.zeros(visible.shape, dtype=torch.promote_types(dtype, torch.float32),
                       device=visible.device).masked_fill_(~visible, float("-inf"))


def pack_views(layout, model, device, support):
    """The attention mask argument of a pack under context parallelism: a pack view
    (``dta.model.packmask.pack_view``: the pack's own [T, T] mask, its window, the rows'
    positions) for every attention layer type, chain or not, root or not."""
    from dta.model.packmask import UNMASKED, pack_view

    kind = getattr(model.config, "_attn_implementation", None)
    if kind != "dta_sdpa":
        raise _error(f"{type(model).__name__}: context parallel walks need attention "
                     f"implementation 'sdpa' run as 'dta_sdpa' (WalkOptions.native_gqa), not "
                     f"{kind!r}")
    windows, how = support
    if windows is None:
        raise _error(f"{type(model).__name__}: context parallel needs a pack mask: {how}")
    masks = {t: pack_view(layout, device, w) for t, w in windows.items()}
    if how == "single":
        return next(iter(masks.values()))
    types = getattr(model.config, "layer_types", None) or ()
    return {**masks, **{t: None for t in UNMASKED if t in types}}


# -------------------------------------------------------------- piece attention --
def _fold(x: torch.Tensor, kv: int) -> torch.Tensor:
    """[1, H, T, ...] -> [KV, G·T, ...]: the G query heads of each K/V head as one block."""
    H, T = x.shape[1:3]
    return x.reshape(kv, (H // kv) * T, *x.shape[3:])


def _scores(qf, k, bias, scale, groups):
    s = torch.matmul(qf, k[0].transpose(-1, -2)).mul_(scale)  # [KV, G·T, S]
    if bias is not None:
        s = s + bias.repeat(groups, 1)
    return s


def _piece_forward(qf, k, v, bias, scale, groups):
    """(out, lse) of the folded queries over one piece; rows that see none of its keys get
    lse = -inf and out = 0."""
    s = _scores(qf, k, bias, scale, groups)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v[0]), lse


def _piece_backward(qf, k, v, bias, scale, groups, dof, lse, delta):
    """(dq, dk, dv) of one piece, from the rank's lse (rows that see nothing: 0) and
    delta = rowsum(dout ∘ out) − dlse."""
    p = torch.exp(_scores(qf, k, bias, scale, groups) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dof)
    ds = p.mul_(torch.matmul(dof, v[0].transpose(-1, -2)).sub_(delta.unsqueeze(-1)))
    dq = torch.matmul(ds, k[0]).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qf).mul_(scale)
    return dq, dk.unsqueeze(0), dv.unsqueeze(0)


def _merge(parts):
    """(out, lse) of a union of keys from each part's (out, lse), in the given order."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = None
    for o, l in parts:
        w = torch.exp(l - safe).unsqueeze(-1)
        out = o * w if out is None else out.add_(o * w)
    return out, lse


class PartialAttention(torch.autograd.Function):
    """Inputs: ``q`` [1, Hq, T, D] (this rank's query heads, every row of the pack), the
    pack's own ``k``/``v`` [1, KV, S, D] of its heads (its rows of them), and ``n`` path
    pieces (K then V). Outputs ``(out [1, Hq, T, D], lse [1, Hq, T])`` over the union of those
    keys, computed in at least float32; a row that sees none of them has lse -inf, out 0."""

    @staticmethod
    def forward(ctx, q, k, v, scale, own_bias, biases, tape, past: int, n: int, *pieces):
        ctx.set_materialize_grads(False)
        acc = torch.promote_types(q.dtype, torch.float32)
        kv, dtype = k.shape[1], q.dtype
        groups = q.shape[1] // kv
        q32, k32, v32 = q.to(acc), k.to(acc), v.to(acc)
        p32 = [x.to(acc) for x in pieces]
        qf = _fold(q32, kv)
        if tape is not None and tape.recorded:
            out, lse = tape.take(q, past)
            out, lse = _fold(out.to(acc), kv), _fold(lse, kv)
        else:
            parts = [_piece_forward(qf, k32, v32, own_bias, scale, groups)]
            parts += [_piece_forward(qf, pk, pv, b, scale, groups)
                      for pk, pv, b in zip(p32[:n], p32[n:], biases)]
            out, lse = _merge(parts)
            if tape is not None:
                tape.keep(out.reshape(q.shape).to(dtype), lse.reshape(q.shape[:3]), past)
        ctx.save_for_backward(q, k, v, out, lse, own_bias, *pieces)
        ctx.scale, ctx.biases, ctx.n = scale, biases, n
        return out.reshape(q.shape).to(dtype), lse.reshape(q.shape[:3])

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, own_bias, *pieces = ctx.saved_tensors
        scale, biases, n = ctx.scale, ctx.biases, ctx.n
        grads = [None] * (9 + len(pieces))
        if dout is None and dlse is None:
            return tuple(grads)
        acc = out.dtype
        kv = k.shape[1]
        groups = q.shape[1] // kv
        qf = _fold(q.to(acc), kv)
        dof = _fold(dout.to(acc), kv) if dout is not None else torch.zeros_like(out)
        delta = (dof * out).sum(-1)
        if dlse is not None:
            delta = delta - _fold(dlse.to(acc), kv)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq, dk, dv = _piece_backward(qf, k.to(acc), v.to(acc), own_bias, scale, groups, dof,
                                     safe, delta)
        dks, dvs = [], []
        for pk, pv, b in zip(pieces[:n], pieces[n:], biases):
            dqi, dki, dvi = _piece_backward(qf, pk.to(acc), pv.to(acc), b, scale, groups, dof,
                                            safe, delta)
            dq.add_(dqi)
            dks.append(dki.to(pk.dtype))
            dvs.append(dvi.to(pv.dtype))
        grads[:3] = dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        grads[9:] = dks + dvs
        return tuple(grads)

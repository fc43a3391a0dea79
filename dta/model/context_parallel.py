"""Context parallelism: a walk's path K/V stored spread over a group of ranks.

A context-parallel (CP) group of ``C`` ranks walks one tree together. Every rank runs the same
walk -- the same packs, blocks, projections, MLPs, LM head and loss (replicated: bitwise the
same inputs, the same kernels, so the same results) -- but each pushed pack's per-layer K/V
are *stored* sliced over the group: rank ``r`` keeps the pack's rows
``[r·T // C, (r+1)·T // C)`` of every attention layer (uneven when ``C`` does not divide
``T``), as the autograd leaves its descendants read and accumulate gradients into. Recurrent
(Gated DeltaNet) states are small and stay replicated.

A new pack's queries (the same on every rank) attend to

* the pack's own keys (causal, its tree mask, its window): on every rank, replicated;
* the *local* slice of every ancestor's K/V (a sliding window or any other mask is read at
  the slice's true positions), giving a local ``(out, lse)`` per rank;

then the ``(out, lse)`` of every rank are all-gathered (``C`` × the block's
``tokens × heads × head_dim``: never the path's length) and merged by their log-sum-exps in
one fixed order -- the exact softmax over the whole path, identical on every rank.

Backward (:class:`CPAttention`): with the merged ``out``/``lse`` and ``dout``, every rank
computes dQ, dK, dV for its own slice (``P = exp(s − lse)``, ``D = rowsum(dout ∘ out)``: the
whole row's); the dQ of the slices are all-gathered and summed in rank order (∝ the block's
tokens); dK/dV stay on the rank, in its slice's gradient accumulators. When a pack is popped,
its K/V gradients are all-gathered for the pack's own rows only (:meth:`ContextParallel.
state_grads`, ∝ the pack's tokens), so its replicated backward runs on the whole pack.
Parameter gradients come out identical on every rank of the group: a data-parallel reduction
averages over data-parallel groups only.

The piece attention here is plain tensor algebra (scores of one block against one stored
piece at a time, float64-exact on any device); a fused per-device kernel can replace
:func:`_piece_forward` / :func:`_piece_backward` (one piece in, ``(out, lse)`` /
``(dq, dk, dv)`` out) without changing the protocol.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from dta.model.hf_cache import OffsetLayer


class ContextParallelError(ValueError):
    """A context-parallel walk that cannot run exactly: refused before training."""


class ContextParallel:
    """The group a walk's attention pieces live on, and what it sent (``sent_bytes``:
    what this rank contributed to collectives times the ``C − 1`` peers that receive it)."""

    def __init__(self, group):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError("context_parallel_group: torch.distributed is not "
                                       "initialized")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sent_bytes = 0
        self.collectives = 0
        self.path_bytes = 0  # this rank's stored K/V slices and their gradients, alive now
        self.path_bytes_peak = 0

    @classmethod
    def of(cls, group) -> "ContextParallel | None":
        """None for no group (or a group of one rank: nothing to spread)."""
        if group is None:
            return None
        if isinstance(group, ContextParallel):  # given explicitly: used even for one rank
            return group
        cp = cls(group)
        return cp if cp.size > 1 else None

    # ------------------------------------------------------------------ rows --
    def rows(self, n: int) -> tuple[int, int]:
        """This rank's rows of an ``n``-row pack: ``[r·n // C, (r+1)·n // C)``."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    # ------------------------------------------------------------ collectives --
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (the same shape on every rank), in rank order."""
        import torch.distributed as dist

        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        self.sent_bytes += t.numel() * t.element_size() * (self.size - 1)
        self.collectives += 1
        return out

    def gather_rows(self, local: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
        """The whole ``n``-row tensor from every rank's slice (:meth:`rows`) along ``dim``:
        slices are padded to the longest, gathered, cut and joined in rank order."""
        width = -(-n // self.size)
        pad = width - local.shape[dim]
        if pad:
            shape = list(local.shape)
            shape[dim] = pad
            local = torch.cat([local, local.new_zeros(shape)], dim=dim)
        parts = self.all_gather(local)
        lengths = [(r + 1) * n // self.size - r * n // self.size for r in range(self.size)]
        return torch.cat([p.narrow(dim, 0, k) for p, k in zip(parts, lengths)], dim=dim)

    # ------------------------------------------------------- a pack's states --
    def shard(self, layer: tuple, requires_grad=None) -> "ShardedState":
        """An attention layer's (K, V) of a pack, kept as this rank's rows only (owning
        their memory: the whole pack's K/V can be freed)."""
        n = int(layer[0].shape[2])
        lo, hi = self.rows(n)
        parts = [x.detach()[:, :, lo:hi].clone() for x in layer]
        if requires_grad is not None:
            parts = [x.requires_grad_(need) for x, need in zip(parts, requires_grad)]
        for x in parts:
            self._count(x)
            if x.requires_grad:
                x.register_post_accumulate_grad_hook(self._count_grad)
        return ShardedState(parts, lo, hi, n)

    def _count(self, t: torch.Tensor) -> None:
        """Count ``t`` in :attr:`path_bytes` until it is freed."""
        n = t.numel() * t.element_size()
        self.path_bytes += n
        self.path_bytes_peak = max(self.path_bytes_peak, self.path_bytes)
        weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.path_bytes -= n

    def _count_grad(self, leaf: torch.Tensor) -> None:
        if getattr(leaf, "_dta_counted", None) is not leaf.grad:  # a new gradient tensor
            leaf._dta_counted = leaf.grad
            self._count(leaf.grad)

    def state_grads(self, full: tuple, leaves: "ShardedState") -> list[tuple]:
        """(output, gradient) pairs of a popped pack's attention layer: the gradients its
        descendants left in every rank's slice, all-gathered for the pack's own rows.
        Collective: called for every leaf that requires grad (the same on every rank)."""
        pairs = []
        for out, leaf in zip(full, leaves):
            if not leaf.requires_grad:
                continue
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            pairs.append((out, self.gather_rows(g, leaves.n)))
        return pairs


    def __deepcopy__(self, memo):  # a copy of a parallelized model walks on the same group
        return self


ATTRIBUTE = "_dta_context_parallel"


def parallelize_context(model, context_parallel_group):
    """Apply context parallelism to ``model`` from outside (torchtitan style): its walks store
    every pack's K/V spread over ``context_parallel_group`` (a ``torch.distributed`` process
    group, or a :class:`ContextParallel`); None or a group of one rank removes it. Every rank
    of the group must hold the same model and walk the same batch with the same settings.
    Returns the model."""
    cp = ContextParallel.of(context_parallel_group)
    if cp is None:
        if hasattr(model, ATTRIBUTE):
            delattr(model, ATTRIBUTE)
        return model
    kind = getattr(model.config, "_attn_implementation", None)
    if kind not in ("sdpa", "dta_sdpa"):
        raise ContextParallelError(f"{type(model).__name__}: context parallel needs attention "
                                   f"implementation 'sdpa' (run as 'dta_sdpa'), not {kind!r}")
    object.__setattr__(model, ATTRIBUTE, cp)
    return model


def context_parallel_of(model) -> ContextParallel | None:
    """The group ``model``'s attention pieces are stored over, or None."""
    return getattr(model, ATTRIBUTE, None)


class ShardedState(tuple):
    """A pack's attention layer as this rank stores it: (K, V) rows ``lo..hi-1`` of the
    pack's ``n`` rows."""

    def __new__(cls, parts, lo: int, hi: int, n: int):
        self = super().__new__(cls, parts)
        self.lo, self.hi, self.n = lo, hi, n
        return self

    def through(self, layout, rows: np.ndarray) -> tuple["ShardedPiece", bool]:
        """The piece a pack below reads: this rank's share of ``rows`` (the pack's rows on
        the root path through the node it hangs from), with their true positions."""
        k, v = self
        mine = rows[(rows >= self.lo) & (rows < self.hi)]
        local = mine - self.lo
        reusable = True
        if len(local) == 0:
            k, v = k[:, :, :0], v[:, :, :0]
        elif np.array_equal(local, np.arange(local[0], local[0] + len(local))):
            a, b = int(local[0]), int(local[0]) + len(local)
            k, v = k[:, :, a:b], v[:, :, a:b]
        else:
            idx = torch.as_tensor(local, device=k.device)
            k, v, reusable = k.index_select(2, idx), v.index_select(2, idx), False
        positions = torch.as_tensor(np.asarray(layout.positions)[mine], device=k.device)
        return ShardedPiece((k, v), positions, len(rows)), reusable


class ShardedPiece(tuple):
    """(K, V) of this rank's share of one frame's path rows, their true ``positions``, and
    ``covers``: the path rows the piece stands for on the whole group."""

    def __new__(cls, kv, positions: torch.Tensor, covers: int):
        self = super().__new__(cls, kv)
        self.positions, self.covers = positions, int(covers)
        return self


# -------------------------------------------------------------- the cache layer --
# a CP layer's own new K/V, by the key tensor's id, while the key lives: the attention hook
# (dta.model.attention.sdpa_gqa_forward) finds the path pieces behind them
_layers: dict[int, "weakref.ref"] = {}


def sharded_of(key: torch.Tensor) -> "ShardedPathLayer | None":
    ref = _layers.get(id(key))
    return None if ref is None else ref()


class ShardedPathLayer(OffsetLayer):
    """One layer's cache of a pack's forward under CP: the path's pieces are this rank's
    slices (:class:`ShardedPiece`); ``update`` hands the attention the pack's own K/V only,
    and the attention hook reads the pieces from here (:meth:`attend`). ``offset`` is the
    whole path's length (positions and masks are the group's, not the rank's)."""

    def __init__(self, parts: list, cp: ContextParallel):
        bad = [p for p in parts if not isinstance(p, ShardedPiece)]
        if bad:
            raise ContextParallelError("a context-parallel pack's path holds K/V that are not "
                                       "sharded (a frame stored without the group)")
        super().__init__(sum(p.covers for p in parts))
        self.cp = cp
        self.parts = [p for p in parts if p[0].shape[2]]
        self.attended = False

    def update(self, key_states, value_states, *args, **kwargs):
        self.store(key_states, value_states)
        if self.offset:
            _layers[id(key_states)] = weakref.ref(self)
            weakref.finalize(key_states, _layers.pop, id(key_states), None)
        return key_states, value_states

    def check_attended(self, where: str) -> None:
        """After the forward: the path was attended through :meth:`attend` (an attention
        implementation that bypassed it saw the pack's own keys only)."""
        if self.offset and not self.attended:
            raise ContextParallelError(
                f"{where}: the attention did not go through DTA's context-parallel path "
                "attention (attention implementation 'sdpa' run as 'dta_sdpa' is required)")

    def attend(self, module, query, key, value, mask, dropout: float, scaling, tape, kwargs):
        """The exact attention of ``query`` over the whole path and the pack's own keys."""
        extra = sorted(k for k in ("position_bias", "softcap", "s_aux", "sinks")
                       if kwargs.get(k) is not None)
        if extra:
            raise ContextParallelError(f"context parallel: attention with {extra} is not "
                                       f"supported ({type(module).__name__})")
        if dropout and module.training:
            raise ContextParallelError("context parallel: attention dropout in training")
        T, P = query.shape[2], self.offset
        view = getattr(mask, "dta_pack", None)  # a pack view: the own [T, T] mask + the window
        if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4
                                 or mask.shape[0] != 1 or mask.shape[1] != 1):
            raise ContextParallelError(f"context parallel: a {mask.dtype} mask of shape "
                                       f"{tuple(mask.shape)} (a boolean [1, 1, T, S] is needed)")
        width = T if view is not None else P + T
        if mask is not None and mask.shape[-1] != width or view is not None and view.past != P:
            raise ContextParallelError(f"context parallel: a mask over {mask.shape[-1]} keys "
                                       f"for a path of {P} and a pack of {T}")
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        if mask is None:  # one path, every cached key visible
            own = torch.ones(T, T, dtype=torch.bool, device=query.device).tril_()
            path = [None] * len(self.parts)
        elif view is not None:
            own = mask[0, 0]
            path = [None if view.window is None else _bias(
                (view.positions[:, None] - p.positions[None, :]) < view.window, query.dtype)
                for p in self.parts]
        else:
            own = mask[0, 0, :, P:]
            path = [_bias(mask[0, 0].index_select(1, p.positions), query.dtype)
                    for p in self.parts]
        self.attended = True
        n = len(self.parts)
        out = CPAttention.apply(query, key, value, scale, _bias(own, query.dtype), path, self.cp,
                                tape, P, n, *(p[0] for p in self.parts), *(p[1] for p in self.parts))
        return out.transpose(1, 2).contiguous(), None


def _bias(visible: torch.Tensor, dtype) -> torch.Tensor | None:
    """0 where visible, -inf elsewhere; None when everything is visible."""
    if bool(visible.all()):
        return None
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf"))


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
    """(dq, dk, dv) of one piece, from the *merged* lse and D = rowsum(dout ∘ out)."""
    p = torch.exp(_scores(qf, k, bias, scale, groups) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dof)
    ds = p.mul_(torch.matmul(dof, v[0].transpose(-1, -2)).sub_(delta.unsqueeze(-1)))
    dq = torch.matmul(ds, k[0]).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qf).mul_(scale)
    return dq, dk.unsqueeze(0), dv.unsqueeze(0)


def _merge(parts):
    """(out, lse) of a union of keys from each part's (out, lse), in the given order (a row
    no part sees: lse -inf, out 0)."""
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = None
    for o, l in parts:
        w = torch.exp(l - safe).unsqueeze(-1)
        out = o * w if out is None else out.add_(o * w)
    return out, lse


class CPAttention(torch.autograd.Function):
    """Inputs: the folded-able ``q`` [1, H, T, D], the pack's own ``k``/``v`` [1, KV, T, D],
    and this rank's ``n`` path pieces (K then V). Output [1, H, T, D], identical on every
    rank of the group; see the module docstring for the protocol."""

    @staticmethod
    def forward(ctx, q, k, v, scale, own_bias, biases, cp, tape, past: int, n: int, *pieces):
        kv = k.shape[1]
        groups = q.shape[1] // kv
        qf = _fold(q, kv)
        if tape is not None and tape.recorded:
            out, lse = tape.take(q, past)
            out, lse = _fold(out, kv), _fold(lse, kv)
        else:
            parts = [_piece_forward(qf, k, v, own_bias, scale, groups)]
            local = [_piece_forward(qf, pk, pv, b, scale, groups)
                     for pk, pv, b in zip(pieces[:n], pieces[n:], biases)]
            if local:
                lo, ll = _merge(local)
            else:
                lo = torch.zeros_like(qf)
                ll = torch.full(qf.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
            parts += list(zip(cp.all_gather(lo), cp.all_gather(ll)))
            out, lse = _merge(parts)
            if tape is not None:
                tape.keep(out.reshape(q.shape), lse.reshape(q.shape[:3]), past)
        ctx.save_for_backward(q, k, v, out, lse, own_bias, *pieces)
        ctx.scale, ctx.biases, ctx.cp, ctx.n = scale, biases, cp, n
        return out.reshape(q.shape)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, own_bias, *pieces = ctx.saved_tensors
        scale, biases, cp, n = ctx.scale, ctx.biases, ctx.cp, ctx.n
        kv = k.shape[1]
        groups = q.shape[1] // kv
        qf, dof = _fold(q, kv), _fold(dout.contiguous(), kv)
        delta = (dof * out).sum(-1)
        dq, dk, dv = _piece_backward(qf, k, v, own_bias, scale, groups, dof, lse, delta)
        dq_local, dks, dvs = torch.zeros_like(qf), [], []
        for pk, pv, b in zip(pieces[:n], pieces[n:], biases):
            dqi, dki, dvi = _piece_backward(qf, pk, pv, b, scale, groups, dof, lse, delta)
            dq_local.add_(dqi)
            dks.append(dki)
            dvs.append(dvi)
        for part in cp.all_gather(dq_local):  # rank order: the same sum on every rank
            dq = dq.add_(part)
        return (dq.reshape(q.shape), dk, dv, None, None, None, None, None, None, None,
                *dks, *dvs)

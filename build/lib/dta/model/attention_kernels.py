"""The split attention's kernels: one table keyed by (device type, dtype, mask kind).

The split attention (:mod:`dta.model.split_attention`) attends a pack's queries to each K/V
*piece* separately and merges the pieces by their log-sum-exps. What it needs of a kernel is
the same on every device, so the device is a row of one table, never a branch of the walk:

    forward(q, k, v, mask, scale)                 -> (out, lse)
    backward(dout, q, k, v, out, lse, mask, scale) -> (dq, dk, dv)

``q`` [B, H, T, D]; ``k``, ``v`` [B, KV, S, D] with H a multiple of KV (a kernel whose op
takes equal heads repeats K/V itself and sums their gradients back); ``out`` in q's dtype;
``lse`` [B, H, T] in float32 (float64 for float64 inputs). The backward takes the *merged*
``out`` and ``lse`` of the whole row (not the piece's own): with them the piece's gradients
are exactly its share of the whole attention's (the flash backward's P = exp(s - lse) and
D = rowsum(dout * out)). Mask kinds:

* ``none``: every row sees every key (the cached keys of the path);
* ``causal``: the pack's own keys when the pack is one path (T x T, lower-triangular);
* ``tree``: the pack's own keys under its ``[T, T]`` tree mask (``prepare`` turns the
  boolean mask into the kernel's own form once per forward: an additive mask on CPU, a
  FlexAttention ``BlockMask`` on CUDA).

No kernel ever takes a mask over the cached keys: the split attention never builds one.

The rows (``TABLE``), first choice first:

=======  =====================  =====================================================
device   dtypes                 kernels (mask kinds)
=======  =====================  =====================================================
cpu      float64/32, bf16/fp16  ``cpu_flash``: ``aten._scaled_dot_product_flash_attention_for_cpu``
                                and its backward (none, causal, tree: additive [T, T])
cuda     bf16, fp16             ``flash_attn`` (flash-attn's ``_flash_attn_forward`` /
                                ``_flash_attn_backward``, when installed; none, causal),
                                ``cuda_flash`` (``aten._scaled_dot_product_flash_attention``
                                and its backward; none, causal)
cuda     float32                ``cuda_efficient`` (``aten._scaled_dot_product_efficient_attention``
                                and its backward; none, causal)
cuda     bf16, fp16, float32    ``flex`` (FlexAttention over a ``BlockMask`` of the pack's own
                                keys, padded to a bucket of 128 rows so one compilation
                                serves every pack of the bucket; tree)
=======  =====================  =====================================================

FlexAttention's backward cannot take the merged ``out``/``lse``: :class:`FlexTree` re-runs
its forward with autograd and feeds the merge's own chain rule back
(∂L/∂o₂ = a·dout, ∂L/∂ℓ₂ = a·rowsum(dout ∘ (o₂ − o)), a = exp(ℓ₂ − ℓ)), which is exact.

``backend`` (:data:`BACKENDS`, the walk's attention-kernel setting): ``auto`` takes each
row's first available kernel; ``torch`` only torch's own ops; ``flash_attn`` requires
flash-attn for the unmasked and causal pieces. The CUDA kernels are unmeasured on a GPU
(docs/gpu.md): on CPU, the tests' ``stand_in`` runs the CUDA rows with CPU ops standing in for
the CUDA ops -- the same code path up to the op call -- which is how the tests exercise them
(``tests/standins.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dta.options import ATTENTION_BACKENDS, WalkOptions

aten = torch.ops.aten
KINDS = ("none", "causal", "tree")
BACKENDS = ATTENTION_BACKENDS  # the walk setting's choices (dta.options: defined and validated there)
FLEX_BUCKET = 128  # the pack's own keys are padded to a multiple of this for FlexAttention


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, KV, S, D] -> [B, KV·G, S, D]: head h reads K/V head h // G."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sum_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`repeat_kv`'s input."""
    if groups == 1:
        return dx
    B, H, S, D = dx.shape
    return dx.view(B, H // groups, groups, S, D).sum(2)


@dataclass
class Kernel:
    """One kernel of the table. ``ops``: the calls into the device library (what
    the tests' ``stand_in`` replaces); everything else is the shared code path."""

    name: str
    kinds: tuple
    gqa: bool = True  # the op takes fewer K/V heads than query heads
    ops: dict = field(default_factory=dict)

    def available(self) -> bool:
        return True

    def prepare(self, own: torch.Tensor, dtype: torch.dtype):
        """The kernel's form of a pack's boolean [T, T] tree mask (kind ``tree``)."""
        raise NotImplementedError(f"{self.name} takes no tree mask")

    def forward(self, q, k, v, mask, scale):
        g = q.shape[1] // k.shape[1]
        if not self.gqa:
            k, v = repeat_kv(k, g), repeat_kv(v, g)
        return self._forward(q, k, v, mask, scale)

    def backward(self, dout, q, k, v, out, lse, mask, scale):
        g = q.shape[1] // k.shape[1]
        if not self.gqa:
            k, v = repeat_kv(k, g), repeat_kv(v, g)
        dq, dk, dv = self._backward(dout, q, k, v, out, lse, mask, scale)
        if not self.gqa:
            dk, dv = sum_groups(dk, g), sum_groups(dv, g)
        return dq, dk, dv


CAUSAL = "causal"  # the mask argument of a causal call


# ----------------------------------------------------------------------------- CPU --
def _cpu_fwd(q, k, v, causal: bool, attn_mask, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=causal, attn_mask=attn_mask, scale=scale)[:2]
    return out, lse


def _cpu_bwd(dout, q, k, v, out, lse, causal: bool, attn_mask, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = visible) as SDPA converts it: 0 where visible, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class CpuFlash(Kernel):
    """SDPA's CPU flash kernel (grouped-query heads read in place)."""

    def prepare(self, own, dtype):
        return additive_mask(own, dtype)[None, None]

    def _forward(self, q, k, v, mask, scale):
        return self.ops["fwd"](q, k, v, mask is CAUSAL, None if mask in (None, CAUSAL) else mask, scale)

    def _backward(self, dout, q, k, v, out, lse, mask, scale):
        return self.ops["bwd"](dout, q, k, v, out, lse, mask is CAUSAL,
                               None if mask in (None, CAUSAL) else mask, scale)


# ---------------------------------------------------------------------------- CUDA --
def _cuda_flash_fwd(q, k, v, causal: bool, scale):
    return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def _cuda_flash_bwd(dout, q, k, v, out, lse, causal: bool, scale):
    T, S = q.shape[2], k.shape[2]
    none = torch.empty(0, dtype=torch.int64, device=q.device)  # no varlen, no dropout
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, none, none, T, S, 0.0, causal, none, none, scale=scale)


def _cuda_efficient_fwd(q, k, v, causal: bool, scale):
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                            scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # some builds pad the lse's rows to a multiple of 32


def _cuda_efficient_bwd(dout, q, k, v, out, lse, causal: bool, scale):
    pad = -q.shape[2] % 32
    lse = torch.nn.functional.pad(lse, (0, pad)) if pad else lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    try:
        grads = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, seed, 0.0, [True, True, True, False], causal,
            scale=scale)
    except RuntimeError:  # a build that takes the lse unpadded
        grads = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse[..., :q.shape[2]], seed, seed, 0.0,
            [True, True, True, False], causal, scale=scale)
    return grads[:3]


class CudaSdpa(Kernel):
    """torch's own CUDA flash / memory-efficient SDPA ops (forward returning the lse, backward
    taking it): the unmasked and causal pieces."""

    def _forward(self, q, k, v, mask, scale):
        out, lse = self.ops["fwd"](q, k, v, mask is CAUSAL, scale)
        return out, lse.to(_lse_dtype(q.dtype))

    def _backward(self, dout, q, k, v, out, lse, mask, scale):
        return self.ops["bwd"](dout, q, k, v, out, lse, mask is CAUSAL, scale)


# flash-attn >= 2.6's internal ops (the pair its own autograd function and ring-attention
# implementations call): forward -> (out, softmax_lse [B, H, T] float32, S_dmask, rng_state)
def _flash_attn_fwd(q, k, v, causal: bool, scale):  # [B, T, H, D]
    from flash_attn.flash_attn_interface import _flash_attn_forward

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)[:2]
    return out, lse


def _flash_attn_bwd(dout, q, k, v, out, lse, causal: bool, scale):  # [B, T, H, D]
    from flash_attn.flash_attn_interface import _flash_attn_backward

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, scale, causal, -1, -1,
                         0.0, None, False, None)
    return dq, dk, dv


class FlashAttn(Kernel):
    """flash-attn's forward / backward (as ring-attention implementations call them): layout
    [B, T, H, D], grouped-query heads native."""

    def available(self) -> bool:
        if "fwd" in self.ops and self.ops["fwd"] is not _flash_attn_fwd:
            return True  # a stand-in
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return False
        return True

    def _forward(self, q, k, v, mask, scale):
        t = lambda x: x.transpose(1, 2).contiguous()
        out, lse = self.ops["fwd"](t(q), t(k), t(v), mask is CAUSAL, scale)
        return out.transpose(1, 2), lse.to(_lse_dtype(q.dtype))

    def _backward(self, dout, q, k, v, out, lse, mask, scale):
        t = lambda x: x.transpose(1, 2).contiguous()
        dq, dk, dv = self.ops["bwd"](t(dout), t(q), t(k), t(v), t(out), lse.contiguous(),
                                     mask is CAUSAL, scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@dataclass
class FlexMask:
    """A pack's own-keys tree mask for FlexAttention, padded to the bucket: padded rows see
    only their own (zero) key, so no row is empty and nothing reaches the real rows."""

    tokens: int
    padded: int
    own: torch.Tensor  # [padded, padded] bool
    block: object = None  # the BlockMask (built on first use)


_compiled_flex = None


def _flex_op(q, k, v, mask: FlexMask, scale):
    """FlexAttention (compiled once; one graph per bucket shape) over the padded pack keys:
    (out, lse) of the first ``mask.tokens`` rows, differentiable in both."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    if _compiled_flex is None and q.device.type != "cpu":
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    # on CPU (torch 2.13): compiled FlexAttention does inference only and returns no lse; the
    # eager one returns it (no backward either way): the forward runs, the backward waits for a GPU
    flex = _compiled_flex if q.device.type != "cpu" else flex_attention
    if mask.block is None:
        own = mask.own
        mask.block = create_block_mask(lambda b, h, qi, kv: own[qi, kv], None, None,
                                       mask.padded, mask.padded, device=str(q.device))
    pad = (0, 0, 0, mask.padded - mask.tokens)
    qp, kp, vp = (torch.nn.functional.pad(x, pad) for x in (q, k, v))
    out, aux = flex(qp, kp, vp, block_mask=mask.block, scale=scale, enable_gqa=True,
                    return_aux=AuxRequest(lse=True))
    return out[:, :, :mask.tokens], aux.lse[:, :, :mask.tokens]


class FlexTree(Kernel):
    """The pack's own keys under its tree mask: FlexAttention over a ``BlockMask``. The backward
    re-runs the forward with autograd and applies the merge's chain rule (module doc)."""

    def prepare(self, own, dtype):
        T = own.shape[0]
        P = -(-T // FLEX_BUCKET) * FLEX_BUCKET
        padded = torch.eye(P, dtype=torch.bool, device=own.device)
        padded[:T, :T] = own
        return FlexMask(T, P, padded)

    def _forward(self, q, k, v, mask, scale):
        out, lse = self.ops["fwd"](q, k, v, mask, scale)
        return out, lse.to(_lse_dtype(q.dtype))

    def _backward(self, dout, q, k, v, out, lse, mask, scale):
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
            o2, l2 = self.ops["fwd"](q_, k_, v_, mask, scale)
            a = (l2.to(lse.dtype) - lse).exp()
            g_o = (a.unsqueeze(-1) * dout.to(lse.dtype)).to(o2.dtype)
            g_l = a * (dout.to(lse.dtype) * (o2.to(lse.dtype) - out.to(lse.dtype))).sum(-1)
            return torch.autograd.grad((o2, l2), (q_, k_, v_), (g_o, g_l.to(l2.dtype)))


# --------------------------------------------------------------------------- table --
CPU_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
HALF = (torch.bfloat16, torch.float16)


def _table() -> dict:
    cpu = CpuFlash("cpu_flash", KINDS, ops=dict(fwd=_cpu_fwd, bwd=_cpu_bwd))
    flash_attn = FlashAttn("flash_attn", ("none", "causal"), ops=dict(fwd=_flash_attn_fwd,
                                                                       bwd=_flash_attn_bwd))
    cuda_flash = CudaSdpa("cuda_flash", ("none", "causal"), gqa=False,
                          ops=dict(fwd=_cuda_flash_fwd, bwd=_cuda_flash_bwd))
    cuda_eff = CudaSdpa("cuda_efficient", ("none", "causal"), gqa=False,
                        ops=dict(fwd=_cuda_efficient_fwd, bwd=_cuda_efficient_bwd))
    flex = FlexTree("flex", ("tree",), ops=dict(fwd=_flex_op))
    table = {}
    for dt in CPU_DTYPES:
        for kind in KINDS:
            table[("cpu", dt, kind)] = [cpu]
    for dt in (*HALF, torch.float32):
        for kind in ("none", "causal"):
            table[("cuda", dt, kind)] = [flash_attn, cuda_flash] if dt in HALF else [cuda_eff]
        table[("cuda", dt, "tree")] = [flex]
    return table


TABLE = _table()


def device_type(x) -> str:
    """The table row a tensor (or a device) takes: its device's type. The one place a device
    becomes a row -- tests run a device's rows on CPU by standing in for it here
    (``tests/standins.py``); callers look it up through this module."""
    return x.device.type if isinstance(x, torch.Tensor) else torch.device(x).type


def kernel_for(device: str, dtype: torch.dtype, kind: str, backend: str | None = None) -> Kernel | None:
    """The kernel for a piece of mask ``kind`` on ``device`` in ``dtype``; None: no row (the
    caller keeps the single masked call). ``backend`` as :data:`BACKENDS` says (None: the
    walk's, :data:`backend`)."""
    backend = globals()["backend"] if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"attention kernels: unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
    for k in TABLE.get((device, dtype, kind), ()):
        if backend == "torch" and isinstance(k, FlashAttn):
            continue
        if backend == "flash_attn" and kind != "tree" and not isinstance(k, FlashAttn):
            continue
        if k.available():
            return k
    if backend == "flash_attn" and kind != "tree" and (device, dtype, kind) in TABLE:
        raise RuntimeError(f"attention backend 'flash_attn': flash-attn is not installed (or "
                           f"takes no {dtype} on {device}); install it or use backend 'auto'")
    return None


def kernels_of(t: torch.Tensor, tree: bool, backend: str | None = None) -> tuple | None:
    """(kernel of the cached keys, kernel of the pack's own keys) for queries ``t``, or None."""
    dev = device_type(t)
    cached = kernel_for(dev, t.dtype, "none", backend)
    own = kernel_for(dev, t.dtype, "tree" if tree else "causal", backend)
    return None if cached is None or own is None else (cached, own)


# the backend of the walk running now (``dta.model.attention.native_gqa`` sets it)
backend = WalkOptions.default("attention_backend")


def merge(o1, l1, o2, l2):
    """Two pieces' (out, lse) as one: ``l = log(e^l1 + e^l2)``, ``o = e^(l1-l) o1 + e^(l2-l) o2``
    (in the lse's precision, returned in o1's dtype). Public for context parallelism: any
    number of pieces merge pairwise."""
    lse = torch.logaddexp(l1, l2)
    w1, w2 = (l1 - lse).exp_().unsqueeze(-1), (l2 - lse).exp_().unsqueeze(-1)
    if o1.dtype == lse.dtype:
        return o1.mul(w1).add_(o2.mul(w2)), lse
    return (o1.to(lse.dtype).mul_(w1).add_(o2.to(lse.dtype).mul_(w2))).to(o1.dtype), lse


"""Tests only: the CUDA rows of the split attention's kernel table run on CPU.

:func:`stand_in` makes CPU tensors take a device's rows of :data:`dta.model.attention_kernels.TABLE`
with each kernel's device ops replaced by CPU ops of the same contract: the shared code (layout
transposes, grouped-query repeats, the FlexAttention bucket padding and re-forward backward,
the log-sum-exp merge) runs as it will on the device, up to the op call.
"""
from __future__ import annotations

import contextlib

import torch

from dta.model.attention_kernels import (CPU_DTYPES, KINDS, TABLE, FlexMask, _cpu_bwd, _cpu_fwd,
                                         _device_override, _lse_dtype, repeat_kv)


def math_op(q, k, v, mask: FlexMask, scale):
    """FlexAttention's math, differentiable on any device (the stand-in of :func:`_flex_op`):
    the same padding, the same mask."""
    pad = (0, 0, 0, mask.padded - mask.tokens)
    qp, kp, vp = (torch.nn.functional.pad(x, pad) for x in (q, k, v))
    kp, vp = repeat_kv(kp, q.shape[1] // k.shape[1]), repeat_kv(vp, q.shape[1] // k.shape[1])
    s = (qp @ kp.transpose(-1, -2)) * (scale if scale is not None else qp.shape[-1] ** -0.5)
    s = s.to(_lse_dtype(q.dtype)).masked_fill(~mask.own, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = ((s - lse[..., None]).exp().to(vp.dtype) @ vp)
    return out[:, :, :mask.tokens], lse[:, :, :mask.tokens]


@contextlib.contextmanager
def stand_in(device: str = "cuda", flex_op=None, as_dtype: torch.dtype = torch.bfloat16):
    """Tests only: CPU tensors take ``device``'s rows of the table, each kernel's device ops
    replaced by CPU ops of the same contract (flash-attn's [B, T, H, D] layout included;
    FlexAttention by ``flex_op``, default :func:`math_op`, the same math differentiable on
    CPU). Dtypes the device has no row for (float64 on CUDA) take ``as_dtype``'s row, so a
    float64 run checks the bf16 path's code exactly. Yields a Counter of op calls by kernel
    name. Restored on exit."""
    from collections import Counter

    calls: Counter = Counter()

    def counted(name, fn):
        def op(*a):
            calls[name] += 1
            return fn(*a)
        return op

    cpu_ops = {"cuda_flash": dict(fwd=lambda q, k, v, c, s: _cpu_fwd(q, k, v, c, None, s),
                                  bwd=lambda d, q, k, v, o, l, c, s: _cpu_bwd(d, q, k, v, o, l, c, None, s)),
               "flash_attn": dict(fwd=_standin_flash_attn_fwd, bwd=_standin_flash_attn_bwd),
               "flex": dict(fwd=flex_op or math_op)}
    cpu_ops["cuda_efficient"] = cpu_ops["cuda_flash"]
    saved = []
    for kernels in TABLE.values():
        for k in kernels:
            if k.name in cpu_ops and all(k is not s[0] for s in saved):
                saved.append((k, k.ops))
                k.ops = {n: counted(k.name, f) for n, f in cpu_ops[k.name].items()}
    added = [(device, dt, kind) for dt in CPU_DTYPES for kind in KINDS
             if (device, dt, kind) not in TABLE and (device, as_dtype, kind) in TABLE]
    for key in added:
        TABLE[key] = TABLE[(device, as_dtype, key[2])]
    _device_override["cpu"] = device
    try:
        yield calls
    finally:
        _device_override.pop("cpu", None)
        for key in added:
            del TABLE[key]
        for k, ops in saved:
            k.ops = ops


def _standin_flash_attn_fwd(q, k, v, causal, scale):  # [B, T, H, D], lse [B, H, T]
    t = lambda x: x.transpose(1, 2)
    out, lse = _cpu_fwd(t(q), t(k), t(v), causal, None, scale)
    return t(out), lse


def _standin_flash_attn_bwd(dout, q, k, v, out, lse, causal, scale):
    t = lambda x: x.transpose(1, 2)
    return tuple(t(g) for g in _cpu_bwd(t(dout), t(q), t(k), t(v), t(out), lse, causal, None, scale))

"""Test stand-ins for device kernels: a GPU's code paths run on CPU, up to the op call.

* :func:`stand_in`: CPU tensors take a device's rows of the split attention's kernel table
  (:data:`dta.model.attention_kernels.TABLE`), each kernel's device ops replaced by CPU ops of
  the same contract: the shared code (layout transposes, grouped-query repeats, the
  FlexAttention bucket padding and re-forward backward, the log-sum-exp merge) runs as it will
  on the device.
* :func:`gdn_stand_in`: a device's Gated DeltaNet segment kernels
  (:data:`dta.model.gdn_kernels.KERNELS`) are :func:`hf_loop_op` / :func:`loop_conv_op`:
  flash-linear-attention's varlen contracts, one segment at a time through transformers'
  own chunked delta rule and torch's depthwise conv1d.

The library never imports this module.
"""
from __future__ import annotations

import contextlib

import torch

from dta.model import attention_kernels
from dta.model.attention_kernels import (
    CPU_DTYPES,
    KINDS,
    TABLE,
    FlexMask,
    _cpu_bwd,
    _cpu_fwd,
    _lse_dtype,
    repeat_kv,
)
from dta.model.gdn_kernels import SegmentKernel, row


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
    """CPU tensors take ``device``'s rows of the table, each kernel's device ops
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
    real = attention_kernels.device_type
    attention_kernels.device_type = lambda x: device if real(x) == "cpu" else real(x)
    try:
        yield calls
    finally:
        attention_kernels.device_type = real
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


def hf_loop_op(query, key, value, g, beta, initial_state=None, output_final_state=True,
               cu_seqlens=None, use_qk_l2norm_in_kernel=True, **_):
    """The varlen contract on any device, one segment at a time through transformers' own
    ``torch_chunk_gated_delta_rule`` (the stand-in of flash-linear-attention's kernel)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    if value.shape[2] != query.shape[2]:  # grouped value heads: the kernel's contract (FLA's,
        # and HF's own from 5.23) takes q/k per key head; HF's kernel before 5.23 did not
        query, key = (x.repeat_interleave(value.shape[2] // x.shape[2], dim=2) for x in (query, key))
    cu = cu_seqlens.tolist()
    outs, finals = [], []
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        o, f = torch_chunk_gated_delta_rule(
            query[:, a:b], key[:, a:b], value[:, a:b], g[:, a:b], beta[:, a:b],
            initial_state=initial_state[i:i + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(f)
    return torch.cat(outs, dim=1), torch.cat(finals)


def loop_conv_op(x, weight, bias=None, initial_state=None, cu_seqlens=None, activation=None,
                 output_final_state=False, **_):
    """The conv contract on any device, one segment at a time through torch's depthwise
    ``conv1d`` over [the initial state's last W - 1 inputs | the segment] (the stand-in of
    flash-linear-attention's kernel)."""
    if activation is not None or output_final_state:
        raise ValueError("the pack path asks for the conv before its activation, no final state")
    cu = cu_seqlens.tolist()
    D, W = weight.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    outs = []
    for i in range(len(cu) - 1):
        seg = torch.cat([initial_state[i, :, 1:].transpose(0, 1), x[0, cu[i]:cu[i + 1]]])
        y = torch.nn.functional.conv1d(seg.to(acc).t().unsqueeze(0), weight.to(acc).unsqueeze(1),
                                       None if bias is None else bias.to(acc), groups=D)
        outs.append(y[0].t())
    return torch.cat(outs).unsqueeze(0).to(x.dtype), None


def gdn_stand_in(op=hf_loop_op, device: str = "cuda", conv=loop_conv_op):
    """``device``'s GDN kernels are ``op`` and ``conv`` (run under :func:`stand_in`, CPU
    tensors take that device's row)."""
    return row(device, [SegmentKernel("stand-in", op, conv=conv)])

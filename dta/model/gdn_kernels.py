"""Gated DeltaNet kernels by device: flash-linear-attention's chunked gated delta rule on CUDA.

The pure-torch pack path (:func:`dta.model.gdn.tree_delta_rule`) runs the delta rule over a
pack's *segments* (maximal fork-free runs of nodes) as a wavefront of batched chunks. On a GPU
with flash-linear-attention installed, each *level* of segments (those whose parent segment's
final state is known) is one varlen call of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
(``cu_seqlens``: one sequence per segment, ``initial_state``: its parent segment's final state
or the pack's initial state), which returns every segment's output and final state: the same
recurrence, computed by the fused kernel. :func:`segment_kernel` picks it from one table keyed
by device type (``KERNELS``); elsewhere (CPU, or no flash-linear-attention) the pure-torch path
runs. The causal conv stays the pack path's gather (``dta.model.gdn.tree_conv``: every row's
window on its root path at once); causal-conv1d's kernel slides along one sequence and is not
used in a pack (docs/gpu.md).

A kernel is held to the pure-torch path before training: the walker's self-check
(``dta.selfcheck``) runs one GDN layer over a probe pack with both on the model's device and
refuses a mismatch beyond the dtype's tolerance (:func:`compare`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


def _fla_op():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _fla_available() -> bool:
    try:
        _fla_op()
    except ImportError:
        return False
    return True


@dataclass
class SegmentKernel:
    """``op(q, k, v, g, beta, initial_state=[N, H, dk, dv], output_final_state=True,
    cu_seqlens=[N + 1], use_qk_l2norm_in_kernel=True) -> (out [1, L, H, dv], final [N, ...])``
    with q, k, v [1, L, H, d] (flash-linear-attention's contract)."""

    name: str
    op: Callable | None = None  # None: imported when first used
    available: Callable[[], bool] = lambda: True

    def __call__(self, *args, **kwargs):
        op = self.op if self.op is not None else _fla_op()
        return op(*args, **kwargs)


KERNELS: dict[str, list[SegmentKernel]] = {"cuda": [SegmentKernel("fla", None, _fla_available)]}


def segment_kernel(t: torch.Tensor) -> SegmentKernel | None:
    """The GDN kernel for tensors like ``t`` (None: the pure-torch pack path)."""
    from dta.model.attention_kernels import device_type

    for k in KERNELS.get(device_type(t), ()):
        if k.available():
            return k
    return None


def hf_loop_op(query, key, value, g, beta, initial_state=None, output_final_state=True,
               cu_seqlens=None, use_qk_l2norm_in_kernel=True, **_):
    """The varlen contract on any device, one segment at a time through transformers' own
    ``torch_chunk_gated_delta_rule`` (the stand-in of flash-linear-attention's kernel)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

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


@contextlib.contextmanager
def stand_in(op=hf_loop_op, device: str = "cuda"):
    """Tests only: ``device``'s GDN kernel is ``op`` (run under
    ``dta.model.attention_standins.stand_in``, CPU tensors take that device's row)."""
    saved = KERNELS.get(device)
    KERNELS[device] = [SegmentKernel("stand-in", op)]
    try:
        yield
    finally:
        if saved is None:
            KERNELS.pop(device, None)
        else:
            KERNELS[device] = saved


def kernel_delta_rule(kernel: SegmentKernel, query, key, value, g, beta, init, plan):
    """:func:`dta.model.gdn.tree_delta_rule`'s contract through a segment kernel: level by
    level of the pack's segment tree, one varlen call per level."""
    T, Hk, dk = key.shape
    Hv, dv = value.shape[-2:]
    segs = plan.segments
    n = len(segs)
    depth = np.zeros(n, dtype=np.int64)
    for s in range(n):  # parents come first
        if segs[s, 2] >= 0:
            depth[s] = depth[segs[s, 2]] + 1
    zero = value.new_zeros(1, Hv, dk, dv, dtype=torch.float32)
    start = zero if init is None else init.to(torch.float32).reshape(1, Hv, dk, dv)
    final: list = [None] * n
    outs, order = [], []
    dev = query.device
    for lvl in range(int(depth.max()) + 1 if n else 0):
        level = np.flatnonzero(depth == lvl)
        rows = np.concatenate([np.arange(segs[s, 0], segs[s, 1]) for s in level])
        lengths = segs[level, 1] - segs[level, 0]
        cu = torch.as_tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.long, device=dev)
        states = torch.cat([start if segs[s, 2] < 0 else final[segs[s, 2]] for s in level])
        ix = torch.as_tensor(rows, device=dev)
        pick = lambda x: x.index_select(0, ix).unsqueeze(0)
        o, f = kernel(pick(query), pick(key), pick(value), pick(g), pick(beta),
                      initial_state=states, output_final_state=True, cu_seqlens=cu,
                      use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        order.append(rows)
        for i, s in enumerate(level):
            final[s] = f[i:i + 1].to(torch.float32)
    inverse = torch.as_tensor(np.argsort(np.concatenate(order)), device=dev)
    out = torch.cat(outs).index_select(0, inverse)
    opened = plan.open_segment
    fin = torch.cat([final[int(s)] for s in opened]) if len(opened) else \
        value.new_zeros(0, Hv, dk, dv, dtype=torch.float32)
    return out.to(query.dtype), fin

"""Gated DeltaNet kernels by device: flash-linear-attention's causal conv and chunked gated
delta rule on CUDA.

The pure-torch pack path (``dta.model.gdn``) computes a pack's causal conv as a gather (every
row's window on its root path) and runs the delta rule over the pack's *segments* (maximal
fork-free runs of nodes) as a wavefront of batched chunks. On a GPU with
flash-linear-attention installed both go through its kernels, one segment per varlen sequence:

* the conv is **one** varlen call of ``fla.modules.causal_conv1d.causal_conv1d`` over every
  segment of the pack (segments are contiguous row ranges, in row order), each segment's
  ``initial_state`` the conv window just before it on its root path (its parent segment's last
  inputs, or the pack's initial conv state): a window holds inputs only, so no segment waits
  for another;
* the delta rule is one varlen call of ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` per
  *level* of the segment tree (those whose parent segment's final state is known),
  ``initial_state`` the parent segment's final state or the pack's initial state.

Both kernels return what the pure-torch path returns, and their gradients reach the initial
states (the parent's cached states). :func:`segment_kernel` picks the kernels from one table
keyed by device type (``KERNELS``); elsewhere (CPU, or no flash-linear-attention) the
pure-torch path runs. A kernel is held to the pure-torch path before training: the walker's
self-check (``dta.selfcheck``) runs one GDN layer over a probe pack with branches both ways on
the model's device and refuses a mismatch beyond the dtype's tolerance
(``dta.model.gdn_check.compare``).
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


def _fla_conv():
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


def _fla_available() -> bool:
    try:
        _fla_op()
        _fla_conv()
    except ImportError:
        return False
    return True


@dataclass
class SegmentKernel:
    """A device's GDN kernels, flash-linear-attention's contracts (q, k, v [1, L, H, d]; x
    [1, L, D]; one sequence per segment, ``cu_seqlens`` [N + 1]):

    * ``op(q, k, v, g, beta, initial_state=[N, H, dk, dv], output_final_state=True,
      cu_seqlens=..., use_qk_l2norm_in_kernel=True) -> (out [1, L, H, dv], final [N, ...])``;
    * ``conv(x, weight=[D, W], bias=[D] or None, initial_state=[N, D, W], cu_seqlens=...,
      activation=None) -> (y [1, L, D] before the activation, final or None)``.

    None: imported when first used."""

    name: str
    op: Callable | None = None
    available: Callable[[], bool] = lambda: True
    conv: Callable | None = None

    def __call__(self, *args, **kwargs):
        op = self.op if self.op is not None else _fla_op()
        return op(*args, **kwargs)

    def causal_conv(self, *args, **kwargs):
        op = self.conv if self.conv is not None else _fla_conv()
        return op(*args, **kwargs)


KERNELS: dict[str, list[SegmentKernel]] = {"cuda": [SegmentKernel("fla", None, _fla_available)]}


def segment_kernel(t: torch.Tensor) -> SegmentKernel | None:
    """The GDN kernel for tensors like ``t`` (None: the pure-torch pack path)."""
    from dta.model.attention_kernels import device_type

    for k in KERNELS.get(device_type(t), ()):
        if k.available():
            return k
    return None


@contextlib.contextmanager
def row(device: str, kernels: list):
    """``KERNELS[device]`` is ``kernels`` for the duration (then as it was)."""
    saved = KERNELS.get(device)
    KERNELS[device] = kernels
    try:
        yield
    finally:
        if saved is None:
            KERNELS.pop(device, None)
        else:
            KERNELS[device] = saved


def kernel_conv(kernel: SegmentKernel, src, weight, bias, plan, ix: dict):
    """:func:`dta.model.gdn.tree_conv`'s contract through a conv kernel: one varlen call over
    the pack's rows ``src[K:]``, a sequence per segment, each starting from the conv window
    before it on its root path (gathered from ``src``)."""
    K, n = plan.kernel, len(plan.segments)
    windows = src.index_select(0, ix["window"]).view(n, K, -1).transpose(1, 2).contiguous()
    y, _ = kernel.causal_conv(src[K:].unsqueeze(0), weight=weight, bias=bias, initial_state=windows,
                              output_final_state=False, activation=None,
                              cu_seqlens=ix["segment_bounds"])
    return y[0]


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

"""Optimizer-state offload (``train.offload=optimizer``): the AdamW state and the weights it
steps live in host memory and the step runs there (ZeRO-Offload's split; verl's
``optimizer_offload``), on every sharding mode.

What a mode keeps where (``runtime.sharding.*``; ``state_bytes()['host']`` counts the host's):

- ``replicate``: the model (compute dtype) and its gradients on the device; on the host a
  copy of the trained weights in the dtype the optimizer steps (the compute dtype, or the
  masters' where kept), their gradients and the optimizer state;
- ``zero1``: the compute parameters and their gradients on the device; the fp32 master slice,
  its gradient and the optimizer state on the host;
- ``fsdp`` / ``zero2``: compute-dtype shards only on the device -- FSDP2's layer shards in the
  compute dtype (what each call gathers from) and their fp32 gradient shard (the walk's
  calls summed in fp32, :mod:`.layers`); on the host the fp32 masters of those shards and of
  the vocabulary slice, their gradients and the optimizer state.

A step: the gradients are reduced, their norm taken and clipped on the device (the
collectives run there); then copied device -> host (:func:`to_host`, one synchronization),
the optimizer steps the host tensors, and the updated weights go host -> device
(:func:`to_device`) in the device's dtype. Every operation is the one the device would run,
on the same values: offload changes where the step runs, not what it computes (float64: the
same bits on a CPU-only machine, where host and device are one memory but the tensors are
separate copies).

Host tensors are pinned when CUDA is available, so the copies are asynchronous DMA: a
device -> host copy is waited for (:func:`synchronize`) before the host reads it; a host ->
device copy is ordered on the device's current stream before any later kernel, and its
pinned source is not written again before the next step's synchronization.
"""
from __future__ import annotations

import torch

__all__ = ["HOST", "host_empty", "host_copy", "to_host", "to_device", "synchronize",
           "grads_to_host"]

HOST = torch.device("cpu")


def _pin() -> bool:
    return torch.cuda.is_available()


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor (pinned when CUDA is available)."""
    return torch.empty(tuple(shape), dtype=dtype, device=HOST, pin_memory=_pin())


def host_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy of ``t`` (a separate tensor even where ``t`` is on the host), in
    ``dtype`` (default: ``t``'s); synchronized (ready to read)."""
    out = host_empty(t.shape, dtype or t.dtype)
    out.copy_(t.detach())
    return out


def to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (host) <- ``src`` (device), asynchronous from a CUDA device: call
    :func:`synchronize` before the host reads ``dst``."""
    dst.copy_(src.detach(), non_blocking=src.device.type == "cuda" and dst.is_pinned())


def to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (device) <- ``src`` (host), cast to ``dst``'s dtype; ordered on the device's
    current stream before any later kernel."""
    non_blocking = dst.device.type == "cuda" and src.is_pinned() and src.dtype == dst.dtype
    dst.copy_(src, non_blocking=non_blocking)


def synchronize(device: torch.device) -> None:
    """Wait for the device's pending copies (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def grads_to_host(grads: list, buffers: list, device: torch.device) -> list:
    """The reduced gradients ``grads`` (None: none) into their host ``buffers``, one
    synchronization for all: the host gradients, None where there was none (what an
    offloaded part hands its optimizer)."""
    for g, buf in zip(grads, buffers):
        if g is not None:
            to_host(buf, g)
    synchronize(device)
    return [None if g is None else buf for g, buf in zip(grads, buffers)]

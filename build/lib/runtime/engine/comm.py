"""The collectives a front door needs beyond the step, on the layout's groups.

The step's own communication (the one gradient reduction, the sharding modes' gathers) is
the core's (``runtime.engine.step``, ``runtime.sharding``). A front door also sums a
batch's normalizers or an eval loss over the data-parallel ranks, waits for its peers
around a checkpoint, or broadcasts weights to an inference server's group: those calls are
here, so that the adapters (``runtime/areal``, ``runtime/verl``) call no ``torch.distributed``
collective themselves. Each is a no-op without an initialized process group (one process).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["active", "all_reduce", "barrier", "broadcast", "rank", "world_size"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def active() -> bool:
    """Whether ``torch.distributed`` is initialized (else every call here is local)."""
    return dist.is_available() and dist.is_initialized()


def rank(group=None) -> int:
    return dist.get_rank(group) if active() else 0


def world_size(group=None) -> int:
    return dist.get_world_size(group) if active() else 1


def all_reduce(tensor: torch.Tensor, group=None, op: str = "sum") -> torch.Tensor:
    """``tensor`` reduced over ``group`` (None: the world) in place, and returned."""
    if op not in _OPS:
        raise ValueError(f"unknown reduction {op!r}; one of {', '.join(_OPS)}")
    if active() and world_size(group) > 1:
        dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def barrier(group=None) -> None:
    if active() and world_size(group) > 1:
        dist.barrier(group=group)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """``tensor`` from global rank ``src`` to every rank of ``group``, in place."""
    if active():
        dist.broadcast(tensor, src=src, group=group)
    return tensor

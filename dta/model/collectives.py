"""The two single-tensor collectives DTA's sharding and expert parallelism call, on every
torch of the supported range (docs/versions.md).

torch 2.13 names them ``all_gather_single`` / ``reduce_scatter_single`` and deprecates
``all_gather_into_tensor`` / ``reduce_scatter_tensor``; torch 2.9-2.12 (AReaL 1.0.4 pins
torch < 2.11) has only the older two. Same arguments, same result. Each is looked up on
``torch.distributed`` at call time, so a counter that patches the module
(``experiments.comm_count``) sees the call under the name this torch uses.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group=None) -> None:
    """``output`` (``world`` x ``input``'s elements) = every rank's ``input``, in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, *,
                          op=dist.ReduceOp.SUM, group=None) -> None:
    """``output`` = this rank's slice of the sum (``op``) of every rank's ``input``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=op, group=group)

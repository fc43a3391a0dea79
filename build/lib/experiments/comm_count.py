"""Count a rank's collectives by process group: which ``torch.distributed`` calls it makes,
over which ranks, and how many bytes it hands them -- for the HSDP tests and
``experiments/bench_hsdp.py`` (counts, not timings).

:class:`CommCounter` patches ``torch.distributed``'s collective functions for the duration of
a ``with`` block (every caller -- the sharding modes, FSDP2's collectives, DCP -- looks them up
on the module at call time) and records, per call, the op, the group's ranks and the bytes of
its input (``all_reduce``: the tensor; a reduce-scatter: its input; an all-gather: its
output; a broadcast: the tensor). It only observes: the calls run unchanged.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

OPS = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
       "all_gather_into_tensor", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single",
       "barrier")


def _bytes(op: str, args, kwargs) -> int:
    def nbytes(t):
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        if isinstance(t, (list, tuple)):
            return sum(nbytes(x) for x in t)
        return 0

    if op in ("reduce_scatter_single", "reduce_scatter_tensor"):
        t = args[1] if len(args) > 1 else kwargs.get("input")
    elif op == "all_to_all_single":
        t = args[1] if len(args) > 1 else kwargs.get("input")
    elif op == "barrier":
        return 0
    else:
        t = args[0] if args else kwargs.get("tensor", kwargs.get("output_tensor"))
    return nbytes(t)


class CommCounter:
    """``with CommCounter() as c: ...`` then ``c.calls`` (op, ranks, bytes) and
    :meth:`by_group`."""

    def __init__(self):
        self.calls: list[tuple[str, tuple[int, ...], int]] = []
        self._saved: dict = {}

    def __enter__(self):
        for op in OPS:
            fn = getattr(dist, op, None)
            if fn is None:
                continue
            self._saved[op] = fn
            setattr(dist, op, self._wrap(op, fn))
        return self

    def __exit__(self, *exc):
        for op, fn in self._saved.items():
            setattr(dist, op, fn)
        self._saved = {}

    def _wrap(self, op, fn):
        def wrapped(*args, **kwargs):
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
            self.calls.append((op, ranks, _bytes(op, args, kwargs)))
            return fn(*args, **kwargs)
        return wrapped

    def by_group(self, groups: dict[str, tuple[int, ...]]) -> dict:
        """{name: {"calls": Counter(op), "bytes": total}} for the named groups' ranks (a
        call over other ranks counts under "other")."""
        out = {name: {"calls": Counter(), "bytes": 0} for name in (*groups, "other")}
        for op, ranks, nbytes in self.calls:
            name = next((n for n, r in groups.items() if tuple(r) == ranks), "other")
            out[name]["calls"][op] += 1
            out[name]["bytes"] += nbytes
        return out

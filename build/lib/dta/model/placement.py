"""Where a walk's pieces live: which rows of a pack, which heads of a layer this process holds.

The walker and the model interface never see a process group. They ask a *placement*:

  part(T)              the rows of a T-row pack this process forwards (a contiguous range;
                       a process with no row of a short pack forwards one *phantom* row, whose
                       results no one reads, so that every process runs the same calls)
  kv_rows(T)           the rows of a T-row pack whose attention K/V this process stores
  attention_layer      the cache layer of one attention layer's pack forward
  recurrent_layer      the cache layer of one Gated DeltaNet layer's pack forward
  mask(...)            the pack's attention mask argument
  total / combine      a walk's per-process figures made the whole pack's (a sum over the
                       processes that share the walk; nothing alone)
  gather_rows          per-row values of a pack, from every process's rows
  stored               the K/V leaves a pack hands its descendants (counted where it matters)

:class:`Whole` is the placement of a process that walks alone: every row and head, the
walk's own cache layers (``dta.model.attention.PathLayer``, ``dta.model.hf_cache.
PackStateLayer``) and masks. Context parallelism (``dta.model.context_parallel``) is another
placement, applied to the model from outside; :func:`placement_of` reads what was applied.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

ATTRIBUTE = "_dta_placement"  # set on a model by dta.model.context_parallel.parallelize_context


class ContextParallelError(ValueError):
    """A context-parallel walk that cannot run exactly: refused before training
    (``dta.model.context_parallel`` re-exports it)."""


@dataclass(frozen=True)
class PackPart:
    """This process's rows of a ``tokens``-row pack: real rows ``lo..hi-1`` (every row is real
    on exactly one process); ``phantom``: no real row, the process forwards one stand-in row
    (the pack's last) whose outputs are discarded."""

    tokens: int
    lo: int
    hi: int

    @property
    def real(self) -> int:
        return self.hi - self.lo

    @property
    def phantom(self) -> bool:
        return self.hi == self.lo

    @property
    def rows(self) -> slice:
        """The rows this process forwards (its real rows, or the phantom row)."""
        return slice(self.tokens - 1, self.tokens) if self.phantom else slice(self.lo, self.hi)

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.tokens

    def pad(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` over the real rows (along ``dim``), with the phantom row appended as zeros."""
        if not self.phantom:
            return x
        shape = list(x.shape)
        shape[dim] = 1
        return torch.cat([x, x.new_zeros(shape)], dim=dim)


class Whole:
    """A process that walks alone: it holds every row and every head."""

    size = 1
    partial_gradients = False

    def part(self, tokens: int) -> PackPart:
        return PackPart(int(tokens), 0, int(tokens))

    def kv_rows(self, tokens: int) -> tuple[int, int]:
        return 0, int(tokens)

    def attention_layer(self, parts: list, layout):
        from dta.model.attention import PathLayer

        return PathLayer(parts)

    def recurrent_layer(self, initial, plan, positions: int):
        from dta.model.hf_cache import PackStateLayer

        return PackStateLayer(initial, plan, positions)

    def mask(self, layout, model, device, dtype, support):
        from dta.model.packmask import pack_mask

        return pack_mask(layout, model, device, dtype, support)

    def total(self, value: float) -> float:
        return value

    def combine(self, tensors: list) -> None:
        """Every process's entries of ``tensors`` (each written by one process), in place."""

    def gather_rows(self, x: torch.Tensor, part: PackPart) -> torch.Tensor:
        return x

    def stored(self, leaves: list, kinds: list) -> list:
        return leaves


WHOLE = Whole()


def placement_of(model):
    """The placement applied to ``model`` (``dta.model.context_parallel.parallelize_context``),
    or :data:`WHOLE`."""
    return getattr(model, ATTRIBUTE, None) or WHOLE


@contextlib.contextmanager
def alone(model):
    """Inside, ``model`` walks in this process alone (the self-check's probe: the walker's path
    against the model's own, in one process); its placement is restored afterwards."""
    placement = getattr(model, ATTRIBUTE, None)
    if placement is None:
        yield model
        return
    delattr(model, ATTRIBUTE)
    try:
        yield model
    finally:
        object.__setattr__(model, ATTRIBUTE, placement)

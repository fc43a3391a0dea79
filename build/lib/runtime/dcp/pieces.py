"""Logical tensors for DCP: a tensor of its whole shape of which this rank holds arbitrary
pieces, saved and loaded through ``torch.distributed.checkpoint``'s own re-sharding.

DCP stores a tensor as chunks (boxes: offsets and sizes in the whole tensor) and, on load,
reads for every box a rank asks for the overlapping parts of whatever boxes were saved
(``create_read_items_for_chunk_list``) -- at any world size, in any cut. Its built-in
tensor types cut regularly (``DTensor``: by a device mesh's placements); a flat shard
(zero1, fsdp's vocabulary) holds an arbitrary range ``[start, stop)`` of a parameter's
row-major elements, which is not one box. :class:`LogicalTensor` says what a rank holds of
one tensor as a list of boxes, each with the local tensor holding its data, through DCP's
checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``); a flat
range becomes at most ``2 * ndim - 1`` boxes (:func:`flat_boxes`). The two planners
(:class:`SavePlanner`, :class:`LoadPlanner`: DCP's default ones) look a logical tensor's
boxes up by their offsets. A box held by several ranks (replicas) is written once (DCP's
``dedup_save_plans``), and DCP's own check that the saved boxes tile every tensor exactly
(``_validate_global_plan``) stands.

Pure torch: no model, no sharding mode (:mod:`runtime.sharding.logical` builds these from a mode).
"""
from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["LogicalTensor", "flat_boxes", "SavePlanner", "LoadPlanner"]


def flat_boxes(shape, start: int, stop: int) -> list[tuple[tuple, tuple, int]]:
    """The boxes ``(offsets, sizes, first flat element)`` that tile elements ``[start, stop)``
    of a row-major tensor of ``shape``, in order (each box is a contiguous run of them)."""
    shape = tuple(int(s) for s in shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    r0, s0 = divmod(start, inner)
    r1, s1 = divmod(stop, inner)
    rest = (0,) * (len(shape) - 1)
    if r0 == r1:  # within one row: the row's own boxes
        return [((r0, *o), (1, *s), r0 * inner + f) for o, s, f in flat_boxes(shape[1:], s0, s1)]
    out = []
    if s0:  # the first row's tail
        out += [((r0, *o), (1, *s), r0 * inner + f)
                for o, s, f in flat_boxes(shape[1:], s0, inner)]
        r0 += 1
    if r1 > r0:  # whole rows
        out.append(((r0, *rest), (r1 - r0, *shape[1:]), r0 * inner))
    if s1:  # the last row's head
        out += [((r1, *o), (1, *s), r1 * inner + f) for o, s, f in flat_boxes(shape[1:], 0, s1)]
    return out


class LogicalTensor:
    """A tensor of ``shape`` of which this rank holds the boxes in ``chunks``
    (``offsets -> local tensor of the box's sizes``, views into the rank's own storage: a
    save reads them, a load writes into them). Empty: this rank holds none of it."""

    def __init__(self, shape):
        self.shape = torch.Size(tuple(int(s) for s in shape))
        self.dtype: torch.dtype | None = None  # the boxes' (one dtype)
        self.chunks: dict[tuple, torch.Tensor] = {}

    def add_box(self, offsets, local: torch.Tensor) -> None:
        offsets = tuple(int(o) for o in offsets)
        if len(offsets) != len(self.shape) or any(
                o < 0 or o + s > n for o, s, n in zip(offsets, local.shape, self.shape)):
            raise ValueError(f"box at {offsets} of sizes {tuple(local.shape)} lies outside a "
                             f"tensor of shape {tuple(self.shape)}")
        if offsets in self.chunks:
            raise ValueError(f"two boxes at {offsets} of one tensor on one rank")
        if self.dtype not in (None, local.dtype):
            raise ValueError(f"boxes of {self.dtype} and {local.dtype} in one tensor")
        self.dtype = local.dtype
        self.chunks[offsets] = local

    def add_range(self, start: int, flat: torch.Tensor) -> None:
        """Elements ``[start, start + flat.numel())`` of the row-major tensor, held in the
        1-D (contiguous) ``flat``."""
        if flat.dim() != 1:
            raise ValueError(f"a flat range is held in a 1-D tensor, not {tuple(flat.shape)}")
        for offsets, sizes, first in flat_boxes(self.shape, start, start + flat.numel()):
            a = first - start
            self.add_box(offsets, flat[a:a + math.prod(sizes)].view(sizes))

    def size(self) -> torch.Size:
        return self.shape

    def chunk(self, offsets) -> torch.Tensor:
        key = tuple(int(o) for o in offsets)
        if key not in self.chunks:
            raise ValueError(f"no box at {key} of this logical tensor on this rank")
        return self.chunks[key]

    # ----------------------------------------------------- DCP's checkpointable protocol --
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        out = []
        for offsets, local in self.chunks.items():
            out.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                               sizes=torch.Size(local.shape)),
                    properties=TensorProperties(dtype=self.dtype), size=self.shape)))
        return out

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(t.shape))
                for o, t in self.chunks.items()]


def _lookup(state_dict: dict, index: MetadataIndex):
    obj = state_dict.get(index.fqn)
    if isinstance(obj, LogicalTensor):
        return obj.chunk(index.offset)
    return None


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds a :class:`LogicalTensor`'s boxes."""

    def lookup_object(self, index: MetadataIndex):
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also finds a :class:`LogicalTensor`'s boxes (the
    data is copied into them, cast to their dtype)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up initializes meta tensors in place and turns every value it
        # does not know into None: the logical tensors are set aside meanwhile.
        aside: list[tuple[dict, str, LogicalTensor]] = []

        def hide(d: dict) -> None:
            for k, v in d.items():
                if isinstance(v, LogicalTensor):
                    aside.append((d, k, v))
                    d[k] = 0
                elif isinstance(v, dict):
                    hide(v)

        hide(state_dict)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            for d, k, v in aside:
                d[k] = v
        if aside:  # the planner's flattened view: the logical tensors again
            from torch.distributed.checkpoint._traverse import get_element

            for fqn in list(self.state_dict):
                path = self.mappings.get(fqn, (fqn,)) if self.flatten_state_dict else (fqn,)
                value = get_element(self.original_state_dict, path)
                if isinstance(value, LogicalTensor):
                    self.state_dict[fqn] = value

    def lookup_tensor(self, index: MetadataIndex):
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found

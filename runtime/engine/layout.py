"""``ParallelLayout``: how one run is laid out over its ranks, decided once.

World size W, context-parallel size C (ranks per tree), data-parallel size W / C, the
sharding mode (a registered ``runtime.sharding`` mode, resolved: never ``auto``) and this
rank. Ranks ``[g·C, (g+1)·C)`` form context-parallel group g (they walk the same trees, their
path K/V spread over the group); the ranks with the same place in their groups form a
data-parallel group. Sharded state always spans the whole world.

Built and validated once, from any front door's configuration (:meth:`ParallelLayout.make`,
naming the front door's keys in its errors): ``dta train``'s ``ray.num_workers`` /
``train.context_parallel`` / ``train.sharding`` (``runtime.engine.resolve``), AReaL's
``fsdp:dNcM`` + ``actor.dta.sharding``, verl's ``ulysses_sequence_parallel_size`` + its
sharding option; then passed unchanged (:meth:`at` gives each rank its copy).

After ``torch.distributed`` is up, :func:`build_groups` makes the layout's process groups once
(:class:`ProcessGroups`), and :func:`reduction_of` says who reduces what
(:class:`Reduction`), reading the model's context-parallel contract in one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

__all__ = ["ParallelLayout", "LayoutError", "ProcessGroups", "Reduction", "build_groups",
           "reduction_of"]


class LayoutError(ValueError):
    """A layout that cannot run: one line naming the front door's key."""


KEYS = {"world": "world size", "context_parallel": "context-parallel size",
        "sharding": "sharding mode", "rank": "rank"}


@dataclass(frozen=True)
class ParallelLayout:
    world: int = 1
    context_parallel: int = 1
    sharding: str = "replicate"
    rank: int = 0

    def __post_init__(self):
        from runtime.sharding import registered

        def bad(field, need):
            raise LayoutError(f"bad {KEYS[field]}: {getattr(self, field)!r} must be {need}")

        for field, low in (("world", 1), ("context_parallel", 1), ("rank", 0)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                bad(field, f"an integer >= {low}")
        if self.world % self.context_parallel:
            bad("context_parallel", f"a divisor of the world size {self.world} (the "
                                    "data-parallel size is world / context parallel)")
        if self.rank >= self.world:
            bad("rank", f"below the world size {self.world}")
        if self.sharding not in registered():
            bad("sharding", f"one of {registered()} (auto is resolved before the layout)")
        if self.world == 1 and self.sharding != "replicate":
            bad("sharding", "replicate on one rank (nothing to shard): build the layout with "
                            "ParallelLayout.make")

    @classmethod
    def make(cls, *, world: int, context_parallel: int = 1, sharding: str = "replicate",
             rank: int = 0, spelling: Mapping[str, str] | None = None) -> "ParallelLayout":
        """The layout of a front door's settings (one rank: replicate, nothing to shard); an
        error names a setting as ``spelling`` says (field -> the front door's key)."""
        if world == 1 and sharding in _registered():
            sharding = "replicate"
        try:
            return cls(world=world, context_parallel=context_parallel, sharding=sharding,
                       rank=rank)
        except LayoutError as exc:
            msg = str(exc)
            for field, key in (spelling or {}).items():
                msg = msg.replace(f"bad {KEYS[field]}:", f"bad value for {key}:", 1)
            raise LayoutError(msg) from None

    def at(self, rank: int) -> "ParallelLayout":
        """This layout as rank ``rank`` holds it."""
        return dataclasses.replace(self, rank=int(rank))

    # ------------------------------------------------------------------ derived --
    @property
    def data_parallel(self) -> int:
        return self.world // self.context_parallel

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group."""
        return self.rank % self.context_parallel

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group (the share of the batch it walks)."""
        return self.rank // self.context_parallel

    @property
    def head(self) -> int:
        """The first rank of this rank's context-parallel group."""
        return self.rank - self.cp_rank

    @property
    def is_head(self) -> bool:
        return self.rank == self.head

    @property
    def sharded(self) -> bool:
        """Whether the state is split over the ranks (DCP checkpoints)."""
        from runtime.sharding import mode_class

        return mode_class(self.sharding).sharded

    def context_groups(self) -> list[list[int]]:
        C = self.context_parallel
        return [list(range(g * C, (g + 1) * C)) for g in range(self.data_parallel)]

    def data_groups(self) -> list[list[int]]:
        return [list(range(i, self.world, self.context_parallel))
                for i in range(self.context_parallel)]

    def record(self) -> dict:
        """JSON-ready (checkpoint metadata, reports)."""
        return {"world": self.world, "context_parallel": self.context_parallel,
                "data_parallel": self.data_parallel, "sharding": self.sharding}


def _registered() -> tuple[str, ...]:
    from runtime.sharding import registered

    return registered()


# --------------------------------------------------------------- process groups --
@dataclass
class ProcessGroups:
    """The layout's groups on this rank (None where torch.distributed is not up: one rank).
    ``context``: this rank's context-parallel group (its C ranks; one rank when C = 1, the
    model-parallel group AReaL asks for); ``data``: its data-parallel group (the world when
    C = 1); ``cpu``: a gloo group over the world (the world itself when it is gloo)."""

    world: object = None
    context: object = None
    data: object = None
    cpu: object = None


def build_groups(layout: ParallelLayout) -> ProcessGroups:
    """Make the layout's groups (a collective: every rank calls it, in the same order)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if layout.world != 1:
            raise LayoutError(f"a layout of {layout.world} ranks needs torch.distributed "
                              "initialized first")
        return ProcessGroups()
    if dist.get_world_size() != layout.world or dist.get_rank() != layout.rank:
        raise LayoutError(f"the layout says rank {layout.rank} of {layout.world}; "
                          f"torch.distributed runs rank {dist.get_rank()} of "
                          f"{dist.get_world_size()}")
    world = dist.group.WORLD
    gloo = dist.get_backend() == "gloo"
    cpu = world if gloo else dist.new_group(backend="gloo")
    context = data = None
    for ranks in layout.context_groups():  # every rank creates every group
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            context = group
    if layout.context_parallel == 1:
        data = world
    else:
        for ranks in layout.data_groups():
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                data = group
    return ProcessGroups(world=world, context=context, data=data, cpu=cpu)


# ------------------------------------------------------------ who reduces what --
@dataclass(frozen=True)
class Reduction:
    """Who reduces what, on one rank (:func:`reduction_of`). The gradient is always the
    world's SUM: every rank's gradient is its share of the global batch's loss, and a
    context-parallel rank's is its rows' and heads' part of its group's.

    counts_loss / counts_tree: this rank's loss / tree figures enter the run's sums (a
    context-parallel group's head alone: every rank of a group holds the group's loss and
    walked the group's tree).
    """

    counts_loss: bool = True
    counts_tree: bool = True


def reduction_of(layout: ParallelLayout, model) -> Reduction:
    """The one place the model's context-parallel contract is read: with C > 1 the model
    must walk on its group with partial gradients
    (``context_parallel_of(model).partial_gradients``), which the world's SUM adds up; the
    group's loss and tree are reported by its head."""
    from dta.model.context_parallel import context_parallel_of

    if layout.context_parallel == 1:
        return Reduction()
    cp = context_parallel_of(model)
    if cp is None or not bool(getattr(cp, "partial_gradients", False)):
        raise LayoutError(f"context_parallel={layout.context_parallel}: the model does not walk "
                          "on its context-parallel group with partial gradients "
                          "(dta.model.context_parallel.parallelize_context was not applied)")
    return Reduction(counts_loss=layout.is_head, counts_tree=layout.is_head)

"""``DataParallel``: how a ``DTATrainEngine`` is laid out over processes.

Under ``replicate`` every rank holds a full replica of the model; gradients are averaged over
the ranks before the step. This class holds what the training path needs of ``torch.distributed``: the groups
AReaL's ``TrainEngine`` API exposes (data-parallel, model-parallel, the gloo CPU group), the
rank and world size, the model placement (:meth:`prepare_model`) and the gradient reduction
(:meth:`reduce_gradients`). The sharded layouts (``zero1`` / ``fsdp``,
``runtime/areal/sharded.py``) replace these two methods and shard over ``dp_group``: as in
FSDPEngine (no sequence or tensor parallelism), the data-parallel group is the whole world,
``data_parallel_rank`` / ``_world_size`` are the rank and the world size, and each rank heads
its own model-parallel group of one. (The weight-update group to the inference servers is ``rollout.py``'s; DCP's
collectives are ``dcp.py``'s.)
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

__all__ = ["DataParallel", "init_default_group", "strategy_of"]

_REFUSED = ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size")


def strategy_of(backend, parallel_strategy=None):
    """AReaL's ``ParallelStrategy`` from an explicit one or the ``backend`` string
    (``"fsdp:d2"``); refuses model parallelism, which the DFS walker does not do. Context
    parallelism (``fsdp:d1c2``) is the walker's: each group of ``c`` ranks walks the same trees
    with their K/V spread over it (docs/context-parallel.md)."""
    strategy = parallel_strategy
    if strategy is None and isinstance(backend, str) and ":" in backend:
        from areal.api.alloc_mode import ModelAllocation

        strategy = ModelAllocation.from_str(backend).parallel
    if strategy is not None:
        for name in _REFUSED:
            if getattr(strategy, name, 1) > 1:
                raise NotImplementedError(
                    f"DTATrainEngine is data-parallel only; {name}="
                    f"{getattr(strategy, name)} (from {backend or parallel_strategy!r})")
    return strategy


def init_default_group() -> bool:
    """Initialize ``torch.distributed`` if it is not: ``env://`` with the platform's backend
    when ``WORLD_SIZE`` > 1 (as FSDPEngine does), else a one-process group through a file
    store in a fresh temporary directory (nothing listens on a socket). Returns whether it
    initialized the group (then the caller owns it)."""
    if dist.is_initialized():
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from areal.infra.platforms import current_platform

        dist.init_process_group(backend=current_platform.communication_backend)
    else:
        store = os.path.join(tempfile.mkdtemp(prefix="dta-areal-pg-"), "store")
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return True


class DataParallel:
    """Data-parallel replicas over the whole world. ``create`` initializes
    ``torch.distributed`` when it is not, as FSDPEngine does (``env://`` when ``WORLD_SIZE`` >
    1, a file-store group for one process: AReaL's loop, its rollout coordination and its RPC
    workers all call collectives on the default group), and owns it then. Before ``create``
    the groups are ``None`` and the rank is 0."""

    def __init__(self):
        self.rank, self.world_size = 0, 1
        self.context_parallel = 1  # ranks per tree (AReaL's ``c``)
        self.cp_group = None  # this rank's context-parallel group (None: c = 1)
        self.dp_group = self.mp_group = self.cpu_group = None
        self.own_global_group = False
        self.ready = False
        self.partial = False  # context parallel: the group's ranks hold parts of its gradient

    def create(self, backend, parallel_strategy=None) -> None:
        strategy = strategy_of(backend, parallel_strategy)
        if init_default_group():
            self.own_global_group = True
        self.context_parallel = int(getattr(strategy, "context_parallel_size", 1) or 1)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % self.context_parallel:
            raise ValueError(f"context-parallel size {self.context_parallel} (from {backend!r}) "
                             f"does not divide the {world} process(es) running")
        self._make_groups()
        dp = getattr(strategy, "data_parallel_size", None)
        if dp not in (None, self.data_parallel_size):
            raise ValueError(f"data-parallel size {dp} (from {backend!r}) differs from the "
                             f"{self.world_size} process(es) running / context-parallel size "
                             f"{self.context_parallel}")
        self.ready = True

    def ensure_group(self) -> None:
        """The process groups, made now if ``create`` has not run."""
        if self.dp_group is not None:
            return
        if init_default_group():
            self.own_global_group = True
        self._make_groups()

    def _make_groups(self) -> None:
        if dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.dp_group = dist.group.WORLD
            self.cpu_group = dist.new_group(backend="gloo")
            C = self.context_parallel
            if C == 1:
                for r in range(self.world_size):  # every rank creates every group
                    group = dist.new_group([r])
                    if r == self.rank:
                        self.mp_group = group
                return
            # context parallel: ranks [g·C, (g+1)·C) walk the same trees (their model-parallel
            # group, headed by g·C); the ranks with the same place in their groups are a
            # data-parallel group (the gradient average)
            for g in range(self.world_size // C):
                group = dist.new_group(list(range(g * C, (g + 1) * C)))
                if g == self.rank // C:
                    self.mp_group = self.cp_group = group
            for i in range(C):
                group = dist.new_group(list(range(i, self.world_size, C)))
                if i == self.rank % C:
                    self.dp_group = group

    @property
    def head(self) -> int:
        """The rank that heads this rank's replica: itself, or the first rank of its
        context-parallel group."""
        return self.rank - self.rank % self.context_parallel

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // self.context_parallel

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.context_parallel

    def prepare_model(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """Place the model for training: a full replica on ``device`` (context parallel:
        walking with its K/V spread over this rank's group)."""
        from dta.model.context_parallel import parallelize_context
        from runtime.engine.layout import ParallelLayout, reduction_of

        model = parallelize_context(model.to(device), self.cp_group)
        layout = ParallelLayout(world=self.world_size, context_parallel=self.context_parallel,
                                rank=self.rank)
        self.partial = reduction_of(layout, model).partial  # read once, by the engine's rule
        return model

    def reduce_gradients(self, params) -> None:
        """Average the gradients of ``params`` over the data-parallel ranks (a parameter
        without a gradient contributes zeros)."""
        if self.dp_group is None or (self.data_parallel_size == 1 and not self.partial):
            return
        # partial gradients (context parallel): the group's gradient is the sum of its
        # ranks' parts, so the sum runs over the whole world
        group = dist.group.WORLD if self.partial else self.dp_group
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(self.data_parallel_size)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks, in place (no-op on one process)."""
        if self.dp_group is not None:
            dist.all_reduce(tensor, group=self.dp_group)
        return tensor

    def barrier(self) -> None:
        if self.cpu_group is not None:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if dist.is_initialized() and self.own_global_group:
            self.barrier()
            dist.destroy_process_group()
            self.own_global_group = False


class GroupsMixin:
    """What AReaL's ``TrainEngine`` asks about process groups, answered by the engine's
    :class:`DataParallel` (``self.parallel``)."""

    def create_process_group(self, parallel_strategy=None):
        """Data-parallel groups, initializing ``torch.distributed`` if needed (see
        :class:`~runtime.areal.parallel.DataParallel`)."""
        self.parallel.create(getattr(self.config, "backend", None), parallel_strategy)

    @property
    def own_global_group(self) -> bool:
        return self.parallel.own_global_group

    @property
    def rank(self) -> int:
        return self.parallel.rank

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @property
    def data_parallel_group(self):
        return self.parallel.dp_group

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel.data_parallel_rank

    @property
    def data_parallel_world_size(self) -> int:
        return self.parallel.data_parallel_size

    def current_data_parallel_head(self) -> int:
        return self.parallel.head

    def is_data_parallel_head(self) -> bool:
        return self.parallel.rank == self.parallel.head

    @property
    def context_and_model_parallel_group(self):
        return self.parallel.mp_group

    @property
    def cpu_group(self):
        if not self._initialized:
            raise RuntimeError("the engine is not initialized: call initialize() first")
        return self.parallel.cpu_group

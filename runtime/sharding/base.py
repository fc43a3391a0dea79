"""The one interface of a sharding mode, and the registry that names them.

A mode is a registered class (``@register``, as verl's ``EngineRegistry``): the names are
:data:`dta.planning.memory.MODES` -- the modes the memory model prices, the one list the
config, the planner and the runtimes read -- and a registered class for a name the planner
does not price (or a priced name left without a class) is refused when this package is
imported. The engine core (:mod:`runtime.engine`) is the only caller of the step's pieces:

1. ``zero_grad()`` before the walk (fsdp also opens its matched-call session);
2. the walk accumulates this rank's share into the model's ``.grad``;
3. ``reduce_gradients()``: the mode's collective, a SUM over its group (all-reduce,
   reduce-scatter);
4. ``grad_norm()`` (global; a collective where sharded), then the engine's one clip rule
   (``scale_gradients(coef)``) and ``apply_update()``, or ``discard_gradients()`` on a
   non-finite norm.

What else the core asks of a mode is declared here too, never probed: ``sync`` (the
matched-call session of a mode whose ranks' decoder calls must match -- fsdp's
:class:`~runtime.sharding.lockstep.Lockstep` --, else None), hence ``matched_calls`` and
``session()`` (around walks outside a step); ``load_masters(state)`` (the master weights
from whole tensors, after the model's were replaced).

``walk_needs(policy)`` is what the mode asks of the walk (fsdp under retain: one LM-head
flush per pack); it is part of the one resolution of the walk settings
(``runtime.engine.resolve.walk_for_layout``), never patched in afterwards.
"""
from __future__ import annotations

import contextlib
from typing import ClassVar

import torch

from dta.planning.memory import MODES as PRICED

__all__ = ["ShardingMode", "register", "mode_class", "registered"]

_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator: the sharding mode ``name`` (one of the priced modes, once)."""
    def add(cls):
        if name not in PRICED:
            raise ValueError(f"sharding mode {name!r} is not priced by the memory model "
                             f"(dta.planning.memory.MODES: {PRICED})")
        if name in _REGISTRY:
            raise ValueError(f"sharding mode {name!r} is registered twice "
                             f"({_REGISTRY[name].__name__}, {cls.__name__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


def registered() -> tuple[str, ...]:
    """The registered modes, in the planner's order (least communication first)."""
    return tuple(m for m in PRICED if m in _REGISTRY)


def mode_class(name: str) -> type:
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown sharding mode {name!r}; choose one of {registered()}")
    return cls


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """fp32 master weights under 16-bit compute; otherwise the compute dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ShardingMode:
    """What every mode provides (see the module doc). Built on the model in
    :meth:`storage_dtype`; ``make_optimizer(params)`` builds the optimizer over what the mode
    steps."""

    name: ClassVar[str]
    sharded: ClassVar[bool] = True  # state split over the ranks: DCP checkpoints
    holds_frozen: ClassVar[bool] = True  # can hold weights it does not train (a LoRA base)

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    # the matched-call session (runtime.sharding.lockstep.Lockstep) when the ranks' decoder
    # calls must match one for one (fsdp); None: a rank's calls run alone
    sync = None

    @classmethod
    def storage_dtype(cls, compute: torch.dtype, masters: torch.dtype | None = None
                      ) -> torch.dtype:
        """The dtype the model is built in: its master weights' (a sharded mode keeps
        ``master_dtype_for(compute)``; ``masters``, when given, must be that). ``replicate``
        keeps masters only when asked (:mod:`.replicate`)."""
        kept = master_dtype_for(compute) if cls.sharded else compute
        if masters is not None and masters != kept:
            raise ValueError(f"sharding={cls.name} keeps {kept} master weights for "
                             f"{compute} compute, not {masters}")
        return kept

    @classmethod
    def walk_needs(cls, policy: str) -> dict:
        """WalkOptions fields this mode needs under the memory ``policy``."""
        return {}

    # ------------------------------------------------------------- model calls --
    @property
    def matched_calls(self) -> bool:
        """Whether the ranks' decoder calls are kept matched: a model call outside the
        core's walks would unmatch them."""
        return self.sync is not None

    @contextlib.contextmanager
    def session(self):
        """Around walks outside a step (forward / eval): the ranks' decoder calls matched
        for its duration where the mode matches them (inside a step: already open);
        otherwise nothing."""
        sync = self.sync
        if sync is None or sync.active:
            yield
            return
        sync.begin()
        try:
            yield
        except BaseException:
            sync.active = False
            raise
        sync.end()

    # ------------------------------------------------------------------ the step --
    def zero_grad(self) -> None:
        raise NotImplementedError

    def reduce_gradients(self) -> None:
        raise NotImplementedError

    def grad_norm(self) -> float:
        raise NotImplementedError

    def scale_gradients(self, coef: float) -> None:
        raise NotImplementedError

    def apply_update(self) -> None:
        raise NotImplementedError

    def discard_gradients(self) -> None:
        raise NotImplementedError

    # --------------------------------------------------------------- reporting --
    def state_bytes(self) -> dict:
        raise NotImplementedError

    def param_norm(self) -> float:
        raise NotImplementedError

    def full_state(self) -> dict:
        raise NotImplementedError

    def sharded_state(self) -> dict:
        raise NotImplementedError

    def load_masters(self, state: dict) -> None:
        """The master weights (where the mode keeps any) from whole tensors by parameter
        name, after the model's own weights were replaced by them."""
        raise NotImplementedError

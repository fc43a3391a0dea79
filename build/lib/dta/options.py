"""``WalkOptions``: every setting of the depth-first walk, defaulted and validated here only.

A run's walk settings are built once -- by the config layer (``dta.config.walk``: the run
config's ``walker.*`` keys, ``walker.block_tokens=auto`` resolved there), by a CLI command, by
the AReaL adapter's ``DTAOptions``, or from keywords -- and then passed along unchanged:
driver -> worker -> :func:`dta.train.accumulate_gradients` / :class:`dta.train.DFSTrainer` /
:func:`dta.train.forward_logprobs` -> :class:`dta.walk.Walker`. A new setting is one field
here. The object is frozen; ``dataclasses.replace(options, field=value)`` validates again.

Errors name the setting as its caller spelled it: :meth:`WalkOptions.make` takes a
``spelling`` (field -> what the user wrote: a config key such as ``config key
'walker.block_tokens'``, a CLI flag such as ``--block-tokens``, ``actor.dta.logits_chunk``);
without one a setting is named by its keyword.

This module imports no model code (the run config is validated without torch).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from dta.planning.packs import PACKINGS, PackCost

__all__ = ["WalkOptions", "WalkOptionError", "POLICIES", "PACKINGS", "ROUTER_AUX_LOSS", "AUTO",
           "NO_CUT"]

POLICIES = ("retain", "recompute")  # memory policies (dta/walk.py: Retain, Recompute)
# router_aux_loss: one of these, or a coefficient > 0 (dta.model.modeling.check_router_aux_loss)
ROUTER_AUX_LOSS = ("refuse", "exclude")
# the split attention's kernels (dta.model.attention_kernels: the table's rows per device)
ATTENTION_BACKENDS = ("auto", "torch", "flash_attn")
# ``block_tokens`` as a run config may give it: the memory model's choice for the budget when
# one is set (runtime.engine.resolve), else the field's default (dta.config.walk.walk_options)
AUTO = "auto"
# ``block_tokens`` that never cuts a node: the one spelling, in settings, configs, flags and
# reports alike (None is refused: it is not a block)
NO_CUT = 0


class WalkOptionError(ValueError):
    """A bad walk setting. ``field``: the WalkOptions field; ``key``: how it is named in the
    message (the caller's spelling: keyword, config key or CLI flag)."""

    def __init__(self, field: str, value: Any, need: str | None, key: str | None = None):
        self.field, self.value, self.need, self.key = field, value, need, key or field
        super().__init__(f"bad value for {self.key}: {value!r} must be {need}" if need else
                         f"unknown walk setting {self.key}; the settings are " +
                         ", ".join(WalkOptions.names()))

    def spelled(self, spelling: Mapping[str, str] | None) -> "WalkOptionError":
        """The same error, naming the setting as ``spelling`` says (unchanged if it does not)."""
        if not spelling or self.field not in spelling:
            return self
        return WalkOptionError(self.field, self.value, self.need, spelling[self.field])


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, (float, np.floating))) and not isinstance(v, bool)


@dataclass(frozen=True)
class WalkOptions:
    """Every setting of the walk (:class:`dta.walk.Walker`).

    policy: the memory policy: ``retain`` keeps each pack's graph along the current path;
        ``recompute`` keeps only the detached K/V and re-forwards a pack at its pop.
    packing: the pack policy of :func:`dta.planning.packs.plan_packs` (``node`` walks node by
        node, ``tree`` forwards the whole tree in one masked call, ``auto`` the cost model's).
    pack_tokens: the cap of a pack in tokens (None: :func:`dta.planning.packs.default_cap`, by
        memory policy and the longest sequence); capped at ``block_tokens``.
    block_tokens: the longest piece of a node forwarded in one call (``dta.planning.blocks``;
        the default is AReaL-DTA's examples' ``dta_block_size``); ``NO_CUT`` (0): never cut.
    head_rows: queued LM-head rows that force a flush (None: ``logits_chunk``; 0: every
        pack's head at its push).
    logits_chunk: rows of ``[rows, vocab]`` logits the LM head materializes at a time.
    temperature: log-probs of ``logits / temperature``.
    router_aux_loss: the MoE router's load-balancing loss, one choice: a coefficient > 0 adds
        every sequence's load-balancing loss times it, as per-sequence training does
        (``dta/model/router_aux.py``, docs/moe.md); ``refuse`` (off) raises at ``train`` when
        the model's config asks for it (``dta.model.modeling.check_router_aux_loss``);
        ``exclude`` (off) trains the policy loss without it. :attr:`router_aux_coef` is the
        coefficient (0 when off).
    native_gqa: the attention backend of the walk: True runs ``sdpa`` models on ``dta_sdpa``
        (``dta.model.attention``: SDPA's grouped-query path, and forwards over cached keys
        split at the cache boundary); False leaves the model's own attention.
    attention_backend: the split attention's kernels under ``native_gqa``
        (``dta.model.attention_kernels``): ``auto`` takes each device row's first available
        kernel, ``torch`` only torch's own ops, ``flash_attn`` requires flash-attn for the
        unmasked and causal pieces on CUDA (docs/gpu.md).
    min_shared: the shortest prefix worth sharing in the prefix tree (``dta.tree``).
    pack_cost: the cost model of ``packing=auto`` (None: the model's FLOPs,
        :meth:`dta.planning.packs.PackCost.from_config`).
    """

    policy: str = "retain"
    packing: str = "auto"
    pack_tokens: int | None = None
    block_tokens: int = 2048
    head_rows: int | None = None
    logits_chunk: int = 1024
    temperature: float = 1.0
    router_aux_loss: str | float = "refuse"
    native_gqa: bool = True
    attention_backend: str = "auto"
    min_shared: int = 1
    pack_cost: PackCost | None = None

    def __post_init__(self):
        def bad(field, need):
            raise WalkOptionError(field, getattr(self, field), need)

        def choice(field, allowed):
            if getattr(self, field) not in allowed:
                bad(field, "one of " + ", ".join(allowed))

        def count(field, low, need, optional=False):
            v = getattr(self, field)
            if v is None and optional:
                return
            if not _is_int(v) or v < low:
                bad(field, need)
            object.__setattr__(self, field, int(v))

        choice("policy", POLICIES)
        choice("packing", PACKINGS)
        count("pack_tokens", 1, "a positive number of tokens (or None: by memory policy)", True)
        count("block_tokens", NO_CUT, f"a positive number of tokens, or {NO_CUT} for no cut")
        count("head_rows", 0, "a number of rows >= 0 (or None: logits_chunk)", True)
        count("logits_chunk", 1, "a number of rows >= 1")
        count("min_shared", 1, "a number of tokens >= 1")
        if not _is_number(self.temperature) or not self.temperature > 0:
            bad("temperature", "> 0")
        object.__setattr__(self, "temperature", float(self.temperature))
        if _is_number(self.router_aux_loss):
            if not self.router_aux_loss > 0:
                bad("router_aux_loss", "a coefficient > 0, or one of " + ", ".join(ROUTER_AUX_LOSS))
            object.__setattr__(self, "router_aux_loss", float(self.router_aux_loss))
        elif self.router_aux_loss not in ROUTER_AUX_LOSS:
            bad("router_aux_loss", "one of " + ", ".join(ROUTER_AUX_LOSS) + ", or a coefficient > 0")
        if not isinstance(self.native_gqa, (bool, np.bool_)):
            bad("native_gqa", "true or false")
        object.__setattr__(self, "native_gqa", bool(self.native_gqa))
        choice("attention_backend", ATTENTION_BACKENDS)
        if self.pack_cost is not None and not isinstance(self.pack_cost, PackCost):
            bad("pack_cost", "a dta.planning.packs.PackCost (or None: the model's FLOPs)")

    # ------------------------------------------------------------------ building --
    @classmethod
    def make(cls, spelling: Mapping[str, str] | None = None, **values) -> "WalkOptions":
        """WalkOptions from ``values`` (the others default), an error naming a setting as
        ``spelling`` (field -> the user's name for it) says; an unknown field is an error."""
        names = cls.names()
        for key in values:
            if key not in names:
                raise WalkOptionError(key, values[key], None).spelled(spelling)
        try:
            return cls(**values)
        except WalkOptionError as exc:
            raise exc.spelled(spelling) from None

    @classmethod
    def given(cls, options: "WalkOptions | None" = None, settings: Mapping[str, Any] | None = None,
              spelling: Mapping[str, str] | None = None) -> "WalkOptions":
        """The options an entry point was given: ``options`` (the same object when no keyword
        setting is added), else built from the keyword ``settings`` (keywords beside
        ``options`` replace its fields)."""
        if options is None:
            return cls.make(spelling, **(settings or {}))
        if not isinstance(options, WalkOptions):
            raise TypeError(f"options must be a dta.options.WalkOptions, got "
                            f"{type(options).__name__}")
        return options.replace(spelling, **settings) if settings else options

    def replace(self, spelling: Mapping[str, str] | None = None, **changes) -> "WalkOptions":
        """A copy with ``changes`` (validated like :meth:`make`)."""
        return type(self).make(spelling, **{**self.as_dict(), **changes})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def default(cls, name: str):
        """The default of field ``name`` (the one place it is written is this class)."""
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f.default
        raise KeyError(f"WalkOptions has no field {name!r}")

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.names()}

    # ------------------------------------------------------------- derived values --
    @property
    def router_aux_coef(self) -> float:
        """The router load-balancing loss's coefficient (0: off, refused or excluded)."""
        return 0.0 if isinstance(self.router_aux_loss, str) else self.router_aux_loss

    @property
    def flush_rows(self) -> int:
        """Queued head rows that force a flush (``head_rows``, default ``logits_chunk``)."""
        return self.logits_chunk if self.head_rows is None else self.head_rows

    @property
    def pack_cap(self) -> int | None:
        """The pack cap given (``pack_tokens``), at most a block; None: by memory policy."""
        if self.pack_tokens is None:
            return None
        return min(self.pack_tokens, self.block_tokens or self.pack_tokens)

"""A run config's walk settings: the ``walker.*`` keys (and ``actor.router_aux_loss_coef``) as
one :class:`dta.options.WalkOptions`, the only place a config becomes walk settings.

``walker.block_tokens=auto`` becomes a block here, once: ``auto_block``, the memory model's
choice when the caller has one (``runtime.engine.resolve``, for ``train.memory_budget_gib``
or ``train.sharding=auto``), else the WalkOptions default. "No cut" is
:data:`dta.options.NO_CUT` (0) wherever it is written. Errors name the config key.
This module never imports torch.
"""
from __future__ import annotations

from dta.config.errors import ConfigError
from dta.options import AUTO, WalkOptionError, WalkOptions

__all__ = ["CONFIG_KEYS", "walk_options"]

# WalkOptions field -> the config key that sets it
CONFIG_KEYS = {"policy": "walker.policy", "logits_chunk": "walker.logits_chunk",
               "temperature": "walker.temperature", "min_shared": "walker.min_shared",
               "block_tokens": "walker.block_tokens",
               "router_aux_loss": "actor.router_aux_loss_coef"}
SPELLING = {field: f"config key '{key}'" for field, key in CONFIG_KEYS.items()}


def walk_options(cfg, *, auto_block: int | None = None) -> WalkOptions:
    """The run's WalkOptions. ``auto_block``: what ``walker.block_tokens=auto`` becomes (the
    memory model's block; ``NO_CUT``: no cut); unset, the WalkOptions default. Raises
    :class:`ConfigError` naming the key of a bad value."""
    values = {}
    for field, key in CONFIG_KEYS.items():
        section, name = key.split(".")
        values[field] = cfg[section][name]
    if values["router_aux_loss"] == 0:  # AReaL's spelling: a coefficient, 0 = off
        values["router_aux_loss"] = WalkOptions.default("router_aux_loss")
    if values["block_tokens"] == AUTO:
        values["block_tokens"] = WalkOptions.default("block_tokens") if auto_block is None \
            else auto_block
    try:
        return WalkOptions.make(SPELLING, **values)
    except WalkOptionError as exc:
        extra = " (or auto: chosen by the memory model)" if exc.field == "block_tokens" else ""
        raise ConfigError(f"{exc}{extra}") from None

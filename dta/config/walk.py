"""A run config's walk settings: the ``walker.*`` keys (and ``actor.router_aux_loss_coef``) as
one :class:`dta.options.WalkOptions`, the only place a config becomes walk settings.

``walker.block_tokens=auto`` is resolved here once: to the memory model's choice when the
caller has one (``runtime.sharding.auto.resolve``, for ``train.memory_budget_gib`` or
``train.sharding=auto``), else to the WalkOptions default. Errors name the config key.
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
               "router_aux_loss_coef": "actor.router_aux_loss_coef"}
SPELLING = {field: f"config key '{key}'" for field, key in CONFIG_KEYS.items()}


def walk_options(cfg, *, resolved_block: int | None = None) -> WalkOptions:
    """The run's WalkOptions. ``resolved_block``: the memory model's block for
    ``walker.block_tokens=auto`` (0: no cut); None: the WalkOptions default. Raises
    :class:`ConfigError` naming the key of a bad value."""
    values = {}
    for field, key in CONFIG_KEYS.items():
        section, name = key.split(".")
        values[field] = cfg[section][name]
    if values["block_tokens"] == AUTO:
        values["block_tokens"] = WalkOptions.default("block_tokens") if resolved_block is None \
            else resolved_block
    try:
        return WalkOptions.make(SPELLING, **values)
    except WalkOptionError as exc:
        extra = " (or auto: chosen by the memory model)" if exc.field == "block_tokens" else ""
        raise ConfigError(f"{exc}{extra}") from None

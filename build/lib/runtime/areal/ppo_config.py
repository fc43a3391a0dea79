"""AReaL's experiment config with a ``dta:`` block: ``DTAPPOConfig`` is AReaL's ``PPOConfig``
whose ``actor`` (and ``ref``) are ``DTAPPOActorConfig`` — AReaL's ``PPOActorConfig`` plus
``dta: DTAOptions``. Loaded with AReaL's own ``load_expr_config(argv, DTAPPOConfig)`` (YAML +
``key=value`` overrides, OmegaConf-structured), so an unknown key inside ``actor.dta`` is
rejected like any other unknown key."""
from __future__ import annotations

import dataclasses

from areal.api.cli_args import PPOActorConfig, PPOConfig

from runtime.areal.options import DTAOptions

__all__ = ["DTAPPOActorConfig", "DTAPPOConfig", "load_dta_ppo_config"]


@dataclasses.dataclass
class DTAPPOActorConfig(PPOActorConfig):
    """AReaL's ``PPOActorConfig`` plus the DTA walker's options (``actor.dta.policy``,
    ``actor.dta.logits_chunk``, ``actor.dta.min_shared``, ``actor.dta.block_tokens``,
    ``actor.dta.dtype``)."""

    dta: DTAOptions = dataclasses.field(
        default_factory=DTAOptions,
        metadata={"help": "Options of DTA's depth-first prefix-tree walker "
                          "(runtime.areal.DTAOptions)."})


@dataclasses.dataclass
class DTAPPOConfig(PPOConfig):
    """AReaL's ``PPOConfig`` with DTA actor (and reference) configs."""

    actor: DTAPPOActorConfig = dataclasses.field(default_factory=DTAPPOActorConfig)
    ref: DTAPPOActorConfig | None = dataclasses.field(default=None)


def load_dta_ppo_config(argv: list[str]) -> tuple[DTAPPOConfig, str]:
    """``--config file.yaml key=value ...`` as a :class:`DTAPPOConfig` (AReaL's
    ``load_expr_config``; it also points AReaL's name-resolve at ``cluster.name_resolve``)."""
    from areal.api.cli_args import load_expr_config

    return load_expr_config(argv, DTAPPOConfig)

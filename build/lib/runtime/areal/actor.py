"""``DTAPPOActor``: AReaL's own ``PPOActor`` (compute_logp, compute_advantages, ppo_update,
``grpo_loss_fn``) running on :class:`~runtime.areal.engine.DTATrainEngine`.

The same shape as AReaL's ``FSDPPPOActor`` (an engine that owns a ``PPOActor`` built on
itself), so code written for ``FSDPPPOActor`` — e.g. ``PPOTrainer``'s calls
``compute_logp`` → ``prox_logp``, ``compute_advantages``, ``ppo_update``,
``step_lr_scheduler``, ``set_version`` — runs unchanged. No PPO logic lives here.
"""
from __future__ import annotations

from typing import Any

import torch
from areal.api.cli_args import PPOActorConfig

from runtime.areal.engine import DTAOptions, DTATrainEngine

__all__ = ["DTAPPOActor"]


class DTAPPOActor(DTATrainEngine):
    """PPO actor on the DFS engine: ``PPOActor(config, self)``."""

    def __init__(self, config: PPOActorConfig, dta: DTAOptions | None = None):
        from areal.trainer.ppo.actor import PPOActor

        super().__init__(config, dta)
        self.actor = PPOActor(config, self)

    @torch.no_grad()
    def compute_logp(self, *args, **kwargs) -> list[torch.Tensor] | None:
        return self.actor.compute_logp(*args, **kwargs)

    @torch.no_grad()
    def compute_advantages(self, *args, **kwargs) -> list[dict[str, Any]]:
        return self.actor.compute_advantages(*args, **kwargs)

    def ppo_update(self, *args, **kwargs) -> None:
        self.actor.ppo_update(*args, **kwargs)

    @classmethod
    def as_controller(cls, config: PPOActorConfig, scheduler):
        """AReaL's single-controller actor: a ``PPOActorController`` whose workers each
        create this class (by its import path ``runtime.areal.actor.DTAPPOActor``)."""
        if getattr(config, "_version", "v1") == "v2":
            from areal.trainer.ppo.actor import PPOActorControllerV2

            return PPOActorControllerV2(train_engine=cls, config=config, scheduler=scheduler)
        from areal.trainer.ppo.actor import PPOActorController

        return PPOActorController(train_engine=cls, config=config, scheduler=scheduler)

"""``DTAPPOTrainer``: AReaL's own ``PPOTrainer`` (GRPO/PPO loop, rollout, weight updates,
saving, recovery, stats) with DTA as the train engine.

AReaL picks train engines with a hard-coded ``if/elif`` on ``fsdp|megatron|archon``
(``PPOTrainer._create_train_engine``), so DTA plugs in by subclassing: the actor, and the
reference model when one is configured (``ref`` with ``actor.kl_ctl > 0``), are
:class:`~runtime.areal.actor.DTAPPOActor`. An AReaL training script runs with DTA by changing
one import (``from runtime.areal import DTAPPOTrainer as PPOTrainer``); the DTA options are the
``actor.dta`` block of :class:`~runtime.areal.ppo_config.DTAPPOConfig` (a plain ``PPOConfig``
works too: then the options are the defaults).

What differs from ``PPOTrainer``:

* the train engines (above); critics are refused (DTA trains actors);
* ``inference_engine=``: an optional factory ``(rollout_config, is_eval) -> InferenceEngine``,
  or ``"smoke"`` for :class:`~runtime.areal.smoke_engine.SmokeInferenceEngine` (CPU smoke runs
  and tests, one training process) instead of AReaL's ``RemoteSGLangEngine`` /
  ``RemotevLLMEngine``;
* in SPMD mode (``AREAL_SPMD_MODE=1``, what AReaL's launchers set) a one-process run gets a
  loopback process group (AReaL's loop needs barriers), and AReaL's name-resolve is pointed at
  ``cluster.name_resolve`` (the disk weight-update records);
* AReaL's ``Saver`` decides on asynchronous saving by importing ``ArchonEngine``, which needs
  triton and fails on machines without it (CPU): the trainer's saver never imports it (only
  ``ArchonEngine`` saves asynchronously; DTA saves synchronously, as ``Saver`` falls back to).

In single-controller mode (AReaL's default) the actor is ``DTAPPOActor.as_controller(...)``:
AReaL's ``TrainController`` creates ``runtime.areal.actor.DTAPPOActor`` on its workers.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.distributed as dist
from areal.api.cli_args import InferenceEngineConfig, PPOActorConfig
from areal.trainer.rl_trainer import PPOTrainer
from areal.utils.environ import is_single_controller
from areal.utils.saver import Saver

__all__ = ["DTAPPOTrainer"]


class _SyncSaver(Saver):
    """AReaL's ``Saver`` without the ``ArchonEngine`` import in ``_should_use_async``."""

    def _should_use_async(self, engine) -> bool:
        if self._async_mode.value == "async":
            from areal.utils.logging import getLogger

            getLogger("Saver").warning("asynchronous checkpoints are ArchonEngine-only; "
                                       "%s saves synchronously", type(engine).__name__)
        return False


class DTAPPOTrainer(PPOTrainer):
    """``PPOTrainer`` on DTA (see the module doc)."""

    def __init__(self, config, train_dataset=None, valid_dataset=None, *,
                 inference_engine: str | Callable[[InferenceEngineConfig, bool], Any]
                 | None = None):
        if getattr(config, "critic", None) is not None:
            raise NotImplementedError("DTAPPOTrainer trains actors; a critic (config.critic) "
                                      "is not supported — use GRPO-style advantages "
                                      "(critic: null)")
        if not (inference_engine is None or inference_engine == "smoke"
                or callable(inference_engine)):
            raise ValueError(f"inference_engine must be None (AReaL's remote SGLang/vLLM "
                             f"engine), 'smoke' or a factory (rollout_config, is_eval) -> "
                             f"InferenceEngine; got {inference_engine!r}")
        if inference_engine == "smoke" and is_single_controller():
            raise ValueError("the smoke inference engine runs in this process, in AReaL's SPMD "
                             "mode: set AREAL_SPMD_MODE=1 (the example's --smoke does)")
        self._inference_engine = inference_engine
        self._own_group = False
        if not is_single_controller():
            from areal.utils import name_resolve

            from runtime.areal.parallel import init_default_group

            name_resolve.reconfigure(config.cluster.name_resolve)
            self._own_group = init_default_group()
        try:
            super().__init__(config, train_dataset, valid_dataset)
        except BaseException:
            self._destroy_own_group()
            raise
        saver = _SyncSaver(self.saver.config, self.saver.ft_spec)
        saver.load_state_dict(self.saver.state_dict())  # recovery may have restored it
        self.saver = saver

    # ---------------------------------------------------------------- engines --
    def _create_train_engine(self, actor_config: PPOActorConfig, alloc):
        from runtime.areal.actor import DTAPPOActor

        if alloc.backend != "fsdp":
            raise ValueError(f"DTAPPOTrainer runs DTA on AReaL's 'fsdp' allocations "
                             f"(backend 'fsdp:dN'), got backend {alloc.backend!r}")
        if is_single_controller():
            actor = DTAPPOActor.as_controller(actor_config, self.scheduler)
        else:
            actor = DTAPPOActor(actor_config)
        actor.create_process_group(parallel_strategy=alloc.parallel)
        return actor

    def _create_critic(self, critic_config, alloc):
        raise NotImplementedError("DTAPPOTrainer does not train critics")

    def _init_rollout(self, rollout_config: InferenceEngineConfig, is_eval: bool = False,
                      lora_path: str | None = None):
        factory = self._inference_engine
        if factory is None:
            return super()._init_rollout(rollout_config, is_eval=is_eval, lora_path=lora_path)
        if factory == "smoke":
            from runtime.areal.smoke_engine import SmokeInferenceEngine

            if dist.is_initialized() and dist.get_world_size() > 1:
                raise ValueError(f"the smoke inference engine serves one training process; "
                                 f"this run has {dist.get_world_size()} (disk weight updates "
                                 "reach rank 0's engine only, as they reach a shared server)")

            engine = SmokeInferenceEngine(rollout_config, self.config.actor.path,
                                          seed=self.config.seed, lora_path=lora_path)
        else:  # a custom factory with LoRA gets the initial adapter's folder
            engine = factory(rollout_config, is_eval) if lora_path is None else \
                factory(rollout_config, is_eval, lora_path=lora_path)
        if not engine.initialized:
            engine.initialize(train_data_parallel_size=self.actor_alloc.parallel.dp_size)
        return engine

    def close(self):
        try:
            super().close()
        finally:
            self._destroy_own_group()

    def _destroy_own_group(self):
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False

"""AReaL backend: DTA's depth-first prefix-tree training behind AReaL's ``TrainEngine`` API.

``from runtime.areal import DTATrainEngine`` (and ``DTAPPOActor``, ``DTAOptions``,
``actor_config_from_dta`` for a ``dta`` run config, ``DTAPPOTrainer`` / ``DTAPPOConfig`` for
AReaL's own RL loop, ``SmokeInferenceEngine`` for CPU smoke runs). areal is an
optional extra (see README.md in this directory for the install recipe); the ``dta`` library
never imports it. Names are imported lazily, so ``import runtime.areal`` alone costs nothing.
"""
import importlib

_EXPORTS = {
    "DTATrainEngine": "runtime.areal.engine",
    "DTAOptions": "runtime.areal.options",
    "DTAPPOActor": "runtime.areal.actor",
    "actor_config_from_dta": "runtime.areal.config",
    "DTAPPOTrainer": "runtime.areal.trainer",
    "DTAPPOConfig": "runtime.areal.ppo_config",
    "DTAPPOActorConfig": "runtime.areal.ppo_config",
    "load_dta_ppo_config": "runtime.areal.ppo_config",
    "SmokeInferenceEngine": "runtime.areal.smoke_engine",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runtime.areal' has no attribute {name!r}")

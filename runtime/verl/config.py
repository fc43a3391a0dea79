"""The dta engine's configuration: verl's ``FSDPEngineConfig`` with ``strategy: dta`` and the
walk's options under ``dta``.

A verl user switches an actor to DTA with one value, ``strategy: dta`` (verl picks the engine
class by ``EngineRegistry.get_engine_cls(model_type, engine_config.strategy)``); every other
engine key keeps its meaning where the dta engine has one (``model_dtype``,
``mixed_precision``, ``param_offload`` ...; :func:`check_engine_config` refuses the ones it
cannot honour). The walk's options (:class:`dta.options.WalkOptions`: ``policy``,
``block_tokens``, ``packing``, ``pack_tokens``, ``logits_chunk``, ``min_shared`` ...) go in
``dta``, validated by :class:`~dta.options.WalkOptions` itself (an unknown key is an error
naming it); ``temperature`` comes from each batch, as verl's engines take it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from dta.model.models import resolve_dtype
from dta.options import WalkOptions
from verl.workers.config import FSDPEngineConfig
from verl.workers.config.engine import EngineConfig

__all__ = ["DTAEngineConfig", "walk_options", "model_dtype", "check_engine_config"]

# verl's dtype spellings (verl.utils.torch_dtypes) and the one it lacks, for verification
_DTYPES = {"fp32": "float32", "32": "float32", "bf16": "bfloat16", "fp16": "float16",
           "16": "float16", "fp64": "float64", "64": "float64"}


@dataclass
class DTAEngineConfig(FSDPEngineConfig):
    """``FSDPEngineConfig`` plus ``dta``: the walk's options (``dta.options.WalkOptions``
    fields but ``temperature``). In verl's config: ``actor_rollout_ref.actor.fsdp_config.
    _target_=runtime.verl.DTAEngineConfig`` and ``+...fsdp_config.dta.<option>=<value>``."""

    strategy: str = "dta"
    dta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        # FSDPEngineConfig's own check accepts fsdp strategies only; verl's actor config
        # writes its ``strategy`` into the engine config after building it (FSDPActorConfig),
        # so the engine itself checks for ``dta`` (check_engine_config)
        EngineConfig.__post_init__(self)
        walk_options(self)  # the walk's options are checked when the config is built


def walk_options(engine_config, *, gradient_checkpointing: bool = False) -> WalkOptions:
    """The walk's options from ``engine_config.dta`` (absent on a plain ``FSDPEngineConfig``:
    every option at its default). ``policy`` unset follows verl's
    ``enable_gradient_checkpointing`` (``recompute``), as the AReaL adapter does."""
    given = dict(getattr(engine_config, "dta", None) or {})
    if "temperature" in given:
        raise ValueError("engine_config.dta.temperature: the temperature comes from each batch "
                         "(verl's rollout.temperature), not from the engine config")
    if "policy" not in given and gradient_checkpointing:
        given["policy"] = "recompute"
    spelling = {name: f"engine_config.dta.{name}" for name in (*WalkOptions.names(), *given)}
    return WalkOptions.make(spelling, **given)


def model_dtype(engine_config) -> torch.dtype:
    """The dtype the model is held and computed in: ``model_dtype`` (verl spellings, or
    ``fp64`` for verification, which verl's own engines lack)."""
    name = str(engine_config.model_dtype)
    return resolve_dtype(_DTYPES.get(name, name))


def check_engine_config(engine_config) -> None:
    """Refuse, naming the key, what the dta engine does not do (before anything loads)."""
    def refuse(key, why):
        raise NotImplementedError(f"engine_config.{key}={getattr(engine_config, key)!r}: {why}")

    if engine_config.strategy != "dta":
        refuse("strategy", "the dta engine is selected by strategy=dta")
    if engine_config.param_offload or engine_config.optimizer_offload:
        refuse("param_offload" if engine_config.param_offload else "optimizer_offload",
               "the dta engine keeps its model and optimizer on the device (no offload)")
    if engine_config.ulysses_sequence_parallel_size != 1:
        refuse("ulysses_sequence_parallel_size", "the dta engine is data-parallel only")
    mp = engine_config.mixed_precision
    if mp is None or mp.get("param_dtype") is None:  # verl's FSDP engine would autocast: say so
        warnings.warn(f"engine_config.mixed_precision.param_dtype is unset: verl's FSDP engine "
                      f"would compute in bfloat16 there; the dta engine computes in "
                      f"model_dtype={engine_config.model_dtype!r} (no autocast)", stacklevel=2)
    elif mp.get("param_dtype") is not None:
        want = model_dtype(engine_config)
        got = resolve_dtype(_DTYPES.get(str(mp["param_dtype"]), str(mp["param_dtype"])))
        if got != want:
            raise NotImplementedError(
                f"engine_config.mixed_precision.param_dtype={mp['param_dtype']!r} with "
                f"model_dtype={engine_config.model_dtype!r}: the dta engine computes in "
                "model_dtype (no autocast); set both to the same dtype")
    if getattr(engine_config, "qat", None) is not None and engine_config.qat.enable:
        refuse("qat", "quantization-aware training is not supported by the dta engine")

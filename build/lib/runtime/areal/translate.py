"""AReaL's ``TrainEngineConfig`` (+ :class:`~runtime.areal.options.DTAOptions`) as the engine
core's inputs: the model spec, the dtypes, the walk, the optimizer factory -- and the core
itself (:func:`make_core`), built on the layout ``create_process_group`` made.

- the model: ``config.path`` (a local Hugging Face folder; ``init_from_scratch``: its config,
  random weights), ``attn_impl``; LoRA (``use_lora``, ``lora_rank``, ``lora_alpha``,
  ``target_modules``) by the core's one rule (``runtime.engine.lora_targets``: unset, empty or
  ``all-linear`` adapt every linear layer but the LM head, as FSDPEngine's peft wrapper);
- the dtypes: compute ``config.dtype``, master weights ``config.optimizer_dtype`` (AReaL's
  default: bf16 compute, fp32 masters, as FSDP2's ``MixedPrecisionPolicy``), both overridden
  by ``actor.dta.dtype`` (float64 for verification, which AReaL's config rejects); an engine
  without an optimizer keeps no masters;
- the walk: ``actor.dta`` with AReaL's ``temperature`` and the memory policy from
  ``gradient_checkpointing`` (``runtime.engine.policy_of``), settled for the layout once by
  the engine (``runtime.engine.settle``, the one function that makes a ``RunSettings``).
"""
from __future__ import annotations

import torch

from dta.model.models import resolve_dtype
from dta.options import WalkOptions
from runtime.areal.optimizer import optimizer_factory
from runtime.engine import EngineCore, LoraSpec, ModelSpec, RunSettings, build_model, policy_of

__all__ = ["model_spec", "requested_walk", "make_core"]


def model_spec(config) -> ModelSpec:
    lora = None
    if bool(getattr(config, "use_lora", False)):
        lora = LoraSpec(r=int(config.lora_rank), alpha=float(config.lora_alpha),
                        targets=config.target_modules)
    return ModelSpec(path=config.path, attn_implementation=config.attn_impl,
                     init_from_scratch=bool(config.init_from_scratch), lora=lora)


def requested_walk(config, dta) -> WalkOptions:
    """The walk ``actor.dta`` asks for (before the layout's needs are settled in)."""
    return dta.walk_options(policy=policy_of(dta.policy, bool(config.gradient_checkpointing)),
                            temperature=float(config.temperature))


def make_core(config, dta, settings: RunSettings, groups, device: torch.device) -> EngineCore:
    """The engine core of one rank, parallelized on ``groups`` (the layout's, made by
    ``create_process_group``)."""
    oc = config.optimizer
    compute = resolve_dtype(dta.dtype or config.dtype)
    masters = resolve_dtype(dta.dtype or config.optimizer_dtype) if oc is not None else None
    spec = model_spec(config)
    layout = settings.layout
    try:
        core = EngineCore(lambda dtype: build_model(spec, dtype), layout=layout,
                          walk=settings.walk,
                          make_optimizer=optimizer_factory(oc) if oc is not None
                          else (lambda params: None),
                          compute_dtype=compute, device=device, master_dtype=masters)
    except ValueError as exc:  # the mode's refusal, with the keys that chose it
        if not str(exc).startswith("sharding="):
            raise
        raise ValueError(f"actor.dta.sharding={layout.sharding} (dtype={config.dtype}, "
                         f"optimizer_dtype={config.optimizer_dtype}"
                         f"{', use_lora=True' if spec.lora else ''}): {exc}") from None
    core.model.eval()
    core.parallelize(groups)
    core.model.eval()  # the walks need one deterministic forward: never dropout
    return core

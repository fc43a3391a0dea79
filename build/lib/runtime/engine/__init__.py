"""One engine core behind the front doors (``dta train``'s Ray worker, AReaL, verl).

- :mod:`.layout`: :class:`ParallelLayout` (world, context parallel, data parallel, sharding
  mode, rank), its process groups and who reduces what;
- :mod:`.resolve`: the one resolution of a run's settings (``auto`` priced by the memory
  model with context parallelism, the walk made whole for the layout), :class:`RunSettings`;
- :mod:`.model`: :class:`ModelSpec`, LoRA by one rule;
- :mod:`.core`: :class:`EngineCore` (build, parallelize, shard, walk, reduce, clip, step,
  checkpoints, export);
- :mod:`.step`: the one gradient reduction and the clip / skip rules.

docs/engine.md says what a front door provides.
"""
from runtime.engine.core import EngineCore, StepOutcome
from runtime.engine.layout import LayoutError, ParallelLayout, ProcessGroups, Reporting
from runtime.engine.model import LoraSpec, ModelSpec, build_model, lora_targets
from runtime.engine.resolve import RunSettings, policy_of, resolve_run_config, settle

__all__ = ["EngineCore", "StepOutcome", "LayoutError", "ParallelLayout", "ProcessGroups",
           "Reporting", "LoraSpec", "ModelSpec", "build_model", "lora_targets", "RunSettings",
           "policy_of", "resolve_run_config", "settle"]

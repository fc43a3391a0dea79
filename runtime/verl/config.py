"""The dta engine's configuration: verl's ``FSDPEngineConfig`` with ``strategy: dta``, the
walk's options under ``dta`` and the sharding mode under ``dta_sharding``; and its one
translation into the engine core's settings (:func:`settings_of`).

A verl user switches an actor to DTA with one value, ``strategy: dta`` (verl picks the engine
class by ``EngineRegistry.get_engine_cls(model_type, engine_config.strategy)``); every other
engine key keeps its meaning where the dta engine has one (``model_dtype``,
``mixed_precision``, ``fsdp_size``, ``ulysses_sequence_parallel_size`` ...;
:func:`check_engine_config` refuses the ones it cannot honour). The walk's options
(:class:`dta.options.WalkOptions`: ``policy``, ``block_tokens``, ``packing``, ``pack_tokens``,
``logits_chunk``, ``min_shared`` ...) go in ``dta``, validated by
:class:`~dta.options.WalkOptions` itself (an unknown key is an error naming it);
``temperature`` comes from each batch, as verl's engines take it.

The layout (:func:`layout_of`, validated once by ``runtime.engine.ParallelLayout.make``):

- ``ulysses_sequence_parallel_size`` is the context-parallel size C: groups of C consecutive
  ranks walk one tree together, each rank its rows of every pack and its heads inside
  attention (docs/context-parallel.md), as verl's Ulysses groups divide a micro-batch;
- ``dta_sharding`` (``replicate`` | ``zero1`` | ``zero2`` | ``fsdp``) is how the training state is held;
  unset, it is what verl's FSDP engine does with ``fsdp_size``: ``-1`` (verl's default: shard
  over the whole world) is ``fsdp``, ``1`` (a DDP mesh) is ``replicate``, ``1 < S < W`` is
  HSDP (``fsdp`` sharded within groups of S ranks, replicated across them, as verl's
  ``(W / S, S)`` "ddp" x "fsdp" mesh); one rank holds everything (``replicate``);
- ``fsdp_size`` = S beside ``dta_sharding`` is the shard size S (HSDP; zero1 / fsdp);
  ``-1`` (or the world) shards over the world (under ``replicate``: ``-1`` or the world);
- ``optimizer_offload: true`` keeps the optimizer state (and the masters) in host memory and
  steps it there (``train.offload=optimizer``: runtime/sharding/offload.py), on every mode;
  ``param_offload`` (parameters moved off the device between phases) and ``offload_policy``
  (FSDP2's ``CPUOffloadPolicy``: parameters gathered from host memory per call) are refused.
  ``dta_gradient_offload: true`` beside it (zero2 / fsdp) also sums the walk's per-call
  layer gradients on the host (``train.offload=gradients``); without ``optimizer_offload``
  it is refused, naming both keys.
- ``expert_parallel_size`` (verl's spelling in its FSDP-family engine configs, VeOmni's and
  torchtitan's; Megatron's is ``expert_model_parallel_size``) is the expert-parallel size E:
  groups of E consecutive ranks hold each MoE layer's experts once, 1/E each
  (docs/expert-parallel.md).
- ``forward_prefetch: true`` (verl's own FSDP key) is fsdp's prefetch (``train.prefetch``): the
  next layer's all-gather issued before the current layer computes. verl's FSDP2 engine reads
  it the same way (``verl.utils.fsdp_utils.apply_fsdp2``: FSDP2's explicit
  ``set_modules_to_forward_prefetch``, layer i -> i + 1); the dta engine also prefetches the
  backward's gathers where its walk re-forwards (recompute). One key, verl's: a ``dta_``
  twin would leave ``forward_prefetch`` set and silently unused. Refused (naming it) unless
  the mode is fsdp.
- ``dta_node_resident: true`` is fsdp's node-resident gathers under HSDP (``1 < fsdp_size <
  W``; ZeRO++'s hpZ, ``train.node_resident``): the first gather of a step crosses the shard
  groups once into a copy held inside the group, every later call gathers inside it. verl
  has no such key, so it is ``dta_``-prefixed as ``dta_sharding`` is.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from verl.workers.config import FSDPEngineConfig
from verl.workers.config.engine import EngineConfig

from dta.model.models import resolve_dtype
from dta.options import WalkOptions
from runtime.engine import (
    LayoutError,
    LoraSpec,
    ModelSpec,
    ParallelLayout,
    RunSettings,
    policy_of,
    settle,
)

__all__ = ["DTAEngineConfig", "walk_options", "model_dtype", "dtypes", "check_engine_config",
           "sharding_of", "shard_size_of", "layout_of", "model_spec", "settings_of", "sharding_keys"]

# verl's dtype spellings (verl.utils.torch_dtypes) and the one it lacks, for verification
_DTYPES = {"fp32": "float32", "32": "float32", "bf16": "bfloat16", "fp16": "float16",
           "16": "float16", "fp64": "float64", "64": "float64"}

# ParallelLayout field -> the verl key that sets it (named in the layout's errors)
SPELLING = {"world": "the world size of verl's process group",
            "context_parallel": "engine_config.ulysses_sequence_parallel_size",
            "sharding": "engine_config.dta_sharding",
            "expert_parallel": "engine_config.expert_parallel_size",
            "shard_size": "engine_config.fsdp_size",
            "offload": "engine_config.optimizer_offload",
            "node_resident": "engine_config.dta_node_resident",
            "prefetch": "engine_config.forward_prefetch"}


@dataclass
class DTAEngineConfig(FSDPEngineConfig):
    """``FSDPEngineConfig`` plus ``dta`` (the walk's options: ``dta.options.WalkOptions``
    fields but ``temperature``) and ``dta_sharding`` (``replicate`` | ``zero1`` | ``zero2`` | ``fsdp``;
    None: from ``fsdp_size``, see the module doc). In verl's config:
    ``actor_rollout_ref.actor.fsdp_config._target_=runtime.verl.DTAEngineConfig``,
    ``+...fsdp_config.dta.<option>=<value>`` and ``...fsdp_config.dta_sharding=zero1``."""

    strategy: str = "dta"
    dta: dict[str, Any] = field(default_factory=dict)
    dta_sharding: Optional[str] = None
    dta_node_resident: bool = False  # fsdp under HSDP: hpZ (see the module doc)
    dta_gradient_offload: bool = False  # with optimizer_offload: the gradient sum on the host
    expert_parallel_size: int = 1  # as verl's VeOmni / torchtitan engine configs spell it

    def __post_init__(self):
        # FSDPEngineConfig's own check accepts fsdp strategies only; verl's actor config
        # writes its ``strategy`` into the engine config after building it (FSDPActorConfig),
        # so the engine itself checks for ``dta`` (check_engine_config)
        EngineConfig.__post_init__(self)
        walk_options(self)  # the walk's options are checked when the config is built


def walk_options(engine_config, *, gradient_checkpointing: bool = False) -> WalkOptions:
    """The walk's options from ``engine_config.dta`` (absent on a plain ``FSDPEngineConfig``:
    every option at its default); ``policy`` unset follows verl's
    ``enable_gradient_checkpointing`` (``runtime.engine.policy_of``, the one rule)."""
    given = dict(getattr(engine_config, "dta", None) or {})
    if "temperature" in given:
        raise ValueError("engine_config.dta.temperature: the temperature comes from each batch "
                         "(verl's rollout.temperature), not from the engine config")
    given["policy"] = policy_of(given.get("policy"), gradient_checkpointing)
    spelling = {name: f"engine_config.dta.{name}" for name in (*WalkOptions.names(), *given)}
    return WalkOptions.make(spelling, **given)


def _dtype(name) -> torch.dtype:
    """A verl dtype spelling (or ``fp64``, for verification, which verl's own engines lack)."""
    return resolve_dtype(_DTYPES.get(str(name), str(name)))


def model_dtype(engine_config) -> torch.dtype:
    """``model_dtype``: the dtype verl holds the weights in."""
    return _dtype(engine_config.model_dtype)


def dtypes(engine_config) -> tuple[torch.dtype, torch.dtype | None]:
    """(compute dtype, master dtype or None): verl's ``mixed_precision.param_dtype`` is the
    dtype the model computes in, ``model_dtype`` the one its weights are held and stepped in
    -- fp32 masters under 16-bit compute, as verl's FSDP engine keeps them (the engine core's
    ``master_dtype``); equal, or ``param_dtype`` unset: the model computes in ``model_dtype``
    (None: the sharding mode's own masters). Checked by :func:`check_engine_config`."""
    held = model_dtype(engine_config)
    mp = engine_config.mixed_precision
    compute = _dtype(mp["param_dtype"]) if mp is not None and \
        mp.get("param_dtype") is not None else held
    return compute, (held if held != compute else None)


def check_engine_config(engine_config) -> None:
    """Refuse, naming the key, what the dta engine does not do (before anything loads)."""
    def refuse(key, why):
        raise NotImplementedError(f"engine_config.{key}={getattr(engine_config, key)!r}: {why}")

    if engine_config.strategy != "dta":
        refuse("strategy", "the dta engine is selected by strategy=dta")
    if engine_config.param_offload:
        refuse("param_offload", "the dta engine keeps its model on the device "
               "(optimizer_offload=True keeps the optimizer state in host memory)")
    if engine_config.offload_policy:
        refuse("offload_policy", "the dta engine does not gather parameters from host memory "
               "per call (optimizer_offload=True keeps the optimizer state in host memory)")
    mp = engine_config.mixed_precision
    if mp is None or mp.get("param_dtype") is None:  # verl's FSDP engine would autocast: say so
        warnings.warn(f"engine_config.mixed_precision.param_dtype is unset: verl's FSDP engine "
                      f"would compute in bfloat16 there; the dta engine computes in "
                      f"model_dtype={engine_config.model_dtype!r}", stacklevel=2)
    compute, masters = dtypes(engine_config)
    if masters is not None and (masters != torch.float32 or
                                compute not in (torch.bfloat16, torch.float16)):
        raise NotImplementedError(
            f"engine_config.mixed_precision.param_dtype={mp['param_dtype']!r} with "
            f"model_dtype={engine_config.model_dtype!r}: the dta engine computes in param_dtype "
            "and keeps model_dtype masters for 16-bit compute only (fp32 masters, bf16 / fp16 "
            "compute), or both the same dtype")
    if getattr(engine_config, "qat", None) is not None and engine_config.qat.enable:
        refuse("qat", "quantization-aware training is not supported by the dta engine")


# ------------------------------------------------------------------ the layout --
def sharding_of(engine_config, world: int) -> str:
    """The sharding mode: ``dta_sharding``, or unset what verl's FSDP engine does with
    ``fsdp_size`` (see the module doc)."""
    given = getattr(engine_config, "dta_sharding", None)
    if given is not None:
        return str(given)
    size = int(engine_config.fsdp_size)
    return "replicate" if size == 1 and world > 1 else "fsdp"


def shard_size_of(engine_config, world: int) -> int | None:
    """The HSDP shard size: ``fsdp_size`` where it is one (1 < S < W, or 1 beside
    ``dta_sharding``), else None: the world (``-1``, the world or more; ``fsdp_size`` 1 alone
    is verl's DDP mesh, replicate). The layout validates it, naming ``fsdp_size``."""
    size = int(engine_config.fsdp_size)
    alone = getattr(engine_config, "dta_sharding", None) is None
    if size < 0 or size >= world or (size == 1 and alone):
        return None
    return size


def layout_of(engine_config, *, world: int, rank: int) -> ParallelLayout:
    """This rank's layout: world, ``ulysses_sequence_parallel_size`` as the context-parallel
    size, the sharding mode (:func:`sharding_of`), ``fsdp_size`` as the shard size
    (:func:`shard_size_of`), ``optimizer_offload`` (and ``dta_gradient_offload``),
    ``expert_parallel_size`` as the
    expert-parallel size, ``dta_node_resident`` and ``forward_prefetch`` (fsdp's node-resident
    gathers and prefetch); an error names the verl key."""
    spelling = dict(SPELLING)
    if getattr(engine_config, "dta_sharding", None) is None:
        spelling["sharding"] = f"engine_config.fsdp_size={engine_config.fsdp_size}'s sharding"
    sharding = sharding_of(engine_config, world)
    offload = "optimizer" if engine_config.optimizer_offload else "none"
    if getattr(engine_config, "dta_gradient_offload", False):
        if offload == "none":
            raise LayoutError("bad value for engine_config.dta_gradient_offload: True needs "
                              "engine_config.optimizer_offload=True (the gradient sum goes "
                              "to the host beside the optimizer state)")
        offload, spelling["offload"] = "gradients", "engine_config.dta_gradient_offload"
    return ParallelLayout.make(world=int(world),
                               context_parallel=engine_config.ulysses_sequence_parallel_size,
                               sharding=sharding, rank=int(rank),
                               expert_parallel=getattr(engine_config, "expert_parallel_size", 1),
                               shard_size=shard_size_of(engine_config, world),
                               offload=offload,
                               node_resident=getattr(engine_config, "dta_node_resident", False),
                               prefetch=getattr(engine_config, "forward_prefetch", False),
                               spelling=spelling)


def model_spec(model_config) -> ModelSpec:
    """verl's ``model_config`` as the engine core's model: its local Hugging Face folder, sdpa
    attention, LoRA adapters when ``lora_rank > 0`` (``lora_alpha``, ``target_modules`` by
    the core's one rule, ``runtime.engine.lora_targets``; dropout-free)."""
    path = getattr(model_config, "local_path", None) or model_config.path
    rank = int(getattr(model_config, "lora_rank", 0) or 0)
    lora = None
    if rank > 0:
        for key in ("exclude_modules", "target_parameters", "lora_adapter_path"):
            if getattr(model_config, key, None):
                raise NotImplementedError(f"model_config.{key}={getattr(model_config, key)!r}: "
                                          "not supported by the dta engine's LoRA")
        lora = LoraSpec(r=rank, alpha=float(model_config.lora_alpha),
                        targets=model_config.target_modules)
    return ModelSpec(path=path, attn_implementation="sdpa", lora=lora)


def settings_of(engine_config, model_config, *, world: int, rank: int) -> RunSettings:
    """The run's settings, resolved once: the layout (:func:`layout_of`) and the walk
    (:func:`walk_options`, with what the sharding mode needs: ``runtime.engine.settle``)."""
    layout = layout_of(engine_config, world=world, rank=rank)
    walk = walk_options(engine_config, gradient_checkpointing=bool(
        getattr(model_config, "enable_gradient_checkpointing", False)))
    return settle(walk, layout)


def sharding_keys(engine_config, model_config, layout: ParallelLayout) -> str:
    """The verl keys that chose ``layout``'s sharding mode and what it holds (for the core's
    refusals: a mode that cannot hold a LoRA base, a dtype it does not keep)."""
    chose = f"engine_config.dta_sharding={layout.sharding}" \
        if engine_config.dta_sharding is not None else \
        f"engine_config.fsdp_size={engine_config.fsdp_size} ({layout.sharding})"
    lora = int(getattr(model_config, "lora_rank", 0) or 0)
    return f"{chose}, model_dtype={engine_config.model_dtype}" + \
        (f", model_config.lora_rank={lora}" if lora > 0 else "")

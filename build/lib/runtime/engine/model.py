"""Building a front door's model: one :class:`ModelSpec`, LoRA by one rule.

Every front door describes its model as a :class:`ModelSpec` (``dta train``'s ``model.*``,
AReaL's ``TrainEngineConfig.path`` / ``lora_*``, verl's ``model_config``) and the engine core
builds it with :func:`build_model` in the dtype the layout's sharding mode stores it in.

LoRA targets (:func:`lora_targets`), the one rule for every front door: unset or empty
(``None``, ``[]``), ``"all-linear"`` or ``["all-linear"]`` mean every linear layer but the
LM head (what AReaL's and verl's FSDP engines do); otherwise a list of module names. The
adapters are initialized under ``torch.manual_seed(seed)`` (in a forked random state: the
caller's is untouched), so every rank starts alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ModelSpec", "LoraSpec", "lora_targets", "build_model", "ALL_LINEAR"]

ALL_LINEAR = "all-linear"


def lora_targets(value) -> str | tuple[str, ...]:
    """The adapted modules: ``ALL_LINEAR`` or a tuple of module names (see the module doc)."""
    if value is None or value == ALL_LINEAR:
        return ALL_LINEAR
    if isinstance(value, str):
        raise ValueError(f"LoRA target_modules {value!r}: give a list of module names or "
                         f"{ALL_LINEAR!r}")
    names = tuple(value)
    if not names or names == (ALL_LINEAR,):
        return ALL_LINEAR
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"LoRA target_modules {list(names)!r}: {bad[0]!r} is not a module name")
    return names


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float
    targets: str | tuple[str, ...] = ALL_LINEAR  # lora_targets' answer
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self):
        object.__setattr__(self, "targets", lora_targets(self.targets))


@dataclass(frozen=True)
class ModelSpec:
    """A model to build: a local Hugging Face folder (``path``; ``init_from_scratch``: its
    config, random weights) or a registered family and size (random init from ``seed``)."""

    path: str | None = None
    family: str = "qwen3"
    size: str = "tiny"
    seed: int = 0
    attn_implementation: str = "sdpa"
    init_from_scratch: bool = False
    lora: LoraSpec | None = None


def build_model(spec: ModelSpec, dtype: torch.dtype | str) -> torch.nn.Module:
    """The model of ``spec`` in ``dtype`` (LoRA: the base frozen, the adapters trainable)."""
    from dta.model import models

    if spec.path and spec.init_from_scratch:
        import transformers

        config = transformers.AutoConfig.from_pretrained(spec.path, local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=models.resolve_dtype(dtype),
            attn_implementation=spec.attn_implementation)
    elif spec.path:
        model = models.load_model(spec.path, dtype=dtype,
                                  attn_implementation=spec.attn_implementation)
    else:
        model = models.build_model(spec.family, spec.size, dtype=dtype, seed=int(spec.seed),
                                   attn_implementation=spec.attn_implementation)
    if spec.lora is not None:
        from dta.model.lora import apply_lora

        lo = spec.lora
        targets = lo.targets if lo.targets == ALL_LINEAR else list(lo.targets)
        # every rank's adapters start alike; the caller's random state is left as it was
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(spec.seed))
            model = apply_lora(model, r=int(lo.r), alpha=float(lo.alpha), target_modules=targets,
                               dropout=float(lo.dropout), rslora=bool(lo.rslora))
    return model

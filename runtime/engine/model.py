"""Building a front door's model: one :class:`ModelSpec`, LoRA by one rule.

Every front door describes its model as a :class:`ModelSpec` (``dta train``'s ``model.*``,
AReaL's ``TrainEngineConfig.path`` / ``lora_*``, verl's ``model_config``) and the engine core
builds it with :func:`build_model` in the dtype the layout's sharding mode stores it in.

LoRA targets (:func:`lora_targets`), the one rule for every front door: unset or empty
(``None``, ``[]``), ``"all-linear"`` or ``["all-linear"]`` mean every linear layer but the
LM head (what AReaL's and verl's FSDP engines do); otherwise a list of module names. The
adapters are initialized under ``torch.manual_seed(seed)`` (in a forked random state: the
caller's is untouched), so every rank starts alike.

Buffers (``dta.model.models.raise_buffers``, applied by the engine core): a floating buffer narrower than the compute dtype is raised
to it, none is lowered -- whatever the sharding mode (``replicate`` once cast them with the
parameters, the sharded modes left them as built). Hugging Face builds RoPE's ``inv_freq`` in
float32 whatever the model's dtype (transformers 5.10 and 5.25 measured); verl's FSDP engine
in float64 (``mixed_precision.buffer_dtype=fp64``) holds it in float64. A float64 model whose
``inv_freq`` stayed float32 computes RoPE in float32 where the float64 harness
(``dta.model.models.make_truly_float64``) meets transformers before 5.19
(``inv_freq.float() @ positions.float()``): 2.3e-8 apart in log-probs from the same model with
float64 buffers on transformers 5.10.4 (0 on 5.25, whose RoPE casts both to float32). Under
16-bit compute float32 buffers stay float32, as Hugging Face leaves them.
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

"""LoRA in the dta verl engine: verl's ``disable_adapter`` (its reference policy: the base
model's log-probs, the adapters off) without touching the trained model.

The walker refuses a PEFT model whose adapters are disabled (``dta.model.lora``: it trains the
adapters it is given), so the reference walk runs on a *base view*: the same module tree with
every LoRA layer replaced by its ``base_layer``, sharing every parameter (no copy). It is built
once per model and holds no state of its own.
"""
from __future__ import annotations

import contextlib
import copy
import types

from torch import nn

from dta.model.lora import is_peft_model

__all__ = ["base_view", "ReferencePolicy"]


def _is_lora_layer(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and \
        hasattr(module, "scaling")


def base_view(peft_model) -> nn.Module:
    """The base model of ``peft_model`` with its LoRA layers swapped for their base layers;
    parameters and buffers are shared with ``peft_model`` (modules are shallow copies; a
    method patched onto a module instance is bound to its copy)."""
    def view(module: nn.Module) -> nn.Module:
        if _is_lora_layer(module):
            return view(module.base_layer)
        clone = copy.copy(module)
        clone._modules = {name: None if child is None else view(child)
                          for name, child in module._modules.items()}
        for key, value in vars(module).items():  # methods patched onto the instance
            if isinstance(value, types.MethodType) and value.__self__ is module:
                setattr(clone, key, types.MethodType(value.__func__, clone))
        return clone

    return view(peft_model.get_base_model())


class ReferencePolicy:
    """The model a walk uses: the trained one, or inside :meth:`disabled` its base view."""

    def __init__(self, model):
        self.model, self._base, self.off = model, None, False

    @property
    def current(self):
        if not self.off:
            return self.model
        if self._base is None:
            self._base = base_view(self.model)
        return self._base

    @contextlib.contextmanager
    def disabled(self):
        if not is_peft_model(self.model):
            yield
            return
        self.off = True
        try:
            yield
        finally:
            self.off = False


def merged_weights(peft_model):
    """``(Hugging Face name, base weight + LoRA delta)`` for every tensor of the base model,
    computed out of place (peft's ``merge_adapter`` / ``unmerge_adapter`` would add and
    subtract the delta in place, leaving the base weights a rounding away from where they
    were)."""
    base = peft_model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if _is_lora_layer(module):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    key = f"{name}.base_layer.weight"
                    delta = module.get_delta_weight(adapter).detach()
                    deltas[key] = delta if key not in deltas else deltas[key] + delta
    for key, tensor in base.state_dict().items():
        if "lora_" in key:
            continue
        value = tensor.detach()
        if key in deltas:
            value = value + deltas[key]
        yield key.replace(".base_layer", ""), value

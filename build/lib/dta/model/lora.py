"""LoRA under the walk: which PEFT models the walker trains, and how a LoRA LM head is read.

A ``peft`` LoRA model is an ordinary causal LM to the walker: its base weights are frozen
(``requires_grad=False``, so no gradient is computed into them: the hand-derived head and
embedding paths skip frozen weights, and per-layer states that no trainable weight reaches are
not made autograd leaves, ``dta.model.modeling.ModelInterface.state_needs_grad``), and its adapters
are differentiated by autograd inside the decoder. Two things need this module:

  check_peft_model(model)  refuses, before anything is touched, the PEFT models the walker has
                           not been shown to train exactly: any PEFT type but LoRA, dropout
                           (a dropout mask differs between DFS and per-sequence training),
                           DoRA, LoRA biases, aLoRA, QALoRA, ``modules_to_save`` and trainable
                           token rows (full trainable copies the head/embedding paths do not
                           read), merged or disabled adapters. LoRA and rsLoRA scaling, any
                           rank/alpha pattern, adapters on any linear layer, ``lm_head`` and
                           MoE expert parameters (``target_parameters``) are accepted.
  head_adapters(head)      a LoRA ``lm_head`` as (base Linear, [(A, B, scale)]): logits are
                           h Wᵀ + b + Σ scale · (h Aᵀ) Bᵀ, differentiated by hand in
                           ``dta/model/head.py`` like the base head.

``apply_lora`` wraps a model for ``dta train`` / ``dta verify``; ``save_adapter`` exports it
(peft imported on use only: it is the optional ``lora`` extra). ``merged_weights`` is the
one LoRA merge (base weight + delta, out of place: what a merged export and a rollout's
weight update hold); ``base_view`` the base model sharing the weights (a reference policy's
log-probs with the adapters off).
"""
from __future__ import annotations

import copy
import types

import torch

from dta.model.modeling import ModelInterfaceError


class LoraError(ModelInterfaceError):
    """A PEFT model or LoRA setting the walker cannot train exactly; raised before training."""


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model_class(model) -> str:
    """The wrapped model's class name (the model's own for a plain model)."""
    return type(model.get_base_model() if is_peft_model(model) else model).__name__


# field -> (value the walker needs, why another value is refused)
_REFUSED = {
    "lora_dropout": (0.0, "a dropout mask differs between DFS and per-sequence training"),
    "use_dora": (False, "DoRA's weight norm is not tested under the walk"),
    "lora_bias": (False, "LoRA biases are not tested under the walk"),
    "bias": ("none", "trainable base biases are not tested under the walk"),
    "modules_to_save": (None, "full trainable module copies are not read by the walker's "
                              "head and embedding paths"),
    "trainable_token_indices": (None, "trainable token rows are not read by the walker's "
                                      "embedding path"),
    "alora_invocation_tokens": (None, "aLoRA activates on token positions (not tested)"),
    "use_qalora": (False, "QALoRA is not tested under the walk"),
}


def check_peft_model(model) -> None:
    """Raise LoraError naming the culprit if `model` is a PEFT model the walker refuses."""
    if not is_peft_model(model):
        return
    for name, cfg in model.peft_config.items():
        kind = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "?")))
        if kind != "LORA":
            raise LoraError(f"PEFT adapter {name!r} is {kind}: DTA trains LoRA adapters only "
                            "(the walker is tested exact for LoRA and rsLoRA)")
        for field, (want, why) in _REFUSED.items():
            value = getattr(cfg, field, want)
            if value in (None, [], {}, 0, 0.0, False) and want in (None, 0.0, False):
                continue
            if value != want:
                raise LoraError(f"PEFT adapter {name!r}: {field}={value!r} is refused ({why}); "
                                f"DTA needs {field}={want!r}")
    for mod_name, module in model.named_modules():
        if _is_lora_layer(module):
            if getattr(module, "merged", False):
                raise LoraError(f"{mod_name}: the LoRA adapter is merged into the base weight; "
                                "unmerge it (or train the merged model without peft)")
            if getattr(module, "disable_adapters", False):
                raise LoraError(f"{mod_name}: adapters are disabled; enable them to train")


def _is_lora_layer(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "scaling")


def head_adapters(head):
    """(base Linear, [(A weight [r, H], B weight [V, r], scale)]) of a LoRA ``lm_head``; for a
    plain ``nn.Linear`` head: (head, [])."""
    if not _is_lora_layer(head):
        return head, []
    base = head.base_layer
    if not isinstance(base, torch.nn.Linear):
        raise LoraError(f"the LoRA LM head wraps a {type(base).__name__}; the walker needs a "
                        "linear LM head")
    adapters = []
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        a, b = head.lora_A[name], head.lora_B[name]
        if not (isinstance(a, torch.nn.Linear) and isinstance(b, torch.nn.Linear)) \
                or a.bias is not None or b.bias is not None:
            raise LoraError(f"the LoRA LM head's adapter {name!r} is not a pair of bias-free "
                            "linear maps")
        adapters.append((a.weight, b.weight, float(head.scaling[name])))
    return base, adapters


def apply_lora(model, *, r: int, alpha: float, target_modules, dropout: float = 0.0,
               rslora: bool = False, init_lora_weights=True):
    """Freeze `model` and wrap it with LoRA adapters (peft's ``get_peft_model``)."""
    if dropout != 0:
        raise LoraError(f"model.lora.dropout={dropout}: only 0 is supported (a dropout mask "
                        "differs between DFS and per-sequence training)")
    if int(r) <= 0:
        raise LoraError(f"model.lora.r={r}: the rank must be a positive integer")
    targets = target_modules if target_modules == "all-linear" else \
        [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    if not targets:
        raise LoraError("model.lora.target_modules is empty: name the linear layers to adapt "
                        "(e.g. [q_proj, v_proj])")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # the optional extra
        raise LoraError("LoRA needs peft: pip install -e '.[lora]'") from e
    config = LoraConfig(r=int(r), lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        use_rslora=bool(rslora), init_lora_weights=init_lora_weights)
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise LoraError(f"model.lora.target_modules={targets}: {str(e).splitlines()[0]}") from None


def trained_state(model) -> dict:
    """The tensors a checkpoint holds: every tensor of a plain model; a LoRA model's trained
    (adapter) parameters only -- its base weights come from the base model."""
    state = model.state_dict()
    if not is_peft_model(model):
        return state
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trained}


def save_adapter(model, path: str, *, merged: bool = False) -> None:
    """A LoRA model as peft writes it (``adapter_model.safetensors`` + ``adapter_config.json``,
    loadable by ``PeftModel.from_pretrained``), or with ``merged`` the base model with the
    adapters merged into its weights (:func:`merged_weights`, saved with the base model's
    ``save_pretrained``); the model itself is not changed."""
    if not merged:
        model.save_pretrained(path)
        return
    model.get_base_model().save_pretrained(path, state_dict=dict(merged_weights(model)))


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


def base_view(peft_model) -> torch.nn.Module:
    """The base model of ``peft_model`` with its LoRA layers swapped for their base layers;
    parameters and buffers are shared with ``peft_model`` (modules are shallow copies; a
    method patched onto a module instance is bound to its copy). The walker refuses a PEFT
    model with disabled adapters (it trains the adapters it is given): a reference policy's
    log-probs walk this view."""
    def view(module: torch.nn.Module) -> torch.nn.Module:
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

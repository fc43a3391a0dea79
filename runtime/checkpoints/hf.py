"""Hugging Face folders and per-rank optimizer files -- AReaL's ``hf`` checkpoint format, and
the weights a run starts from: read from a local directory only (nothing is downloaded).

- :func:`local_state_dict`: every tensor of a folder's ``*.safetensors``;
- :func:`load_hf_into_core` / :func:`load_hf_weights`: a folder into the engine core (its
  weights, shards and masters) or into a plain model, every key checked; a LoRA model takes
  a PEFT adapter folder (:func:`load_adapter`);
- :func:`save_optimizer_file` / :func:`load_optimizer_file`: one rank's optimizer state as
  ``optim_world_size_{W}_rank_{r}.pt`` (tensors only: ``runtime.checkpoints.files``);
- :func:`local_tokenizer`: the folder's tokenizer, if it holds one.
"""
from __future__ import annotations

import glob
import os

import torch

__all__ = ["local_tokenizer", "local_state_dict", "is_adapter_dir", "load_adapter",
           "load_hf_into_core", "load_hf_weights", "optimizer_file", "save_optimizer_file",
           "load_optimizer_file"]


def optimizer_file(path: str, world: int, rank: int) -> str:
    """AReaL's per-rank optimizer file in an ``hf`` folder (as FSDPEngine names it)."""
    return os.path.join(path, f"optim_world_size_{world}_rank_{rank}.pt")


def save_optimizer_file(optimizer, path: str, world: int, rank: int) -> None:
    """This rank's optimizer state into the folder ``path`` (a failed write names the file)."""
    from runtime.checkpoints.files import save_tensors

    os.makedirs(path, exist_ok=True)
    save_tensors(optimizer.state_dict(), optimizer_file(path, world, rank))


def load_optimizer_file(optimizer, path: str, world: int, rank: int) -> None:
    """This rank's optimizer state from the folder ``path`` (tensors only)."""
    from runtime.checkpoints.files import load_tensors

    optimizer.load_state_dict(load_tensors(optimizer_file(path, world, rank)))


def local_tokenizer(path: str):
    """The tokenizer saved in a local directory, or None (a weights-only directory: training
    needs no tokenizer)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return None


def local_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files of a local directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path!r} is not a local directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path!r}")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def is_adapter_dir(path: str) -> bool:
    """Whether ``path`` holds a PEFT adapter (``adapter_config.json``) rather than weights."""
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def load_adapter(model, path: str, *, what: str):
    """A PEFT LoRA adapter folder into ``model``: a PEFT model gets its adapter weights
    replaced in place (every key must match), a plain model is wrapped
    (``PeftModel.from_pretrained``). Returns ``(model, state read)``."""
    from peft import PeftModel, load_peft_weights, set_peft_model_state_dict

    if not hasattr(model, "peft_config"):
        model = PeftModel.from_pretrained(model, path, is_trainable=False)
        return model, load_peft_weights(path, device="cpu")
    state = load_peft_weights(path, device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected or not state:
        raise ValueError(f"{what} {path!r} does not match the model's adapters: unexpected "
                         f"{sorted(unexpected)[:5]}{', empty' if not state else ''}")
    return model, state


def load_hf_into_core(core, path: str, *, what: str) -> None:
    """An HF folder into the engine core (its weights, shards and masters): every parameter
    must be there (a tied ``lm_head.weight`` may be absent), nothing else. A LoRA model takes
    an adapter folder (:func:`load_adapter`, in place)."""
    from dta.model.lora import is_peft_model

    model = core.model
    if is_peft_model(model):
        if not is_adapter_dir(path):
            raise ValueError(f"{what} holds no adapter_config.json: a LoRA model loads PEFT "
                             "adapter folders")
        load_adapter(model, path, what=what)
        state = {n: p.detach() for n, p in model.named_parameters()}  # the masters from them
    else:
        state = local_state_dict(path)
    core.load_full_state(state, what=what)


def load_hf_weights(model, path: str, *, what: str) -> dict[str, torch.Tensor]:
    """An HF weights folder into ``model`` in place; every key must match (a tied
    ``lm_head.weight`` may be absent). ``what`` names the folder in the error. Returns the
    state dict read. A PEFT model takes an adapter folder (:func:`load_adapter`)."""
    if hasattr(model, "peft_config"):
        if not is_adapter_dir(path):
            raise ValueError(f"{what} {path!r} holds no adapter_config.json: a LoRA model "
                             "loads PEFT adapter folders")
        return load_adapter(model, path, what=what)[1]
    state = local_state_dict(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = ({"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False)
            else set())
    if unexpected or set(missing) - tied:
        raise ValueError(f"{what} {path!r} does not match the model: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return state

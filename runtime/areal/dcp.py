"""DCP (``torch.distributed.checkpoint``) save/load of a replicated ``DTATrainEngine``: the
``weight_format="dcp"`` that AReaL's ``RecoverHandler`` hard-codes for recover checkpoints.

The layout is FSDPEngine's (``{"dcp": {"model": ..., "optim": ...}}`` written by
``get_state_dict`` / ``set_state_dict``, keys the model's parameter names), with two
differences that make a resumed run continue bit-identically:

* with fp32 master weights (bf16 compute), the *masters* are saved under the parameter names
  (FSDPEngine's sharded parameters are its fp32 masters too), and loading restores the masters
  and casts them into the model;
* the LR scheduler's state is saved beside them (``{"extra": {"lr_scheduler": ...}}``);
  FSDPEngine does not save it, so its schedule restarts on recovery.

Trust (``runtime/ray_runtime/checkpoint.py``): after the save, rank 0 writes
``manifest.json`` (size and SHA-256 of every file); a load verifies every file against it
before DCP reads anything (DCP's ``.metadata`` is a pickle), and refuses a checkpoint without
one.

This module is the stand-in for the shared DCP implementation of the sharding work; it handles
replicated models (every rank holds full tensors; rank 0's copy is what is written, DCP
deduplicates replicated tensors).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from runtime.ray_runtime.checkpoint import verify_manifest, write_manifest

__all__ = ["save_dcp", "load_dcp"]


def _holder(named_params: list[tuple[str, nn.Parameter]]) -> nn.Module:
    """A module tree whose parameters are exactly the given Parameter objects, at the given
    names — so torch's ``get_state_dict`` maps an optimizer over them (e.g. over fp32 master
    copies) to the model's parameter names."""
    root = nn.Module()
    for name, param in named_params:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, param)
    return root


class _ModelAndOptimizer(Stateful):
    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None):
        self.module, self.optimizer = module, optimizer

    def state_dict(self):
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.module)}
        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.module, model_state_dict=state_dict["model"])
        else:
            set_state_dict(self.module, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])


def _state(named_params, optimizer, lr_scheduler):
    state = {"dcp": _ModelAndOptimizer(_holder(named_params), optimizer)}
    if lr_scheduler is not None:
        state["extra"] = {"lr_scheduler": lr_scheduler.state_dict()}
    return state


def save_dcp(path: str, named_params, optimizer=None, lr_scheduler=None) -> None:
    """Write the parameters (``[(name, Parameter)]``: what the optimizer steps), the
    optimizer state when ``optimizer`` is given and the LR scheduler's state to ``path``."""
    os.makedirs(path, exist_ok=True)
    manifest = os.path.join(path, "manifest.json")
    if os.path.exists(manifest) and (not dist.is_initialized() or dist.get_rank() == 0):
        os.remove(manifest)  # the folder is being rewritten (AReaL reuses its recover path)
    dcp.save(_state(list(named_params), optimizer, lr_scheduler), checkpoint_id=path)
    if not dist.is_initialized() or dist.get_rank() == 0:  # every rank's files are written
        write_manifest(path, run_id=None, step=None, extra={"kind": "dta-areal-dcp"})


def load_dcp(path: str, named_params, optimizer=None, lr_scheduler=None) -> None:
    """The inverse of :func:`save_dcp`, in place (the parameters keep their identity, so an
    optimizer over them stays valid)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"DCP checkpoint {path!r} is not a directory")
    verify_manifest(path)
    state = _state(list(named_params), optimizer, lr_scheduler)
    dcp.load(state, checkpoint_id=path)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["extra"]["lr_scheduler"])

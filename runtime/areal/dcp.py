"""DCP (``torch.distributed.checkpoint``) save/load of a ``DTATrainEngine``: the
``weight_format="dcp"`` that AReaL's ``RecoverHandler`` hard-codes for recover checkpoints.

It writes through the project's one sharded-checkpoint implementation, ``runtime/dcp.py``
(``save_sharded`` / ``load_sharded``: every rank, atomic, resumable at the same world size),
into the folder AReaL names (``SaveLoadMeta.path``)::

    <path>/step-<version>/   DCP files + meta.json (runtime/dcp.py) + manifest.json
    <path>/latest            the newest one; older steps are removed after a save

The state is FSDPEngine's (``{"dcp": {"model", "optim"}}`` by ``get_state_dict`` /
``set_state_dict``, keyed by parameter name), with two differences that make a resumed run
continue bit-identically:

* with fp32 master weights (bf16 compute), the *masters* are saved under the parameter names
  (FSDPEngine's sharded parameters are its fp32 masters too), and loading restores the masters
  and casts them into the model;
* the LR scheduler's state is saved beside them (``"lr_scheduler"``); FSDPEngine does not save
  it, so its schedule restarts on recovery.

Trust (``runtime/checkpoints/checkpoint.py``): after the save, rank 0 writes
``manifest.json`` (size and SHA-256 of every file); a load verifies every file against it
before DCP reads anything (DCP's ``.metadata`` is a pickle), and refuses a checkpoint without
one.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from runtime.dcp import (latest_sharded, load_sharded, param_holder, read_meta, save_sharded,
                         step_name)
from runtime.checkpoints.checkpoint import verify_manifest, write_manifest

__all__ = ["save_dcp", "load_dcp", "save_state", "load_state"]

_KIND = "dta-areal-dcp"


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


def _state(named_params, optimizer, lr_scheduler) -> dict:
    state = {"dcp": _ModelAndOptimizer(param_holder(list(named_params)), optimizer)}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler
    return state


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_dcp(path: str, named_params, optimizer=None, lr_scheduler=None, *,
             step: int = 0) -> str:
    """Write the parameters (``[(name, Parameter)]``: what the optimizer steps), the optimizer
    state when ``optimizer`` is given and the LR scheduler's state as checkpoint ``step`` under
    ``path`` (every rank calls this); returns the checkpoint's folder."""
    return save_state(path, _state(named_params, optimizer, lr_scheduler), step=step)


def save_state(path: str, state: dict, *, step: int = 0, sharding: str = "replicate") -> str:
    """Write ``state`` (DCP entries: tensors, DTensors, Stateful objects — e.g. a sharded
    layout's ``dcp_state()`` and the LR scheduler) as checkpoint ``step`` under ``path``,
    recording the engine's ``sharding``; keeps only this one (every rank calls this)."""
    final = save_sharded(path, step, state, meta={"kind": _KIND, "sharding": sharding})
    if _rank0():
        write_manifest(final, run_id=None, step=step, extra={"kind": _KIND})
        for name in os.listdir(path):  # AReaL keeps one recover checkpoint
            if name.startswith("step-") and name != step_name(step):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_dcp(path: str, named_params, optimizer=None, lr_scheduler=None) -> None:
    """The newest checkpoint under ``path`` back into the parameters, the optimizer and the
    LR scheduler, in place (every rank calls this; the parameters keep their identity, so an
    optimizer over them stays valid). Verified against its manifest first."""
    load_state(path, _state(named_params, optimizer, lr_scheduler))


def load_state(path: str, state: dict, *, sharding: str = "replicate") -> dict:
    """The newest checkpoint under ``path`` into ``state`` in place (every rank), verified
    against its manifest first; refuses one written under another ``sharding`` (its entries
    would not match), naming both. Returns its meta."""
    final = latest_sharded(path)
    if final is None:
        raise FileNotFoundError(f"no DCP checkpoint under {path!r} (expected "
                                f"step-*/meta.json written by save_dcp)")
    verify_manifest(final)
    written = read_meta(final).get("sharding", "replicate")
    if written != sharding:
        raise ValueError(f"DCP checkpoint {final!r} was written under sharding={written}; "
                         f"this engine runs sharding={sharding} (load it with the same "
                         "actor.dta.sharding)")
    return load_sharded(final, state)

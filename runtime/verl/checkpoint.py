"""The dta engine's checkpoints: DCP through the project's one sharded-checkpoint
implementation (``runtime/dcp.py``: every rank, atomic, a manifest verified before loading)::

    <local_path>/step-<global_step>/   DCP files + meta.json + manifest.json
    <local_path>/latest                the newest one

The state is the trained parameters by name, the optimizer's state keyed by parameter name
(torch's ``get_state_dict`` / ``set_state_dict``) and the LR scheduler's state, so a loaded
engine continues bit-identically. ``max_ckpt_to_keep`` removes the oldest steps after a save.
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from runtime.dcp import (latest_sharded, load_sharded, param_holder, read_meta, save_sharded,
                         step_name)

__all__ = ["save_checkpoint", "load_checkpoint"]

KIND = "dta-verl-dcp"


class _Trained(Stateful):
    def __init__(self, named_params, optimizer):
        self.module, self.optimizer = param_holder(named_params), optimizer
        self.opts = StateDictOptions(ignore_frozen_params=True)

    def state_dict(self):
        model, optim = get_state_dict(self.module, self.optimizer or [], options=self.opts)
        return {"model": model, "optim": optim} if self.optimizer is not None else \
            {"model": model}

    def load_state_dict(self, state_dict) -> None:
        set_state_dict(self.module, self.optimizer or [], model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optim", {}), options=self.opts)


def _state(named_params, optimizer, lr_scheduler) -> dict:
    state = {"trained": _Trained(list(named_params), optimizer)}
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler
    return state


def save_checkpoint(path: str, named_params, optimizer=None, lr_scheduler=None, *,
                    step: int = 0, keep: int | None = None) -> str:
    """Write checkpoint ``step`` under ``path`` (every rank calls this); returns its folder."""
    if keep is not None and int(keep) < 0:
        raise ValueError(f"max_ckpt_to_keep must be >= 0 (0 or None: keep all), got {keep}")
    final = save_sharded(path, int(step), _state(named_params, optimizer, lr_scheduler),
                         meta={"kind": KIND})
    if keep and (not dist.is_initialized() or dist.get_rank() == 0):
        steps = sorted(n for n in os.listdir(path) if n.startswith("step-"))
        for name in steps[:-int(keep)]:
            if name != step_name(int(step)):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def load_checkpoint(path: str, named_params, optimizer=None, lr_scheduler=None) -> dict:
    """The newest checkpoint under ``path`` (or ``path`` itself, a ``step-*`` folder) into the
    parameters, optimizer and LR scheduler in place (every rank); returns its meta."""
    final = path if os.path.exists(os.path.join(path, "meta.json")) else latest_sharded(path)
    if final is None:
        raise FileNotFoundError(f"no dta engine checkpoint under {path!r} (expected "
                                "step-*/meta.json written by save_checkpoint)")
    kind = read_meta(final).get("kind")
    if kind != KIND:
        raise ValueError(f"checkpoint {final!r} is a {kind!r} checkpoint, not the dta verl "
                         f"engine's ({KIND})")
    with torch.no_grad():
        return load_sharded(final, _state(named_params, optimizer, lr_scheduler))

"""The dta engine's checkpoints: the engine core's (``runtime.engine.checkpoint``) plus
verl's LR scheduler::

    <local_path>/step-<global_step>/   the core's checkpoint + meta.json (kind, LR scheduler)

Replicated state (``replicate``) is written by rank 0 (tensors only, a SHA-256 manifest,
atomic: ``runtime.checkpoints``); sharded state (``zero1`` / ``fsdp``) by every rank with DCP
(``runtime.dcp``). The LR scheduler's state travels in the checkpoint's meta.json, so a
loaded engine continues bit-identically. ``max_ckpt_to_keep`` removes the oldest steps after
a save.
"""
from __future__ import annotations

import json
import os

from runtime.checkpoints.checkpoint import latest_checkpoint, step_name
from runtime.engine import comm

__all__ = ["save_checkpoint", "load_checkpoint"]

KIND = "dta-verl"


def save_checkpoint(core, lr_scheduler, path: str, *, step: int = 0,
                    keep: int | None = None) -> str:
    """Write checkpoint ``step`` under ``path`` (every rank calls this); returns its folder."""
    if keep is not None and int(keep) < 0:
        raise ValueError(f"max_ckpt_to_keep must be >= 0 (0 or None: keep all), got {keep}")
    meta = {"kind": KIND, "layout": core.layout.record(),
            "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict()}
    if core.layout.sharded or core.layout.rank == 0:  # replicated: one rank writes it all
        core.save(path, int(step), meta, keep_last=int(keep) if keep else None)
    comm.barrier()  # the checkpoint is complete for every rank
    return os.path.join(path, step_name(int(step)))


def load_checkpoint(core, lr_scheduler, path: str) -> dict:
    """The newest checkpoint under ``path`` (or ``path`` itself, a ``step-*`` folder) into the
    core and the LR scheduler, in place (every rank); returns its meta."""
    final = path if os.path.exists(os.path.join(path, "meta.json")) else latest_checkpoint(path)
    if final is None:
        raise FileNotFoundError(f"no dta engine checkpoint under {path!r} (expected "
                                "step-*/meta.json written by save_checkpoint)")
    with open(os.path.join(final, "meta.json")) as f:
        kind = json.load(f).get("kind")
    if kind != KIND:
        raise ValueError(f"checkpoint {final!r} is a {kind!r} checkpoint, not the dta verl "
                         f"engine's ({KIND})")
    meta = core.load(final)
    if lr_scheduler is not None:
        if meta.get("lr_scheduler") is None:
            raise ValueError(f"checkpoint {final!r} holds no LR scheduler state")
        lr_scheduler.load_state_dict(meta["lr_scheduler"])
    return meta

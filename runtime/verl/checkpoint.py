"""The dta engine's checkpoints: the engine core's one scheme (``EngineCore.save`` / ``load``,
``runtime.checkpoints.engine``) with verl's LR scheduler as its ``extra_state``::

    <local_path>/step-<global_step>/   the core's checkpoint; meta.json: kind, layout, the
                                       LR scheduler's state

One format in every layout (``runtime.checkpoints``: the logical view as DCP files, tensors
only, a SHA-256 manifest, atomic): replicated state (``replicate``) is written by rank 0,
sharded state (``zero1`` / ``fsdp``) by every rank. A loaded engine continues bit-identically. ``max_ckpt_to_keep`` keeps the
newest steps (the core's ``keep_last``).
"""
from __future__ import annotations

from runtime.engine import comm

__all__ = ["save_checkpoint", "load_checkpoint"]

KIND = "dta-verl"


def _extra(lr_scheduler) -> dict | None:
    return None if lr_scheduler is None else {"lr_scheduler": lr_scheduler}


def save_checkpoint(core, lr_scheduler, path: str, *, step: int = 0,
                    keep: int | None = None) -> str:
    """Write checkpoint ``step`` under ``path`` (every rank calls this); returns its folder."""
    if keep is not None and int(keep) < 0:
        raise ValueError(f"max_ckpt_to_keep must be >= 0 (0 or None: keep all), got {keep}")
    final = core.save(path, int(step), {"kind": KIND, "layout": core.layout.record()},
                      keep_last=int(keep) if keep else None, extra_state=_extra(lr_scheduler))
    comm.barrier()  # the checkpoint is complete for every rank
    return final


def load_checkpoint(core, lr_scheduler, path: str) -> dict:
    """The newest checkpoint under ``path`` (or ``path`` itself, a ``step-*`` folder) into the
    core and the LR scheduler, in place (every rank); returns its meta."""
    final, _ = core.find_checkpoint(path, kind=KIND, name="dta engine checkpoint",
                                    whose="the dta verl engine's", writer="save_checkpoint")
    return core.load(final, extra_state=_extra(lr_scheduler))

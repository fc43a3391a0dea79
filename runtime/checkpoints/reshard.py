"""Resuming a checkpoint under any layout: every source through the one logical view.

The training state is saved layout-free (:mod:`.logical`): per trained parameter, by its
name and whole shape, the weights the optimizer steps and each optimizer state tensor, and
its step count. So a checkpoint resumes under another world size, sharding mode
(replicate / zero1 / fsdp) or context-parallel size (which changes only the walk, never the
state): every rank loads the pieces it holds now. The sources (:func:`layout`):

- ``logical`` -- the one format every layout writes (meta.json ``"logical": 1``): DCP files
  of the logical view, written by every rank of a sharded run or by one process for a
  replica or a plain model; every rank loads its pieces, DCP reading the overlapping parts of
  whatever the saving ranks wrote;
- ``replicated`` -- ``model.pt`` + ``optimizer.pt``, the replica's format written by DTA up
  to 2026-12-07 (before issue 54's one format), and ``dcp-v1`` -- the sharded format DTA 0.1.0 wrote before
  2026-12-05: read whole by the one legacy reader (:mod:`.legacy`) and cut into this rank's
  pieces, so they too resume under any layout.

A layout that holds the whole state (``replica``: a replicated run, a plain model) also gets
the optimizer's hyperparameters (``param_groups``) and rank 0's RNG states back, as a replica
always did. Refused in one line, before a parameter is touched (:func:`.logical.check_fits`):
a checkpoint of another model or size, LoRA <-> full, another optimizer's state.
"""
from __future__ import annotations

import os

from runtime.checkpoints.checkpoint import (
    GROUPS,
    RNG,
    check_owner,
    load_tensors,
    read_meta,
    restore_groups,
    set_rng_state,
    verify_manifest,
)
from runtime.checkpoints.sharded import LOGICAL

__all__ = ["layout", "load"]


def layout(path: str) -> dict:
    """``{"format": "logical" | "replicated" | "dcp-v1", "world", "sharding", "meta"}`` of the
    checkpoint ``path``; its manifest is verified (and its run) first."""
    check_owner(path, verify_manifest(path))
    meta = read_meta(path)
    if meta.get("format") == "dcp":
        fmt = "logical" if meta.get("logical") == LOGICAL else "dcp-v1"
        return {"format": fmt, "world": int(meta.get("world_size", -1)),
                "sharding": str(meta.get("sharding")), "meta": meta}
    return {"format": "replicated", "world": int(meta.get("num_workers") or 1),
            "sharding": "replicate", "meta": meta}


def load(mode, path: str, *, local: bool = False, replica: bool | None = None,
         rng: bool = True) -> dict:
    """The checkpoint ``path`` into the sharding ``mode``'s model and optimizer (every rank
    of a sharded group calls this; ``local``: this process alone, no collective); returns
    its meta. ``replica`` (default: ``mode`` is not sharded): also the hyperparameters and,
    with ``rng``, the RNG states."""
    from runtime.checkpoints.sharded import load_sharded

    saved = layout(path)
    replica = (not mode.sharded) if replica is None else replica
    states = os.path.join(path, RNG)
    states = load_tensors(states) if replica and rng and os.path.isfile(states) else None
    if saved["format"] == "logical":
        load_sharded(path, mode.sharded_state(), local=local)
        groups = saved["meta"].get(GROUPS)
    else:
        from runtime.checkpoints import legacy

        groups = legacy.load(mode, path, saved["format"], saved["sharding"])
    if replica:
        restore_groups(mode.optimizer, groups)
        if states is not None:
            set_rng_state(states)
    return saved["meta"]

"""The engine core's checkpoints (its Hugging Face export and whole weights:
``runtime.engine.weights``), in the one format every layout writes: the training state's
logical view (``runtime.checkpoints.logical``: per parameter by name and whole shape, the
weights the optimizer steps -- the fp32 masters where kept -- and the optimizer state) as DCP
files (``runtime.checkpoints.sharded.save_sharded``), rank 0's RNG states and the optimizer's
hyperparameters beside it; tensors only, a SHA-256 manifest, atomic.

- sharded state (``zero1`` / ``fsdp`` / expert slices): every rank writes its pieces;
- replicated state (``replicate``): rank 0 alone writes its whole state in one process (a
  one-shard layout, no collective); asked as ``every_rank`` (AReaL's recover, where every
  rank calls it), the ranks write it together, each replicated piece once;
- either loads under any layout -- another world size, mode or context-parallel size --
  every rank keeping its pieces (``runtime.checkpoints.reshard``; the formats DTA no longer
  writes through ``runtime.checkpoints.legacy``); a checkpoint of another model, LoRA <->
  full or another optimizer is refused in one line before a parameter is touched;
- a front door's own state beside the core's (``extra_state``: name -> an object with
  ``state_dict()`` / ``load_state_dict()``, e.g. its LR scheduler), in the checkpoint's
  ``meta.json`` (JSON, checked to read back equal; checksummed with the rest), restored after
  the core's state -- one scheme for every front door;
"""
from __future__ import annotations

import os

import torch

__all__ = ["save", "load", "is_checkpoint", "find", "extra_meta", "check_extra",
           "restore_extra"]

EXTRA = "extra_state"  # meta.json's key of a front door's own state


def save(core, directory: str, step: int, meta: dict, *, run_id: str | None = None,
         keep_last: int | None = None, every_rank: bool = False) -> str:
    """Replicated: call it on rank 0 (it writes the whole state alone), or with
    ``every_rank`` on every rank. Sharded: every rank calls it and writes its pieces (rank 0
    then applies ``keep_last``)."""
    from runtime.checkpoints.checkpoint import prune, replica_files, replica_meta
    from runtime.checkpoints.sharded import save_sharded
    from runtime.checkpoints.whole import save_local

    meta = {"layout": core.layout.record(), **meta, "sharding": core.layout.sharding}
    if not (core.layout.sharded or every_rank):
        return save_local(directory, step, core.sharding, meta, run_id=run_id,
                          keep_last=keep_last)
    path = save_sharded(directory, step, core.sharding.sharded_state(),
                        meta={**meta, **replica_meta(core.optimizer), "run_id": run_id},
                        files=replica_files())
    if keep_last and core.layout.rank == 0:
        prune(directory, keep_last, keep=path, run_id=run_id)
    return path


def load(core, path: str) -> dict:
    """Load ``path`` into the core under its layout (every rank calls it); returns its meta."""
    from runtime.checkpoints.reshard import load as load_any

    whole = not core.layout.sharded  # a replica: read in this process, no collective
    return load_any(core.sharding, path, local=whole, replica=whole)


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint's own folder (not a run's folder holding some)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("meta.json", "manifest.json"))


def find(path: str) -> tuple[str, dict]:
    """The checkpoint at ``path`` (a checkpoint folder, or the newest complete one under a
    run's folder) and its meta, read before anything is loaded (a front door's checks)."""
    from runtime.checkpoints.checkpoint import latest_checkpoint, read_meta

    final = path if is_checkpoint(path) else latest_checkpoint(path)
    if final is None:
        raise FileNotFoundError(f"no checkpoint under {path!r} (expected step-*/meta.json "
                                "with its manifest)")
    return final, read_meta(final)


def extra_meta(extra_state: dict | None) -> dict:
    """``{EXTRA: {name: state dict}}`` for meta.json; a state that JSON would not give back
    equal (tensors, tuples, ...) is refused naming it, before anything is written."""
    import json

    if not extra_state:
        return {}
    out = {}
    for name, obj in extra_state.items():
        state = obj.state_dict()
        try:
            same = json.loads(json.dumps(state)) == state
        except (TypeError, ValueError):
            same = False
        if not same:
            raise TypeError(f"extra_state {name!r} ({type(obj).__name__}): its state_dict() "
                            "is not plain JSON (numbers, strings, lists, dicts), which the "
                            "checkpoint's meta.json holds")
        out[name] = state
    return {EXTRA: out}


def check_extra(path: str, meta: dict, extra_state: dict | None) -> None:
    """Refuse a checkpoint without one of the ``extra_state`` entries (before a load)."""
    saved = meta.get(EXTRA) or {}
    missing = sorted(set(extra_state or {}) - set(saved))
    if missing:
        raise ValueError(f"checkpoint {path!r} holds no {missing} (its extra_state has "
                         f"{sorted(saved)})")


def restore_extra(core, path: str, meta: dict, extra_state: dict | None) -> None:
    """Every ``extra_state`` entry from the checkpoint's meta (each must be there); an LR
    scheduler of the core's optimizer also sets the optimizer's learning rates to its last
    ones (a sharded optimizer state holds no param_groups)."""
    check_extra(path, meta, extra_state)
    for name, obj in (extra_state or {}).items():
        obj.load_state_dict(meta[EXTRA][name])
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and \
                obj.optimizer is core.optimizer:
            for group, lr in zip(core.optimizer.param_groups, obj.get_last_lr()):
                group["lr"] = lr

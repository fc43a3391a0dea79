"""The engine core's checkpoints (its Hugging Face export and whole weights:
``runtime.engine.weights``).

- replicated state (``replicate``): one rank writes the model and the optimizer
  (``runtime.checkpoints.checkpoint``: tensors only, a SHA-256 manifest, atomic; a replica
  keeping fp32 masters writes the masters as its weights);
- sharded state (``zero1`` / ``fsdp``), or replicated state asked as DCP (``dcp=True``,
  AReaL's recover format): every rank writes its pieces of the one logical view
  (``runtime.checkpoints.logical``: per parameter by name and whole shape, the stepped weights
  and the optimizer state) with DCP (``runtime.checkpoints.sharded.save_sharded``);
- either loads under any layout -- another world size, mode or context-parallel size --
  every rank keeping its pieces (``runtime.checkpoints.reshard``); a checkpoint of another
  model, LoRA <-> full or another optimizer is refused in one line before a parameter is
  touched;
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
         keep_last: int | None = None, dcp: bool = False) -> str:
    """Replicated: call it on one rank (it writes the whole state). Sharded (or ``dcp``):
    every rank calls it and writes its pieces (rank 0 then applies ``keep_last``)."""
    if core.layout.sharded or dcp:
        from runtime.checkpoints.checkpoint import prune
        from runtime.checkpoints.sharded import save_sharded

        path = save_sharded(directory, step, core.sharding.sharded_state(),
                            meta={"layout": core.layout.record(), **meta,
                                  "sharding": core.layout.sharding, "run_id": run_id})
        if keep_last and core.layout.rank == 0:
            prune(directory, keep_last, keep=path, run_id=run_id)
        return path
    from runtime.checkpoints.checkpoint import save_checkpoint

    mode = core.sharding
    masters = getattr(mode, "masters", None)  # a replica's fp32 masters: what it steps
    weights = None if masters is None else {n: m for n, m in zip(mode.names, masters)}
    return save_checkpoint(directory, step, core.model, core.optimizer, meta, run_id=run_id,
                           keep_last=keep_last, weights=weights)


def load(core, path: str) -> dict:
    """Load ``path`` into the core under its layout (every rank calls it); returns its meta."""
    from runtime.checkpoints.reshard import load as load_any

    return load_any(core, path)


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

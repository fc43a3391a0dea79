"""The engine core's checkpoints and Hugging Face export.

- replicated state (``replicate``): one rank writes the model and the optimizer
  (``runtime.checkpoints.checkpoint``: tensors only, a SHA-256 manifest, atomic), or -- asked
  (``dcp=True``, AReaL's recover format) -- every rank its DCP view, as a sharded mode;
- sharded state (``zero1`` / ``fsdp``): every rank writes its shards with DCP
  (``runtime.dcp.save_sharded``), loaded at any world size in the same mode, or re-sharded
  into one replica, or a replicated checkpoint cut into this rank's shards
  (``runtime.sharding.reshard``); anything else is refused before a parameter is touched;
- a front door's own state beside the core's (``extra_state``: name -> an object with
  ``state_dict()`` / ``load_state_dict()``, e.g. its LR scheduler), in the checkpoint's
  ``meta.json`` (JSON, checked to read back equal; checksummed with the rest), restored after
  the core's state -- one scheme for every front door;
- the model as a Hugging Face folder (``save_pretrained``, compute dtype; LoRA: the adapter
  in PEFT format or merged weights), gathered where sharded;
- the whole weights in the compute dtype, tensor by tensor or as a state dict (what a
  rollout's weight update sends: FSDP's layers gathered, never the fp32 masters), and whole
  tensors loaded back into the model, its shards and its masters.
"""
from __future__ import annotations

import os

import torch

__all__ = ["save", "load", "export_hf", "named_full_tensors", "full_state_dict",
           "load_full_state", "is_checkpoint", "find", "extra_meta", "check_extra",
           "restore_extra"]

EXTRA = "extra_state"  # meta.json's key of a front door's own state


def save(core, directory: str, step: int, meta: dict, *, run_id: str | None = None,
         keep_last: int | None = None, dcp: bool = False) -> str:
    """Replicated: call it on one rank (it writes the whole state). Sharded (or ``dcp``):
    every rank calls it and writes its shards (rank 0 then applies ``keep_last``)."""
    if core.layout.sharded or dcp:
        from runtime.checkpoints.checkpoint import prune
        from runtime.dcp import save_sharded

        path = save_sharded(directory, step, core.mode.sharded_state(),
                            meta={**meta, "sharding": core.layout.sharding, "run_id": run_id})
        if keep_last and core.layout.rank == 0:
            prune(directory, keep_last, keep=path, run_id=run_id)
        return path
    from runtime.checkpoints.checkpoint import save_checkpoint

    return save_checkpoint(directory, step, core.model, core.optimizer, meta, run_id=run_id,
                           keep_last=keep_last)


def load(core, path: str) -> dict:
    """Load ``path`` into the core (sharded: every rank calls it); returns its meta."""
    from runtime.sharding.reshard import (
        check_resumable,
        load_into_replica,
        load_replicated_into_sharded,
    )

    sharded = core.layout.sharded
    saved = check_resumable(path, core.layout.world, core.layout.sharding)
    if saved["format"] == "dcp" and not sharded and saved["sharding"] == core.layout.sharding:
        from runtime.dcp import load_sharded  # replicated state written as DCP (``dcp=True``)

        return load_sharded(path, core.mode.sharded_state(), allow_reshard=True)
    if saved["format"] == "dcp" and not sharded:
        return load_into_replica(path, core.model, core.optimizer)
    if saved["format"] == "replicated" and sharded:
        return load_replicated_into_sharded(path, core.mode)
    if sharded:  # the same mode; DCP re-cuts for another world size
        from runtime.dcp import load_sharded

        return load_sharded(path, core.mode.sharded_state(), allow_reshard=True)
    from runtime.checkpoints.checkpoint import load_checkpoint

    return load_checkpoint(path, core.model, core.optimizer)


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


def export_hf(core, path: str, *, merged: bool = False) -> str:
    """The model as a Hugging Face folder. Replicated: call it on one rank. Sharded: every
    rank calls it (gathering the whole state is a collective) and rank 0 writes, in the
    compute dtype (what a replicated run holds and exports)."""
    from dta.model.lora import is_peft_model, save_adapter

    rank0 = core.layout.rank == 0
    if is_peft_model(core.model):  # the adapter in PEFT format, or merged weights
        # zero1 keeps the gathered compute copy in the model itself: nothing to gather
        if rank0:
            os.makedirs(path, mode=0o755, exist_ok=True)
            save_adapter(core.model, path, merged=merged)
        return path
    if not core.layout.sharded:
        os.makedirs(path, mode=0o755, exist_ok=True)
        core.model.save_pretrained(path)
        return path
    state = full_state_dict(core, keep=rank0)  # the gathers on every rank, held by rank 0
    if rank0:
        os.makedirs(path, mode=0o755, exist_ok=True)
        core.model.save_pretrained(path, state_dict=state)
    return path


# ------------------------------------------------------------- whole tensors --
def _whole(core, p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    if hasattr(t, "full_tensor"):  # an FSDP2 DTensor: all-gather (a collective)
        t = t.full_tensor()
    if t.is_floating_point() and t.dtype != core.compute_dtype:
        t = t.to(core.compute_dtype)
    return t


def named_full_tensors(core):
    """``(name, whole tensor in the compute dtype)`` per parameter (every rank iterates)."""
    for name, p in core.model.named_parameters():
        yield name, _whole(core, p)


@torch.no_grad()
def full_state_dict(core, *, keep: bool = True) -> dict:
    """The model's state dict, whole tensors in the compute dtype on CPU (tied weights under
    both names); ``keep=False``: the gathers only, ``{}`` returned."""
    by_id: dict[int, torch.Tensor | None] = {}
    full: dict[str, torch.Tensor | None] = {}
    for name, p in core.model.named_parameters(remove_duplicate=False):
        if id(p) not in by_id:
            t = _whole(core, p)
            by_id[id(p)] = t.cpu().clone() if keep else None
        full[name] = by_id[id(p)]
    if not keep:
        return {}
    for name, b in core.model.named_buffers():
        full[name] = b.detach().cpu().clone()
    return {k: full[k] for k in core.model.state_dict() if k in full}


@torch.no_grad()
def load_full_state(core, state: dict, *, what: str) -> None:
    """Whole tensors into the model (FSDP's shards: this rank's part), then the masters
    from them: ``replicate``'s, zero1's flat slices, fsdp's vocabulary slices (its layers'
    DTensors are their own masters). Every parameter must be in ``state``, and nothing else
    but the model's state-dict keys (``what`` names the source in the error)."""
    model = core.model
    named = list(model.named_parameters())
    missing = [n for n, _ in named if n not in state]
    unexpected = sorted(set(state) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{what} does not match the model: missing {missing[:5]}"
                         f"{' …' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' …' if len(unexpected) > 5 else ''}")
    for name, p in named:
        src = state[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{what}: {name} has shape {tuple(src.shape)}, the model "
                             f"{tuple(p.shape)}")
    for name, p in named:
        src = state[name].to(device=p.device, dtype=p.dtype)
        if hasattr(p, "device_mesh"):  # FSDP2: this rank's shard of the whole tensor
            from torch.distributed.tensor import distribute_tensor

            src = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(src)
    for name, b in model.named_buffers():
        if name in state:
            b.copy_(state[name].to(device=b.device, dtype=b.dtype))
    core.mode.load_masters(state)

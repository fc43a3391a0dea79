"""The engine core's checkpoints and Hugging Face export.

- replicated state (``replicate``): one rank writes the model and the optimizer
  (``runtime.checkpoints.checkpoint``: tensors only, a SHA-256 manifest, atomic; a replica
  keeping fp32 masters writes the masters as its weights);
- sharded state (``zero1`` / ``fsdp``), or replicated state asked as DCP (``dcp=True``,
  AReaL's recover format): every rank writes its pieces of the one logical view
  (``runtime.sharding.logical``: per parameter by name and whole shape, the stepped weights
  and the optimizer state) with DCP (``runtime.dcp.save_sharded``);
- either loads under any layout -- another world size, mode or context-parallel size --
  every rank keeping its pieces (``runtime.sharding.reshard``); a checkpoint of another
  model, LoRA <-> full or another optimizer is refused in one line before a parameter is
  touched;
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
    every rank calls it and writes its pieces (rank 0 then applies ``keep_last``)."""
    if core.layout.sharded or dcp:
        from runtime.checkpoints.checkpoint import prune
        from runtime.dcp import save_sharded

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
    from runtime.sharding.reshard import load as load_any

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
def _experts(core):
    from dta.model.expert_parallel import expert_parallel_of

    return expert_parallel_of(core.model)


def _whole(core, p: torch.Tensor, ep=None) -> torch.Tensor:
    t = p.detach()
    if hasattr(t, "full_tensor"):  # an FSDP2 DTensor: all-gather (a collective)
        t = t.full_tensor()
    elif ep is not None and ep.is_expert(p):  # an expert slice: gathered over its group
        t = ep.full_tensor(t)
    if t.is_floating_point() and t.dtype != core.compute_dtype:
        t = t.to(core.compute_dtype)
    return t


def named_full_tensors(core):
    """``(name, whole tensor in the compute dtype)`` per parameter (every rank iterates)."""
    ep = _experts(core)
    for name, p in core.model.named_parameters():
        yield name, _whole(core, p, ep)


@torch.no_grad()
def full_state_dict(core, *, keep: bool = True) -> dict:
    """The model's state dict, whole tensors in the compute dtype on CPU (tied weights under
    both names); ``keep=False``: the gathers only, ``{}`` returned."""
    by_id: dict[int, torch.Tensor | None] = {}
    full: dict[str, torch.Tensor | None] = {}
    ep = _experts(core)
    for name, p in core.model.named_parameters(remove_duplicate=False):
        if id(p) not in by_id:
            t = _whole(core, p, ep)
            by_id[id(p)] = t.cpu().clone() if keep else None
        full[name] = by_id[id(p)]
    if not keep:
        return {}
    for name, b in core.model.named_buffers():
        full[name] = b.detach().cpu().clone()
    return {k: full[k] for k in core.model.state_dict() if k in full}


@torch.no_grad()
def load_full_state(core, state: dict, *, what: str) -> None:
    """Whole tensors into the model (FSDP's shards: this rank's part), then what the
    optimizer steps from them (``Sharding.load_masters``: replicate's masters or host
    copies, zero1's flat slices, fsdp's vocabulary slices and offloaded layer copies). Every
    parameter must be in ``state``, and nothing else but the model's state-dict keys
    (``what`` names the source in the error)."""
    model = core.model
    named = list(model.named_parameters())
    missing = [n for n, _ in named if n not in state]
    unexpected = sorted(set(state) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{what} does not match the model: missing {missing[:5]}"
                         f"{' …' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' …' if len(unexpected) > 5 else ''}")
    ep = _experts(core)

    def whole_shape(p):
        if ep is None or not ep.is_expert(p):
            return tuple(p.shape)
        return (ep.slice_of(p)[2], *p.shape[1:])

    def piece(name, p):  # an expert slice: its experts of the whole tensor
        if ep is None or not ep.is_expert(p):
            return state[name]
        first, stop, _ = ep.slice_of(p)
        return state[name][first:stop]

    for name, p in named:
        if tuple(state[name].shape) != whole_shape(p):
            raise ValueError(f"{what}: {name} has shape {tuple(state[name].shape)}, the model "
                             f"{whole_shape(p)}")
    for name, p in named:
        src = piece(name, p).to(device=p.device, dtype=p.dtype)
        if hasattr(p, "device_mesh"):  # FSDP2: this rank's shard of the whole tensor
            from torch.distributed.tensor import distribute_tensor

            src = distribute_tensor(src, p.device_mesh, p.placements, src_data_rank=None)
        p.copy_(src)
    for name, b in model.named_buffers():
        if name in state:
            b.copy_(state[name].to(device=b.device, dtype=b.dtype))
    # what the optimizer steps: masters, flat slices, host copies (an expert slice: its rows)
    core.sharding.load_masters({n: piece(n, p) for n, p in named})

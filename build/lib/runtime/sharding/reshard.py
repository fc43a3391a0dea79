"""Resuming a checkpoint under any layout: every source through the one logical view.

The training state is saved layout-free (:mod:`.logical`): per trained parameter, by its
name and whole shape, the weights the optimizer steps and each optimizer state tensor, and
its step count. So a checkpoint resumes under another world size, sharding mode
(replicate / zero1 / fsdp) or context-parallel size (which changes only the walk, never the
state): every rank loads the pieces it holds now. The sources (:func:`layout`):

- ``logical`` -- a DCP checkpoint of a sharded run (meta.json ``"logical": 1``): every rank
  loads its pieces, DCP reading the overlapping parts of whatever the saving ranks wrote;
- ``replicated`` -- ``model.pt`` + ``optimizer.pt`` (a replica's; tensors only, verified):
  every rank reads the files whole and keeps its pieces; a replicated run also gets the
  optimizer's hyperparameters (``param_groups``), the model's buffers and the RNG state back,
  as a replica always did;
- ``dcp-v1`` -- the sharded format before 2026-12-05 (zero1's flat tensors, fsdp's DTensors
  and vocabulary): read whole on every rank (DCP without a process group) and cut into the
  pieces, so it too resumes under any layout (each rank reads all of it once).

Refused in one line, before a parameter is touched (:func:`.logical.check_fits`): a
checkpoint of another model or size, LoRA <-> full, another optimizer's state.
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from runtime.checkpoints.checkpoint import check_owner, read_meta, verify_manifest
from runtime.dcp import LOGICAL, ShardedCheckpointError
from runtime.sharding.logical import STEP, load_whole

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


def load(core, path: str) -> dict:
    """The checkpoint ``path`` into the engine core's model and optimizer under its layout
    (every rank of a sharded or replicated group calls this); returns its meta."""
    from runtime.dcp import load_sharded

    saved = layout(path)
    mode = core.sharding
    if saved["format"] == "logical":
        return load_sharded(path, mode.sharded_state())
    if saved["format"] == "replicated":
        _load_replicated(core, path)
    else:
        load_whole(mode, _previous_format(path, mode, saved["sharding"]), what=repr(path))
    return saved["meta"]


# ------------------------------------------------------------------ replicated --
def _load_replicated(core, path: str) -> None:
    from runtime.checkpoints.checkpoint import load_tensors, set_rng_state

    weights = load_tensors(os.path.join(path, "model.pt"))
    opt = load_tensors(os.path.join(path, "optimizer.pt"))
    rng = os.path.join(path, "rng.pt")
    rng = load_tensors(rng) if os.path.exists(rng) else None
    mode, model = core.sharding, core.model
    load_whole(mode, _replicated_whole(path, weights, opt, mode), what=repr(path))
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in weights:
                b.copy_(weights[name].to(device=b.device, dtype=b.dtype))
    if not core.layout.sharded:  # as a replica always resumed: hyperparameters, RNG
        groups = opt.get("param_groups") or []
        if mode.optimizer is not None and len(groups) == len(mode.optimizer.param_groups):
            for group, saved in zip(mode.optimizer.param_groups, groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
        if rng is not None:
            set_rng_state(rng)


def _replicated_whole(path: str, weights: dict, opt: dict, mode) -> dict:
    """The logical tensors of a replicated checkpoint, read as this run's model names them:
    its optimizer's parameters in order are the model's trained ones (what a replica steps)."""
    shapes = dict(mode.logical_shapes())
    trained = set(shapes)
    others = set(mode.model.state_dict()) - trained  # buffers, tied names, a frozen base
    saved = [n for n in weights if n not in others]
    whole = {f"model.{n}": weights[n] for n in saved}
    ids = [i for g in opt.get("param_groups", []) for i in g["params"]]
    if set(saved) == trained and mode.optimizer is not None and len(ids) != len(shapes):
        raise ShardedCheckpointError(f"checkpoint {path!r}: its optimizer holds {len(ids)} "
                                     f"parameters, the model trains {len(shapes)}")
    if set(saved) != trained or mode.optimizer is None:
        return whole  # check_fits names what differs; an engine without optimizer: weights
    keys = mode_state_keys(mode)
    for i, name in zip(ids, shapes):
        st = {k: v for k, v in (opt["state"].get(i) or {}).items() if v is not None}
        w = weights[name]
        for k in (keys if not st else [k for k in st if k != STEP]):
            whole[f"optim.{name}.{k}"] = st[k] if st else torch.zeros_like(w)
        if STEP in st or (not st and _adam(mode)):
            whole[f"optim.{name}.{STEP}"] = torch.as_tensor(float(st.get(STEP, 0)))
    return whole


def mode_state_keys(mode) -> tuple[str, ...]:
    from runtime.sharding.state import state_keys

    return state_keys(mode.optimizer)


def _adam(mode) -> bool:
    return type(mode.optimizer).__name__ in ("AdamW", "Adam")


# ------------------------------------------------------- the previous sharded format --
def _read_whole(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, in this process (no process group)."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()  # a pickle: the manifest is verified
    out = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise ShardedCheckpointError(f"checkpoint {path!r}: entry {fqn!r} is not a tensor")
        out[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return out


def _previous_format(path: str, mode, sharding: str) -> dict[str, torch.Tensor]:
    """The logical tensors of a checkpoint in the sharded format before 2026-12-05: zero1's
    masters and states flat over the trained parameters in the model's order (``zero1.*``),
    fsdp's layers as ``fsdp.param.<name>`` / ``fsdp.optim.<name>.<key>`` and its
    vocabulary weights flat (``vocab.*``), per-parameter step counts."""
    from runtime.sharding.fsdp import _vocab_params

    saved = _read_whole(path)
    shapes = dict(mode.logical_shapes())
    keys = [k for k in ("exp_avg", "exp_avg_sq", "momentum_buffer")
            if any(f.endswith(f".{k}") for f in saved)]
    whole: dict[str, torch.Tensor] = {}

    def flat(prefix: str, names: list[str]) -> None:
        total = sum(_numel(shapes[n]) for n in names)
        master = saved.get(f"{prefix}.master")
        if master is None or master.numel() != total:
            raise ShardedCheckpointError(
                f"checkpoint {path!r} (train.sharding={sharding}, the format before "
                f"2026-12-05) does not fit this run: {prefix}.master holds "
                f"{None if master is None else master.numel()} elements, this model {total}")
        steps, a = saved[f"{prefix}.steps"], 0
        for i, n in enumerate(names):
            k = _numel(shapes[n])
            whole[f"model.{n}"] = master[a:a + k].view(shapes[n])
            for key in keys:
                whole[f"optim.{n}.{key}"] = saved[f"{prefix}.{key}"][a:a + k].view(shapes[n])
            whole[f"optim.{n}.{STEP}"] = steps[i].to(torch.float64)
            a += k

    if sharding == "zero1":
        flat("zero1", list(shapes))
    elif sharding == "fsdp":
        vocab = [n for n, _ in _vocab_params(mode.model)]
        flat("vocab", vocab)
        for n in shapes:
            if n in vocab:
                continue
            if f"fsdp.param.{n}" in saved:
                whole[f"model.{n}"] = saved[f"fsdp.param.{n}"]
            for key in (*keys, STEP):
                if f"fsdp.optim.{n}.{key}" in saved:
                    whole[f"optim.{n}.{key}"] = saved[f"fsdp.optim.{n}.{key}"]
    else:
        raise ShardedCheckpointError(f"checkpoint {path!r}: unknown sharding {sharding!r}")
    return whole


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n

"""The one reader of checkpoint formats this DTA no longer writes, each named by what wrote it
(:data:`WRITTEN_BY`); today every layout writes the one format (the logical view as DCP,
:mod:`.sharded`), and nothing here writes.

- ``replicated``: a replica's files, written by DTA up to 2026-12-07 (a946503 and before:
  until issue 54 made every layout write the one format), recognised by a ``meta.json`` without
  ``"format"``: ``model.pt`` (the trained tensors by name -- a LoRA model: its adapters; a
  replica keeping fp32 masters: the masters -- and the model's buffers), ``optimizer.pt``
  (``optimizer.state_dict()``: per-parameter state by index in the trained parameters'
  order, ``param_groups``) and ``rng.pt``; all tensors only, read ``weights_only``.
  :func:`read_replicated` gives the logical view's whole tensors.
- ``dcp-v1``: the sharded format written by DTA 0.1.0 before commit c7cfbfa (2026-12-05,
  "one layout-free logical view"), recognised by a DCP ``meta.json`` without ``"logical": 1``:
  zero1's masters and optimizer states flat over the trained parameters in the model's order
  (``zero1.master``, ``zero1.<key>``, ``zero1.steps``), fsdp's layers per parameter
  (``fsdp.param.<name>``, ``fsdp.optim.<name>.<key>``) and its vocabulary weights flat
  (``vocab.*``). :func:`read_dcp_v1` reads it whole in this process (DCP without a process
  group; each rank reads all of it once).

Both are cut into any layout's pieces by :func:`runtime.checkpoints.logical.load_whole`
(:func:`load`).
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from runtime.checkpoints.files import dcp_reader, load_tensors, read_dcp_metadata
from runtime.checkpoints.logical import STEP, load_whole
from runtime.checkpoints.optimizer_state import state_keys
from runtime.checkpoints.sharded import ShardedCheckpointError

__all__ = ["WRITTEN_BY", "load", "read_replicated", "read_dcp_v1"]

WRITTEN_BY = {"replicated": "DTA up to 2026-12-07, before issue 54's one format",
              "dcp-v1": "DTA 0.1.0 before c7cfbfa (2026-12-05)"}


def load(mode, path: str, fmt: str, sharding: str) -> list | None:
    """The legacy checkpoint ``path`` (``fmt``: a key of :data:`WRITTEN_BY`) into ``mode``'s
    pieces; returns the optimizer's saved ``param_groups`` (a replica's), or None."""
    what = f"{path!r} (written by {WRITTEN_BY[fmt]})"
    if fmt == "replicated":
        whole, buffers, groups = read_replicated(path, mode)
        load_whole(mode, whole, what=what)
        with torch.no_grad():
            for name, b in mode.model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name].to(device=b.device, dtype=b.dtype))
        return groups
    load_whole(mode, read_dcp_v1(path, mode, sharding), what=what)
    return None


# ---------------------------------------------------------------- replicated --
def read_replicated(path: str, mode) -> tuple[dict, dict, list]:
    """A replica's ``model.pt`` + ``optimizer.pt`` (tensors only, verified by the caller) as
    the logical view's whole tensors, read as this run's model names them (its optimizer's
    parameters in order are the model's trained ones: what a replica steps), the model's
    buffers, and the optimizer's ``param_groups``."""
    weights = load_tensors(os.path.join(path, "model.pt"))
    opt = load_tensors(os.path.join(path, "optimizer.pt"))
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor)
                                                for v in weights.values()):
        raise ShardedCheckpointError(f"checkpoint {path!r}: model.pt is not a state dict of "
                                     "tensors")
    shapes = dict(mode.logical_shapes())
    trained = set(shapes)
    others = set(mode.model.state_dict()) - trained  # buffers, tied names, a frozen base
    saved = [n for n in weights if n not in others]
    buffers = {n: weights[n] for n in weights if n in others}
    whole = {f"model.{n}": weights[n] for n in saved}
    groups = opt.get("param_groups") or []
    ids = [i for g in groups for i in g["params"]]
    if set(saved) == trained and mode.optimizer is not None and len(ids) != len(shapes):
        raise ShardedCheckpointError(f"checkpoint {path!r}: its optimizer holds {len(ids)} "
                                     f"parameters, the model trains {len(shapes)}")
    if set(saved) != trained or mode.optimizer is None:
        return whole, buffers, groups  # check_fits names what differs; no optimizer: weights
    keys = state_keys(mode.optimizer)
    adam = type(mode.optimizer).__name__ in ("AdamW", "Adam")
    for i, name in zip(ids, shapes):
        st = {k: v for k, v in (opt["state"].get(i) or {}).items() if v is not None}
        w = weights[name]
        for k in (keys if not st else [k for k in st if k != STEP]):
            whole[f"optim.{name}.{k}"] = st[k] if st else torch.zeros_like(w)
        if STEP in st or (not st and adam):
            whole[f"optim.{name}.{STEP}"] = torch.as_tensor(float(st.get(STEP, 0)))
    return whole, buffers, groups


# -------------------------------------------------------------------- dcp-v1 --


def _read_whole(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, in this process (no process group)."""
    import warnings

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_dcp_metadata(path)  # DCP's own classes only
    out = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise ShardedCheckpointError(f"checkpoint {path!r}: entry {fqn!r} is not a tensor")
        out[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=dcp_reader(path), no_dist=True)
    return out


def read_dcp_v1(path: str, mode, sharding: str) -> dict[str, torch.Tensor]:
    """The logical tensors of a checkpoint in the sharded format before 2026-12-05: zero1's
    masters and states flat over the trained parameters in the model's order (``zero1.*``),
    fsdp's layers as ``fsdp.param.<name>`` / ``fsdp.optim.<name>.<key>`` and its
    vocabulary weights flat (``vocab.*``), per-parameter step counts."""
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
        vocab = [n for n, _ in mode.vocab_params()]
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

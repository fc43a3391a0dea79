"""Resuming a checkpoint at another world size: what can be re-sharded, and how.

A sharded checkpoint (:mod:`runtime.dcp`) holds *logical* tensors: zero1's masters and
optimizer states as one flat tensor of all N parameter elements (``Shard(0)``, the
``torch.chunk`` cut), fsdp's layer parameters and their states as ``Shard(0)`` DTensors of
the parameters' own shapes, its vocabulary weights flat like zero1's, and per-parameter step
counts. Nothing in them depends on the world size but the cut, so:

- **W ranks → 1 rank** (:func:`load_into_replica`): one process (a replica: ``dta train``
  with ``ray.num_workers=1``) reads every logical tensor whole (DCP, no process group),
  cuts zero1's / the vocabulary's flat tensors back into parameters by the model's
  parameter order, and fills the model and an AdamW/SGD optimizer's per-parameter state.
  Nothing is applied before every tensor is read and matches the model.
- **a replicated checkpoint → W sharded ranks** (:func:`load_replicated_into_sharded`):
  every rank reads the whole ``model.pt`` / ``optimizer.pt`` (tensors only, verified) and
  keeps its own cut of each parameter and optimizer state (zero1 / the vocabulary: the flat
  slice; fsdp's layers: ``distribute_tensor`` of the local data, no communication), then
  regathers the compute parameters;
- **W ranks → W' ranks, the same mode** (W' = W included): :func:`runtime.dcp.load_sharded`;
  DCP re-cuts each logical tensor for the new ranks (``allow_reshard``);
- anything else is refused by :func:`check_resumable`, one line naming the checkpoint's and
  this run's world size and mode, before any parameter is touched: another sharded mode, a
  sharded checkpoint into W > 1 replicas.
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from runtime.checkpoints.checkpoint import read_meta, verify_manifest
from runtime.dcp import ShardedCheckpointError


def layout(path: str) -> dict:
    """{"format": "dcp" | "replicated", "world": ranks that wrote it, "sharding": mode};
    the manifest is verified first."""
    verify_manifest(path)
    meta = read_meta(path)
    if meta.get("format") == "dcp":
        return {"format": "dcp", "world": int(meta.get("world_size", -1)),
                "sharding": str(meta.get("sharding")), "meta": meta}
    return {"format": "replicated", "world": int(meta.get("num_workers") or 1),
            "sharding": "replicate", "meta": meta}


def check_resumable(path: str, world: int, mode: str) -> dict:
    """The checkpoint's layout if this run (``world`` ranks, effective ``mode``) can load it;
    else a one-line :class:`ShardedCheckpointError`."""
    saved = layout(path)
    if saved["format"] == "replicated":
        return saved  # replicas load it whole; sharded ranks keep their cut of it
    if mode == "replicate" and world == 1:
        return saved  # re-sharded into one replica
    elif mode == saved["sharding"]:
        return saved  # DCP re-cuts the logical tensors for this world size
    else:
        why = ("a sharded checkpoint resumes in its own mode (at any world size), or "
               "re-sharded on 1 rank (ray.num_workers=1)")
    raise ShardedCheckpointError(
        f"checkpoint {path!r} was saved by {saved['world']} rank(s) with "
        f"train.sharding={saved['sharding']}; this run has {world} rank(s) with "
        f"train.sharding={mode}: {why}")


def _templates(path: str) -> dict[str, torch.Tensor]:
    """Empty tensors of every saved tensor's logical shape and dtype (from DCP's metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata()
    out = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise ShardedCheckpointError(f"checkpoint {path!r}: entry {fqn!r} is not a tensor")
        out[fqn] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    return out


def _flat(named, saved: dict, prefix: str, keys, path: str) -> dict[str, dict]:
    """Per parameter name, its slices of the flat tensors ``prefix.master`` and
    ``prefix.<state key>``, and its step count."""
    total = sum(p.numel() for _, p in named)
    master = saved.get(f"{prefix}.master")
    if master is None or master.numel() != total:
        raise ShardedCheckpointError(
            f"checkpoint {path!r}: {prefix}.master holds "
            f"{None if master is None else master.numel()} elements, the model {total}")
    steps = saved[f"{prefix}.steps"]
    out, a = {}, 0
    for i, (name, p) in enumerate(named):
        n = p.numel()
        out[name] = {"param": master[a:a + n].view_as(p), "step": float(steps[i]),
                     **{k: saved[f"{prefix}.{k}"][a:a + n].view_as(p) for k in keys}}
        a += n
    return out


def logical_state(path: str, model, keys) -> dict[str, dict]:
    """Per trainable parameter name: {"param", "step", <optimizer state keys>} as whole
    tensors, read from the sharded checkpoint ``path`` (one process, no process group)."""
    import warnings

    from runtime.sharding.fsdp import _vocab_params

    mode = layout(path)["sharding"]
    saved = _templates(path)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(saved, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if mode == "zero1":
        return _flat(named, saved, "zero1", keys, path)
    if mode != "fsdp":
        raise ShardedCheckpointError(f"checkpoint {path!r}: unknown sharding {mode!r}")
    vocab = _vocab_params(model)
    out = _flat(vocab, saved, "vocab", keys, path)
    vocab_names = {n for n, _ in vocab}
    for name, p in named:
        if name in vocab_names:
            continue
        param = saved.get(f"fsdp.param.{name}")
        if param is None or tuple(param.shape) != tuple(p.shape):
            raise ShardedCheckpointError(f"checkpoint {path!r}: parameter {name!r} is missing "
                                         "or of another shape")
        step = saved.get(f"fsdp.optim.{name}.step")
        out[name] = {"param": param, "step": 0.0 if step is None else float(step),
                     **{k: saved[f"fsdp.optim.{name}.{k}"] for k in keys}}
    return out


@torch.no_grad()
def load_into_replica(path: str, model, optimizer, stepped=None) -> dict:
    """Load the sharded checkpoint ``path`` (any world size) into one replica's ``model``
    and ``optimizer`` (AdamW/Adam/SGD over the model's trainable parameters, in order, or
    over ``stepped``: what it steps in their place -- masters, host copies -- one per
    trainable parameter, filled too); returns its meta. Raises before touching anything if
    the checkpoint does not fit."""
    from torch.optim.optimizer import _get_scalar_dtype

    from runtime.sharding.state import state_keys

    meta = layout(path)["meta"]
    keys = state_keys(optimizer)
    state = logical_state(path, model, keys)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, _ in named if n not in state]
    if missing:
        raise ShardedCheckpointError(f"checkpoint {path!r} has no state for {missing[:5]}")
    targets = [p for _, p in named] if stepped is None else list(stepped)
    own = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if own != {id(p) for p in targets} or len(targets) != len(named):
        raise ShardedCheckpointError("load_into_replica: the optimizer must hold exactly the "
                                     "model's trainable parameters (or what it steps for them)")
    with_step = type(optimizer).__name__ in ("AdamW", "Adam")
    for (name, p), t in zip(named, targets):
        st = state[name]
        p.copy_(st["param"])
        if t is not p:
            t.copy_(st["param"])
        optimizer.state.pop(t, None)
        if st["step"] > 0:
            new = {k: st[k].to(device=t.device, dtype=t.dtype).clone() for k in keys}
            if with_step:
                new["step"] = torch.tensor(st["step"], dtype=_get_scalar_dtype())
            optimizer.state[t] = new
    return meta


# ------------------------------------------------------ replicated -> sharded --
def replicated_logical_state(path: str, model, keys) -> dict[str, dict]:
    """Per trainable parameter name {"param", "step", <state keys>}, from a replicated
    checkpoint (``model.pt``, ``optimizer.pt`` over the trainable parameters in order)."""
    from runtime.checkpoints.checkpoint import load_tensors

    verify_manifest(path)
    weights = load_tensors(os.path.join(path, "model.pt"))
    opt = load_tensors(os.path.join(path, "optimizer.pt"))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ids = [i for g in opt.get("param_groups", []) for i in g["params"]]
    if len(ids) != len(named):
        raise ShardedCheckpointError(f"checkpoint {path!r}: its optimizer holds {len(ids)} "
                                     f"parameters, the model {len(named)} trainable ones")
    out = {}
    for i, (name, p) in zip(ids, named):
        w = weights.get(name)
        if w is None or tuple(w.shape) != tuple(p.shape):
            raise ShardedCheckpointError(f"checkpoint {path!r}: parameter {name!r} is missing "
                                         "or of another shape")
        st = opt["state"].get(i) or {}
        if st and any(k not in st for k in keys):
            raise ShardedCheckpointError(f"checkpoint {path!r}: optimizer state of {name!r} "
                                         f"lacks one of {list(keys)}")
        out[name] = {"param": w, "step": float(st.get("step", 1 if st else 0)),
                     **{k: st[k] if st else torch.zeros_like(w) for k in keys}}
    return out


def _load_flat(shards, optimizer, state, keys) -> None:
    """Give a FlatShards (and its optimizer pieces) this rank's slice of ``state``."""
    from torch.optim.optimizer import _get_scalar_dtype

    flat = {}
    for k in ("param", *keys):
        whole = torch.cat([state[n][k].reshape(-1).to(shards.master_dtype) for n in shards.names])
        flat["master" if k == "param" else k] = whole[shards.lo:shards.hi].to(shards.device)
    steps = torch.tensor([state[n]["step"] for n in shards.names], dtype=torch.float64)
    shards.load_flat_state(optimizer, flat, steps, step_dtype=_get_scalar_dtype())


@torch.no_grad()
def load_replicated_into_sharded(path: str, strategy) -> dict:
    """Load a replicated checkpoint into a zero1/fsdp strategy (every rank calls this: the
    compute parameters are regathered); returns its meta."""
    from torch.distributed.tensor import distribute_tensor
    from torch.optim.optimizer import _get_scalar_dtype

    from runtime.sharding.state import state_keys

    meta = layout(path)["meta"]
    optimizer = strategy.optimizer
    keys = state_keys(optimizer)
    state = replicated_logical_state(path, strategy.model, keys)  # all read before any copy
    if strategy.name == "zero1":
        _load_flat(strategy.shards, optimizer, state, keys)
        return meta
    if strategy.name != "fsdp":
        raise ShardedCheckpointError(f"cannot load {path!r} into a {strategy.name} strategy")
    vocab = {id(p) for p in strategy.vocab.params}
    for name, p in strategy.model.named_parameters():
        if not p.requires_grad or id(p) in vocab:
            continue

        stepped = strategy.stepped_param(p)  # the shard, or its host copy (offload)

        def local(t, like=stepped):
            out = distribute_tensor(t.to(like.dtype), like.device_mesh, like.placements,
                                    src_data_rank=None)
            return out.to(like.to_local().device)

        st = state[name]
        p.copy_(local(st["param"], p))
        if stepped is not p:
            stepped.copy_(local(st["param"]))
        optimizer.state.pop(stepped, None)
        if st["step"] > 0:
            new = {k: local(st[k]) for k in keys}
            if type(optimizer).__name__ in ("AdamW", "Adam"):
                new["step"] = torch.tensor(st["step"], dtype=_get_scalar_dtype())
            optimizer.state[stepped] = new
    _load_flat(strategy.vocab, optimizer, state, keys)
    return meta

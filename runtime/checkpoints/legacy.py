"""The one reader of checkpoint formats this DTA no longer writes, each named by what wrote it.

- ``dcp-v1``: the sharded format written by DTA 0.1.0 before commit c7cfbfa (2026-12-05,
  "one layout-free logical view"), recognised by a DCP ``meta.json`` without ``"logical": 1``:
  zero1's masters and optimizer states flat over the trained parameters in the model's order
  (``zero1.master``, ``zero1.<key>``, ``zero1.steps``), fsdp's layers per parameter
  (``fsdp.param.<name>``, ``fsdp.optim.<name>.<key>``) and its vocabulary weights flat
  (``vocab.*``). :func:`read_dcp_v1` reads it whole in this process (DCP without a process
  group; each rank reads all of it once) as the logical view's whole tensors, which
  :func:`runtime.checkpoints.logical.load_whole` cuts into any layout's pieces.

Nothing here writes; the format written today is the logical view (:mod:`.logical`, through
:mod:`.sharded`) and a replica's files (:mod:`.checkpoint`).
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from runtime.checkpoints.logical import STEP
from runtime.checkpoints.sharded import ShardedCheckpointError

__all__ = ["WRITTEN_BY", "read_dcp_v1"]

WRITTEN_BY = {"dcp-v1": "DTA 0.1.0 before c7cfbfa (2026-12-05)"}


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

"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): the one implementation
the Ray runtime and the AReaL engine use for sharded training state.

``save_sharded(directory, step, state, meta=...)`` — called on **every** rank — writes::

    <directory>/step-000003/      DCP files: one .distcp per rank, .metadata (rank 0)
                      meta.json   step, world size, caller's meta (written last, by rank 0)
    <directory>/latest            the newest complete checkpoint's name (atomic replace)

Atomic: the ranks write into ``.tmp-step-000003-<token>`` (the token is rank 0's, broadcast),
DCP fsyncs its files (``sync_files``), rank 0 fsyncs meta.json and the directory, then
renames the directory to its final name and replaces ``latest``; a crash at any point leaves
no half checkpoint under a final name. ``state`` maps names to tensors (plain tensors are
saved once, DTensors as their shards) or to objects with ``state_dict()`` /
``load_state_dict()`` -- above all a sharding mode's logical view
(``Sharding.sharded_state()``, :mod:`runtime.sharding.logical`: every parameter and its
optimizer state by name at its whole shape, each rank its pieces), which DCP re-cuts on
load for any world size and mode (the planners of :mod:`runtime.dcp.pieces`).
``load_sharded(path, state)`` fills ``state`` in place (every rank) and returns meta.json.
meta.json records ``"logical": 1`` for a checkpoint holding the logical view; one written
by the previous sharded format (per-mode entries, before 2026-12-05) is refused by
``load_sharded`` in one line (the engine core still reads it: ``runtime.sharding.reshard``).

Trusted like every other checkpoint (``runtime.checkpoints.checkpoint``): rank 0 writes the
folder's ``manifest.json`` (SHA-256 and size of every file) before the rename, and
``load_sharded`` verifies it before DCP reads anything (DCP's ``.metadata`` is a pickle), so
a tampered or truncated shard is refused naming the file, and the Ray runtime's
``train.resume=true`` finds and checks sharded checkpoints as it does replicated ones.

DCP reports a rank's failure as ``CheckpointException`` (a ``BaseException``, its text a
multi-line traceback): :func:`save_sharded` and :func:`load_sharded` raise the rank's own
exception instead (a full disk: the ``OSError``), so callers see one line with its cause.

Pure torch.distributed: no Ray, no AReaL. Engineer-facing notes: ``_notes/sharding-dcp.md``.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from runtime.checkpoints.checkpoint import (
    latest_checkpoint,
    publish,
    verify_manifest,
    write_manifest,
)
from runtime.checkpoints.files import _fsync_dir
from runtime.dcp.pieces import LoadPlanner, SavePlanner

LATEST = "latest"
META = "meta.json"
LOGICAL = 1  # meta.json's "logical": the version of the logical view it holds


class ShardedCheckpointError(RuntimeError):
    pass


def step_name(step: int) -> str:
    return f"step-{int(step):06d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _broadcast(obj, group=None):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


@contextlib.contextmanager
def _one_process_quiet():
    """Without a process group DCP reads and writes in this one process (a replica); it
    says so in a warning every time, which a one-rank run does not need."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        yield


class CheckedState(Stateful):
    """A state entry checked against the checkpoint before it is loaded: the training
    state's logical view (``runtime.sharding.logical.LogicalState``), which loads at any
    world size and mode. ``check`` refuses (one line) a checkpoint that is not this run's."""

    def check(self, path: str, metadata, key: str) -> None:
        raise NotImplementedError


def _logical(state: dict) -> bool:
    return any(isinstance(v, CheckedState) for v in state.values())


def _dcp_state(state: dict) -> dict:
    """DCP's view: Stateful objects as they are, tensors as they are."""
    out = {}
    for k, v in state.items():
        if isinstance(v, (torch.Tensor, Stateful)) or hasattr(v, "state_dict"):
            out[k] = v
        else:
            raise TypeError(f"checkpoint entry {k!r} is a {type(v).__name__}, not a tensor or "
                            "an object with state_dict()/load_state_dict()")
    return out


def save_sharded(directory: str, step: int, state: dict, *, meta: dict | None = None,
                 group=None) -> str:
    """Write checkpoint ``step`` (every rank calls this); returns its final path."""
    directory = os.path.abspath(directory)
    final = os.path.join(directory, step_name(step))
    token = _broadcast(uuid.uuid4().hex if _rank() == 0 else None, group)
    tmp = os.path.join(directory, f".tmp-{step_name(step)}-{token}")
    if _rank() == 0:
        os.makedirs(tmp, exist_ok=True)
    _barrier(group)
    try:
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        with _one_process_quiet():
            dcp.save(_dcp_state(state), storage_writer=writer, planner=SavePlanner(),
                     process_group=group)
        _barrier(group)
        if _rank() == 0:
            with open(os.path.join(tmp, META), "w") as f:
                json.dump({"step": int(step), "world_size": _world(), "format": "dcp",
                           **({"logical": LOGICAL} if _logical(state) else {}),
                           **(meta or {})}, f, indent=1, default=str)
                f.flush()
                os.fsync(f.fileno())
            write_manifest(tmp, run_id=(meta or {}).get("run_id"), step=int(step),
                           extra={"kind": "dcp"})
            _fsync_dir(tmp)
            publish(tmp, final)
    except BaseException as exc:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        own = _own_error(exc)
        if own is not None:
            raise own from exc
        raise
    _barrier(group)
    return final


def _own_error(exc: BaseException) -> Exception | None:
    """The exception a rank raised inside DCP's ``CheckpointException`` (lowest rank first),
    or None when ``exc`` is not one."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ != "CheckpointException" or not isinstance(failures, dict) \
            or not failures:
        return None
    first = failures[min(failures)]
    inner = first[0] if isinstance(first, tuple) else first
    return inner if isinstance(inner, Exception) else None


def latest_sharded(directory: str | None) -> str | None:
    """The newest complete sharded checkpoint in ``directory``, or None: complete means
    published with its manifest, exactly as for the replicated format."""
    return latest_checkpoint(directory)


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, META)) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ShardedCheckpointError(f"checkpoint {path!r} is unreadable: {exc}") from None


def load_sharded(path: str, state: dict, *, group=None) -> dict:
    """Load ``path`` into ``state`` in place (every rank calls this); returns its meta.
    The manifest is verified first: nothing is read from an unverified folder. A logical
    view loads at any world size and mode; anything else only at the world size that wrote
    it."""
    verify_manifest(path)
    meta = read_meta(path)
    if meta.get("format") != "dcp":
        raise ShardedCheckpointError(f"checkpoint {path!r} is not a DCP checkpoint")
    if _logical(state) and meta.get("logical") != LOGICAL:
        raise ShardedCheckpointError(
            f"checkpoint {path!r} holds the sharded state in the format before 2026-12-05 "
            f"(per mode, train.sharding={meta.get('sharding')} on {meta.get('world_size')} "
            "ranks), not the logical view this DTA loads here; resume it through the engine "
            "core (dta train / verl), or with the DTA that wrote it")
    if _logical(state):  # its parameters and optimizer state are this run's (one line)
        metadata = dcp.FileSystemReader(path).read_metadata()  # a pickle: verified above
        for k, v in state.items():
            if isinstance(v, CheckedState):
                v.check(path, metadata, k)
    elif int(meta.get("world_size", -1)) != _world():
        raise ShardedCheckpointError(
            f"checkpoint {path!r} was written by {meta.get('world_size')} ranks, this run has "
            f"{_world()} (resume at the same world size)")
    try:
        with _one_process_quiet():
            dcp.load(_dcp_state(state), storage_reader=dcp.FileSystemReader(path),
                     planner=LoadPlanner(), process_group=group)
    except BaseException as exc:
        own = _own_error(exc)
        if own is not None:
            raise own from exc
        raise
    return meta

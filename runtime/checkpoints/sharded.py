"""The one checkpoint format, with ``torch.distributed.checkpoint`` (DCP): what every layout
writes -- sharded ones (every rank its pieces) and one-shard ones (a replica, a plain model:
one process, ``local=True``, no collective) -- for the Ray runtime and the AReaL and verl doors.

``save_sharded(directory, step, state, meta=..., files=...)`` -- called on **every** rank of
the group, or in one process with ``local`` -- writes::

    <directory>/step-000003/      DCP files: one .distcp per writing rank, .metadata (rank 0)
                      rng.pt      ``files``: tensors rank 0 writes beside them (its RNG states)
                      meta.json   step, world size, caller's meta (written last, by rank 0)
    <directory>/latest            the newest complete checkpoint's name (atomic replace)

Atomic: the ranks write into ``.tmp-step-000003-<token>`` (the token is rank 0's, broadcast),
DCP fsyncs its files (``sync_files``), rank 0 fsyncs meta.json and the directory, then
renames the directory to its final name and replaces ``latest``; a crash at any point leaves
no half checkpoint under a final name. ``state`` maps names to tensors (plain tensors are
saved once, DTensors as their shards) or to objects with ``state_dict()`` /
``load_state_dict()`` -- above all a sharding mode's logical view
(``Sharding.sharded_state()``, :mod:`runtime.checkpoints.logical`: every parameter and its
optimizer state by name at its whole shape, each rank its pieces), which DCP re-cuts on
load for any world size and mode (the planners of :mod:`runtime.checkpoints.pieces`).
``load_sharded(path, state)`` fills ``state`` in place (every rank) and returns meta.json.
meta.json records ``"logical": 1`` for a checkpoint holding the logical view; one written
by the previous sharded format (per-mode entries, before 2026-12-05) is refused by
``load_sharded`` in one line (the engine core still reads it: ``runtime.checkpoints.legacy``).

Trusted like every other checkpoint (``runtime.checkpoints.checkpoint``): rank 0 writes the
folder's ``manifest.json`` (SHA-256 and size of every file) before the rename, and
``load_sharded`` verifies it before DCP reads anything, so a tampered or truncated shard is
refused naming the file; DCP's ``.metadata`` (a pickle) is read through an allow-list of
DCP's own classes (``runtime.checkpoints.files.read_dcp_metadata``), its tensors
``weights_only``, so a planted object never runs even with a rewritten manifest.

DCP reports a rank's failure as ``CheckpointException`` (a ``BaseException``, its text a
multi-line traceback): :func:`save_sharded` and :func:`load_sharded` raise the rank's own
exception instead (a full disk: the ``OSError`` naming the file, where torch would say
"unexpected pos"), so callers see one line with its cause.

Pure torch.distributed: no Ray, no AReaL. Engineer-facing notes: ``_notes/sharding-dcp.md``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from runtime.checkpoints.files import (
    META,
    CheckpointError,
    _fsync_dir,
    _with_path,
    _write_json,
    dcp_reader,
    dcp_writer,
    publish,
    read_dcp_metadata,
    read_meta,
    save_tensors,
    step_name,
    verify_manifest,
    write_manifest,
)
from runtime.checkpoints.pieces import LoadPlanner, SavePlanner

LOGICAL = 1  # meta.json's "logical": the version of the logical view it holds


class ShardedCheckpointError(CheckpointError):
    """A sharded checkpoint that does not fit this run (a :class:`CheckpointError`)."""


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
    state's logical view (``runtime.checkpoints.logical.LogicalState``), which loads at any
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
                 group=None, local: bool = False, files: dict | None = None) -> str:
    """Write checkpoint ``step`` (every rank of ``group`` calls this; ``local``: this
    process alone, a one-shard layout -- a replica's whole state or a plain model -- with no
    collective); returns its final path. ``files``: name -> tensors (and numbers) rank 0
    writes beside DCP's files (``rng.pt``), checksummed with them."""
    directory = os.path.abspath(directory)
    final = os.path.join(directory, step_name(step))
    rank = 0 if local else _rank()
    token = uuid.uuid4().hex if local else _broadcast(uuid.uuid4().hex if rank == 0 else None,
                                                      group)
    tmp = os.path.join(directory, f".tmp-{step_name(step)}-{token}")
    if rank == 0:
        os.makedirs(tmp, exist_ok=True)
    if not local:
        _barrier(group)
    try:
        writer = dcp_writer(tmp)
        with _one_process_quiet():
            dcp.save(_dcp_state(state), storage_writer=writer, planner=SavePlanner(),
                     process_group=group, no_dist=local)
        if not local:
            _barrier(group)
        if rank == 0:
            for name, obj in (files or {}).items():
                save_tensors(obj, os.path.join(tmp, name))
            _write_json(os.path.join(tmp, META), {  # strict JSON (NaN: null)
                "step": int(step), "world_size": 1 if local else _world(), "format": "dcp",
                **({"logical": LOGICAL} if _logical(state) else {}), **(meta or {})})
            _modes(tmp)
            write_manifest(tmp, run_id=(meta or {}).get("run_id"), step=int(step),
                           extra={"kind": "dcp"})
            _fsync_dir(tmp)
            publish(tmp, final)
    except BaseException as exc:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        own = _own_error(exc)
        err = exc if own is None else own
        if isinstance(err, OSError):  # a full disk: name the folder it failed in
            err = _with_path(err, tmp)
        if err is not exc:
            raise err from exc
        raise
    if not local:
        _barrier(group)
    return final


def _modes(tmp: str) -> None:
    """Folders ``0o755`` at most, files ``0o644`` at most (never writable by others)."""
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)


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


def load_sharded(path: str, state: dict, *, group=None, local: bool = False) -> dict:
    """Load ``path`` into ``state`` in place (every rank of ``group`` calls this; ``local``:
    this process alone reads what it holds, no collective); returns its meta.
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
            "(written by DTA 0.1.0 before c7cfbfa: runtime.checkpoints.legacy) "
            f"(per mode, train.sharding={meta.get('sharding')} on {meta.get('world_size')} "
            "ranks), not the logical view this DTA loads here; resume it through the engine "
            "core (dta train / verl), or with the DTA that wrote it")
    if _logical(state):  # its parameters and optimizer state are this run's (one line)
        metadata = read_dcp_metadata(path)  # DCP's own classes only
        for k, v in state.items():
            if isinstance(v, CheckedState):
                v.check(path, metadata, k)
    elif int(meta.get("world_size", -1)) != (1 if local else _world()):
        raise ShardedCheckpointError(
            f"checkpoint {path!r} was written by {meta.get('world_size')} ranks, this run has "
            f"{_world()} (resume at the same world size)")
    try:
        with _one_process_quiet():
            dcp.load(_dcp_state(state), storage_reader=dcp_reader(path),
                     planner=LoadPlanner(), process_group=group, no_dist=local)
    except BaseException as exc:
        own = _own_error(exc)
        if own is not None:
            raise own from exc
        raise
    return meta

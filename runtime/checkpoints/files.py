"""Checkpoint files: tensors-only reads, fsynced writes that name the file they failed on,
and SHA-256 manifests (:mod:`runtime.checkpoints.checkpoint` builds runs and steps on them;
the sharded formats use the manifest helpers too). Pure torch: no Ray."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import uuid

import torch

from dta.records.jsonl import json_safe
from runtime.checkpoints.folders import CheckpointError  # noqa: F401 (torch-free, re-exported)
from runtime.checkpoints.folders import fsync_dir as _fsync_dir  # noqa: F401 (used by checkpoint, dcp)

MANIFEST = "manifest.json"
FORMAT = 2
LATEST = "latest"  # the newest complete checkpoint's name
META = "meta.json"  # a checkpoint's step, run and settings


def step_name(step: int) -> str:
    """A checkpoint's folder name (every format): ``step-000003``."""
    return f"step-{int(step):06d}"


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json (every format); unreadable: :class:`CheckpointError`."""
    try:
        with open(os.path.join(path, META)) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path!r} is unreadable: {exc}") from None


def publish(tmp: str, final: str) -> None:
    """Make the complete, fsynced checkpoint folder ``tmp`` the checkpoint ``final`` and
    point ``latest`` at it, each by an atomic rename (a crash leaves either the old state or
    the new one, never half a checkpoint under a final name). Shared by every format."""
    directory = os.path.dirname(final)
    if os.path.exists(final):  # rewriting a step: move the old one away first
        trash = os.path.join(directory, f".old-{uuid.uuid4().hex}")
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(directory)
    pointer = os.path.join(directory, f".{LATEST}-{uuid.uuid4().hex}")
    try:
        with open(pointer, "w") as f:
            f.write(os.path.basename(final) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:  # the checkpoint is complete; `latest` still names the previous
        try:
            os.unlink(pointer)
        except OSError:
            pass
        raise _with_path(exc, os.path.join(directory, LATEST)) from None
    os.chmod(pointer, 0o644)
    os.replace(pointer, os.path.join(directory, LATEST))
    _fsync_dir(directory)


class _Recorder:
    """A file ``torch.save`` writes through, remembering the ``OSError`` of a failed write
    (torch reports it only as "unexpected pos N vs M")."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _with_path(exc: OSError, path: str) -> OSError:
    """``exc`` naming ``path`` ("[Errno 28] No space left on device: 'path'")."""
    if exc.filename is not None or exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, path)


def save_tensors(obj, path: str) -> None:
    """``torch.save(obj, path)``, fsynced; a failed write raises the ``OSError`` with ``path``."""
    try:
        with open(path, "wb") as f:
            sink = _Recorder(f)
            try:
                torch.save(obj, sink)
            except RuntimeError:
                if sink.error is not None:
                    raise sink.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise _with_path(exc, path) from None



def _mkdir(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o022:  # created before, or under umask 0: never writable by group/others
        os.chmod(path, mode & ~0o022)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(path: str, *, run_id: str | None, step: int | None,
                   extra: dict | None = None) -> dict:
    """Checksum every file under ``path`` (recursively, the manifest itself excluded) into
    ``path/manifest.json``; returns the manifest."""
    files = {}
    for root, _, names in os.walk(path):
        for name in sorted(names):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel == MANIFEST:
                continue
            files[rel] = {"bytes": os.path.getsize(full), "sha256": sha256(full)}
    manifest = {"format": FORMAT, "run_id": run_id, "step": step, "files": files,
                **(extra or {})}
    _write_json(os.path.join(path, MANIFEST), manifest)
    return manifest


def verify_manifest(path: str) -> dict:
    """Check every file of checkpoint ``path`` against its manifest; returns the manifest.
    Raises :class:`CheckpointError` naming the first file that differs, is missing, or is
    not in the manifest."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path!r} has no readable {MANIFEST} ({exc}); it "
                              "cannot be verified, so it is not loaded") from None
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel != MANIFEST and rel not in files:
                raise CheckpointError(f"checkpoint {path!r}: file {rel!r} is not in its manifest "
                                      "(added after the checkpoint was written); refused")
    for rel, want in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path!r}: file {rel!r} is missing")
        size = os.path.getsize(full)
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path!r}: file {rel!r} has {size} bytes, the "
                                  f"manifest says {want['bytes']} (corrupted or replaced)")
        digest = sha256(full)
        if digest != want["sha256"]:
            raise CheckpointError(f"checkpoint {path!r}: file {rel!r} fails its SHA-256 check "
                                  f"(corrupted or replaced): {digest[:16]}... != "
                                  f"{want['sha256'][:16]}...")
    return manifest


def load_tensors(path: str, map_location=None):
    """``torch.load`` that unpickles tensors and plain containers only."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # name what was refused (torch's text goes on to suggest weights_only=False: never)
        found = re.search(r"(Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+)", str(exc))
        what = found.group(1) if found else "a pickled object"
        raise CheckpointError(f"{path!r} holds more than tensors ({what}); refused: checkpoints "
                              "are loaded tensors-only (weights_only=True)") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path!r} is unreadable: {str(exc).splitlines()[0][:200]}") from None


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "w") as f:
            json.dump(json_safe(obj), f, indent=1, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise _with_path(exc, path) from None
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# DCP's ``.metadata`` is a pickle: only the classes DCP writes there are unpickled (a planted
# object is refused naming it, and nothing of it runs), as ``load_tensors`` does for tensors.
_DCP_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                           "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                           "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def read_dcp_metadata(path: str):
    """A DCP checkpoint's ``.metadata`` (its tensors' names, shapes and storage), unpickling
    DCP's own metadata classes only; anything else is a :class:`CheckpointError`."""
    full = os.path.join(path, ".metadata")
    try:
        with open(full, "rb") as f:
            return _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{full!r} holds more than DCP's metadata ({exc}); refused: "
                              "checkpoints are loaded tensors-only") from None
    except OSError as exc:
        raise CheckpointError(f"{full!r} is unreadable: {exc.strerror or exc}") from None


def dcp_reader(path: str):
    """DCP's ``FileSystemReader`` of ``path`` whose metadata is read by
    :func:`read_dcp_metadata` (its tensors DCP reads with ``weights_only=True`` itself)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = read_dcp_metadata(path)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return Reader(path)


def dcp_writer(path: str):
    """DCP's ``FileSystemWriter`` into ``path`` (files fsynced) whose failed writes raise the
    ``OSError`` naming the file (torch would say "unexpected pos N vs M" of a full disk)."""
    import contextlib

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Files(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, name, mode: str):
            with super().create_stream(name, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                sink = _Stream(stream)
                try:
                    yield sink
                except RuntimeError:
                    if sink.error is not None:
                        raise _with_path(sink.error, str(name)) from None
                    raise

    writer = FileSystemWriter(path, sync_files=True)
    writer.fs = Files()
    return writer


class _Stream(_Recorder):
    """A DCP stream written through, remembering a failed write's ``OSError``."""

    def __getattr__(self, name: str):
        return getattr(self.f, name)

"""Checkpoints you can trust: atomic, checksummed, tensors only, one run per folder.

Layout of ``<dir>``::

    run.json              the run that owns the folder: {"run_id", "created", "format"}
    step-000003/          one directory per checkpoint (written as .tmp-*, then renamed)
        model.pt          model state_dict (tensors; a LoRA model: its adapters only)
        optimizer.pt      optimizer state_dict (tensors, numbers, lists)
        rng.pt            torch (+ CUDA), numpy and python RNG states (tensors, numbers)
        meta.json         step, config (resolved), plan settings, run statistics
        manifest.json     run id, step, and the SHA-256 and size of every file above
    latest                the name of the newest complete checkpoint (replaced atomically)

Trust rules:

* **Nothing but tensors is unpickled**: every ``.pt`` file is read with
  ``torch.load(weights_only=True)``; a file holding anything else (a planted pickle) is
  refused and nothing of it runs.
* **Checksums first**: a checkpoint is loaded only after every file matches its manifest
  (size and SHA-256), so a flipped byte is an error naming the file, never 6e28 weights.
  All files are read before any is applied: a refused checkpoint leaves model and
  optimizer untouched.
* **Only its own folders**: :func:`prepare_run` (called before step 0) accepts a folder that
  is missing, empty, or a DTA run folder (its ``run.json``); anything else (a folder holding
  other files) is refused, naming what is in it, and nothing is written there.
* **One run per folder**: it refuses a fresh run in a folder that holds another run's
  checkpoints, and a resume of a folder that is missing or holds none; it checks the folder
  is writable. A checkpoint whose manifest names another run than the folder's ``run.json``
  is refused.
* **Atomic**: a crash while writing leaves at worst a ``.tmp-*`` directory, never a half
  checkpoint under a final name; ``latest`` only ever names a complete one.
* **Retention**: ``keep_last`` keeps the newest N checkpoints and deletes older ones, after
  the new one is complete — only checkpoints whose manifest names this run.
* **Failures say where**: a write that fails (a full disk) raises ``OSError`` naming the file
  (``torch.save`` alone would say "unexpected pos"); the previous checkpoint and ``latest``
  are untouched and the partial ``.tmp-*`` folder is removed.

The manifest helpers (:func:`write_manifest`, :func:`verify_manifest`, :func:`load_tensors`)
work for any checkpoint folder, e.g. a torch.distributed.checkpoint one. Pure torch: no Ray.
Folders are created ``0o755`` at most and files ``0o644`` at most (never writable by others).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from dta.lora import trained_state
from runtime.ray_runtime.folders import RUN_FILE, foreign_folder

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = 2
_STEP = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    pass


def step_name(step: int) -> str:
    return f"step-{int(step):06d}"


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


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _mkdir(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)
    mode = os.stat(path).st_mode & 0o777
    if mode & 0o022:  # created before, or under umask 0: never writable by group/others
        os.chmod(path, mode & ~0o022)


# ------------------------------------------------------------------------ RNG --
def rng_state() -> dict:
    """Every RNG state as tensors and plain numbers (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["internal"].tolist()),
                     p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------- manifest --
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


# ------------------------------------------------------------------------ runs --
@dataclass
class RunInfo:
    directory: str
    run_id: str
    resumed_from: str | None  # the checkpoint a resumed run continues from


def read_run(directory: str) -> dict | None:
    path = os.path.join(directory, RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path!r} is unreadable: {exc}") from None


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


def checkpoints(directory: str) -> list[str]:
    """Complete checkpoints (with a manifest) in ``directory``, oldest first."""
    if not directory or not os.path.isdir(directory):
        return []
    names = sorted((int(m.group(1)), n) for n in os.listdir(directory)
                   if (m := _STEP.match(n)) and os.path.isfile(os.path.join(directory, n, MANIFEST)))
    return [os.path.join(directory, n) for _, n in names]


def check_writable(directory: str) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CheckpointError(f"checkpoint folder {directory!r} is not writable: "
                              f"{exc.strerror or exc}") from None


def prepare_run(directory: str, *, resume: bool) -> RunInfo:
    """Claim ``directory`` for this run before step 0 (see the module doc)."""
    directory = os.path.abspath(directory)
    refused = foreign_folder(directory)
    if refused:
        raise CheckpointError(refused)
    if resume:
        if not os.path.isdir(directory):
            raise CheckpointError(f"train.resume=true but the checkpoint folder {directory!r} "
                                  "does not exist (a typo? nothing to resume)")
        latest = latest_checkpoint(directory)
        if latest is None:
            raise CheckpointError(f"train.resume=true but {directory!r} holds no complete "
                                  "checkpoint (nothing to resume)")
        run = read_run(directory)
        run_id = (run or {}).get("run_id") or _manifest_run(latest) or uuid.uuid4().hex
        check_writable(directory)
        return RunInfo(directory, run_id, latest)
    if os.path.isdir(directory):
        run = read_run(directory)
        held = checkpoints(directory)
        # a run folder without a checkpoint (its first save failed) has nothing to overwrite
        if held or os.path.exists(os.path.join(directory, LATEST)):
            owner = f"run {run['run_id']}" if run and run.get("run_id") else "another run"
            last = f", latest {os.path.basename(held[-1])}" if held else ""
            raise CheckpointError(
                f"checkpoint folder {directory!r} already holds {owner}{last}; a new run "
                "would overwrite it. Resume it (train.resume=true) or choose an empty folder")
    else:
        try:
            _mkdir(directory)
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint folder {directory!r}: "
                                  f"{exc.strerror or exc}") from None
    check_writable(directory)
    run_id = uuid.uuid4().hex
    _write_json(os.path.join(directory, RUN_FILE), _run_record(run_id))
    return RunInfo(directory, run_id, None)


def _run_record(run_id: str) -> dict:
    return {"run_id": run_id, "format": FORMAT,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _manifest_run(path: str) -> str | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ save / load --
def save_checkpoint(directory: str, step: int, model, optimizer, meta: dict | None = None, *,
                    run_id: str | None = None, keep_last: int | None = None) -> str:
    """Write checkpoint ``step`` atomically (with its manifest); returns its final path.
    ``run_id`` defaults to the folder's (``run.json``); ``keep_last`` deletes all but the
    newest N checkpoints afterwards."""
    refused = foreign_folder(directory)
    if refused:
        raise CheckpointError(refused)
    _mkdir(directory)
    run = read_run(directory)
    if run_id is None:
        run_id = (run or {}).get("run_id")
    elif run is not None and run.get("run_id") not in (None, run_id):
        raise CheckpointError(f"checkpoint folder {directory!r} belongs to run {run['run_id']}, "
                              f"not to this run ({run_id}); refusing to mix two runs")
    if run is None:
        run_id = run_id or uuid.uuid4().hex
        _write_json(os.path.join(directory, RUN_FILE), _run_record(run_id))
    final = os.path.join(directory, step_name(step))
    tmp = tempfile.mkdtemp(prefix=f".tmp-{step_name(step)}-", dir=directory)
    try:
        os.chmod(tmp, 0o755)
        save_tensors({k: v.detach().cpu() for k, v in trained_state(model).items()},
                     os.path.join(tmp, "model.pt"))
        save_tensors(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        save_tensors(rng_state(), os.path.join(tmp, "rng.pt"))
        _write_json(os.path.join(tmp, "meta.json"), {"step": int(step), "run_id": run_id,
                                                     **(meta or {})})
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        write_manifest(tmp, run_id=run_id, step=int(step))
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last:
        prune(directory, int(keep_last), keep=final, run_id=run_id)
    return final


def prune(directory: str, keep_last: int, keep: str | None = None,
          run_id: str | None = None) -> list[str]:
    """Delete all but the newest ``keep_last`` of this run's checkpoints (never ``keep``);
    returns those deleted. This run: ``run_id``, default the folder's ``run.json``; only
    checkpoints whose manifest names it are counted or deleted (never another run's)."""
    if run_id is None:
        run_id = (read_run(directory) or {}).get("run_id")
    held = [p for p in checkpoints(directory) if _manifest_run(p) == run_id]
    doomed = [p for p in held[:max(0, len(held) - keep_last)]
              if os.path.abspath(p) != os.path.abspath(keep or "")]
    for path in doomed:
        trash = os.path.join(directory, f".old-{uuid.uuid4().hex}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def latest_checkpoint(directory: str | None) -> str | None:
    """The newest complete checkpoint in ``directory``, or None."""
    if not directory or not os.path.isdir(directory):
        return None
    pointer = os.path.join(directory, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        path = os.path.join(directory, name)
        if _STEP.match(name) and os.path.isfile(os.path.join(path, MANIFEST)):
            return path
    held = checkpoints(directory)
    return held[-1] if held else None


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path!r} is unreadable: {exc}") from None


def load_checkpoint(path: str, model, optimizer=None, *, restore_rng: bool = True) -> dict:
    """Verify ``path`` (manifest, run), read every file (tensors only), then load them into
    ``model`` (and ``optimizer``); returns its meta. Nothing is applied unless all of it
    verifies and reads."""
    manifest = verify_manifest(path)
    run = read_run(os.path.dirname(os.path.abspath(path)))
    if run is not None and manifest.get("run_id") not in (None, run.get("run_id")):
        raise CheckpointError(f"checkpoint {path!r} belongs to run {manifest['run_id']}, but its "
                              f"folder to run {run.get('run_id')}: two runs were mixed; refused")
    meta = read_meta(path)
    device = next(model.parameters()).device
    state = load_tensors(os.path.join(path, "model.pt"), map_location=device)
    opt_state = (load_tensors(os.path.join(path, "optimizer.pt"), map_location=device)
                 if optimizer is not None else None)
    rng = load_tensors(os.path.join(path, "rng.pt")) if restore_rng else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint {path!r}: model.pt is not a state dict of tensors")
    own = trained_state(model)  # a LoRA model: its adapters only
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}, other shape "
                              f"{shapes[:5]}")
    model.load_state_dict(state, strict=len(own) == len(model.state_dict()))
    if optimizer is not None:
        optimizer.load_state_dict(opt_state)
    if rng is not None:
        set_rng_state(rng)
    return meta


def _finite(x):
    """Strict JSON: NaN/inf (a skipped step's loss) written as null."""
    if isinstance(x, float):
        return x if np.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (np.generic, np.ndarray)):
        return _finite(x.tolist())
    return x


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with open(tmp, "w") as f:
            json.dump(_finite(obj), f, indent=1, default=_jsonable, allow_nan=False)
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


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)

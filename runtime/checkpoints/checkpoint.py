"""Checkpoints you can trust: atomic, checksummed, tensors only, one run per folder.

Layout of ``<dir>``::

    run.json              the run that owns the folder: {"run_id", "created", "format",
                          "started", "pid", "host"}; locked while that run lives
    step-000003/          one directory per checkpoint (written as .tmp-*, then renamed)
        __0_0.distcp      DCP files of the training state's logical view, one per writing
                          rank (runtime.checkpoints.logical: per trained parameter, by name
                          and whole shape, the weights the optimizer steps and its state;
                          a LoRA model: its adapters only) -- written by every layout
        .metadata         DCP's index of them (read with an allow-list: DCP's classes only)
        rng.pt            rank 0's torch (+ CUDA), numpy and python RNG states (tensors)
        meta.json         step, format, run, the optimizer's hyperparameters, config
                          (resolved), plan settings, run statistics
        manifest.json     run id, step, and the SHA-256 and size of every file above
    latest                the name of the newest complete checkpoint (replaced atomically)

Trust rules:

* **Nothing but tensors is unpickled**: every ``.pt`` file is read with
  ``torch.load(weights_only=True)`` (DCP reads its tensors so too) and DCP's ``.metadata``
  with an allow-list of DCP's own classes; a file holding anything else (a planted pickle)
  is refused and nothing of it runs.
* **Checksums first**: a checkpoint is loaded only after every file matches its manifest
  (size and SHA-256), so a flipped byte is an error naming the file, never 6e28 weights.
  All files are read before any is applied: a refused checkpoint leaves model and
  optimizer untouched.
* **Only its own folders**: :func:`prepare_run` (called before step 0) accepts a folder that
  is missing, empty, or a DTA run folder (its ``run.json``); anything else (a folder holding
  other files) is refused, naming what is in it, and nothing is written there.
* **One run per folder, from its first second**: :func:`prepare_run` claims the folder
  before anything is written there, by creating ``run.json`` exclusively and holding it
  locked for the run's life (:mod:`runtime.checkpoints.claim`: the kernel lets go when the
  run ends, crashes or is killed). Of two runs started together exactly one gets it; the
  other is refused at once naming the owner and how to resume it. It refuses a fresh run in
  a folder that holds another (stopped) run's checkpoints, and a resume of a folder that is
  missing or holds none; a stopped run without a checkpoint leaves the folder to the next.
  A checkpoint whose manifest names another run than the folder's ``run.json`` is refused.
* **Atomic**: a crash while writing leaves at worst a ``.tmp-*`` directory, never a half
  checkpoint under a final name; ``latest`` only ever names a complete one.
* **Retention**: ``keep_last`` keeps the newest N checkpoints and deletes older ones, after
  the new one is complete — only checkpoints whose manifest names this run.
* **Failures say where**: a write that fails (a full disk) raises ``OSError`` naming the file
  (``torch.save`` alone would say "unexpected pos"); the previous checkpoint and ``latest``
  are untouched and the partial ``.tmp-*`` folder is removed.

The manifest helpers (:func:`write_manifest`, :func:`verify_manifest`, :func:`load_tensors`,
in :mod:`runtime.checkpoints.files`)
work for any checkpoint folder, e.g. a torch.distributed.checkpoint one. Pure torch: no Ray.
Folders are created ``0o755`` at most and files ``0o644`` at most (never writable by others).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from dta.paths import check_path
from runtime.checkpoints.claim import Claim, claim_folder, create_record, run_record
from runtime.checkpoints.files import (  # noqa: F401
    FORMAT,
    LATEST,
    MANIFEST,
    META,
    CheckpointError,
    _fsync_dir,
    _mkdir,
    _with_path,
    _write_json,
    load_tensors,
    publish,
    read_meta,
    save_tensors,
    step_name,
    verify_manifest,
    write_manifest,
)
from runtime.checkpoints.folders import RUN_FILE, foreign_folder

RNG = "rng.pt"  # rank 0's RNG states (torch, CUDA, numpy, python)
GROUPS = "optimizer_groups"  # meta.json: the optimizer's hyperparameters per group
_STEP = re.compile(r"^step-(\d{6,})$")


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


# ------------------------------------------------------------------------ runs --
@dataclass
class RunInfo:
    directory: str
    run_id: str
    resumed_from: str | None  # the checkpoint a resumed run continues from
    claim: Claim | None = None  # this process's hold on the folder (runtime.checkpoints.claim)
    created: bool = False  # prepare_run made the folder

    def release(self) -> None:
        """The run has ended: let the folder go (another run may resume or take it)."""
        if self.claim is not None:
            self.claim.release()

    def withdraw(self) -> None:
        """The run is refused before its first step (another of its folders is not free):
        leave the folder as it was found, when it was missing or empty (the claim replaced no
        other run's record), then let it go."""
        if self.claim is not None and self.claim.previous is None and self.claim.held:
            try:
                os.unlink(os.path.join(self.directory, RUN_FILE))
                if self.created:
                    os.rmdir(self.directory)
            except OSError:
                pass  # something else is there now: it stays
        self.release()


def read_run(directory: str) -> dict | None:
    path = os.path.join(directory, RUN_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path!r} is unreadable: {exc}") from None


def checkpoints(directory: str) -> list[str]:
    """Complete checkpoints (with a manifest) in ``directory``, oldest first."""
    if not directory or not os.path.isdir(directory):
        return []
    names = sorted((int(m.group(1)), n) for n in os.listdir(directory)
                   if (m := _STEP.match(n)) and os.path.isfile(os.path.join(directory, n, MANIFEST)))
    return [os.path.join(directory, n) for _, n in names]


def prepare_run(directory: str, *, resume: bool) -> RunInfo:
    """Claim ``directory`` for this run before step 0, before anything is written there (see
    the module doc); the claim lasts until ``RunInfo.release()`` or the process's end."""
    directory = os.path.abspath(directory)
    if resume and not os.path.lexists(directory):
        raise CheckpointError(f"train.resume=true but the checkpoint folder {directory!r} "
                              "does not exist (a typo? nothing to resume)")
    check_path(directory, "dir", "train.checkpoint_dir", create=not resume, write=True,
               error=CheckpointError)
    refused = foreign_folder(directory)
    if refused:
        raise CheckpointError(refused)
    created = not os.path.isdir(directory)
    if created:
        try:
            _mkdir(directory)
        except OSError as exc:
            raise CheckpointError(f"cannot create the checkpoint folder {directory!r}: "
                                  f"{exc.strerror or exc}") from None
    resumed_from = []

    def decide(previous: dict | None) -> dict:  # holding the folder: this run's record
        if resume:
            latest = latest_checkpoint(directory)
            if latest is None:
                raise CheckpointError(f"train.resume=true but {directory!r} holds no complete "
                                      "checkpoint (nothing to resume)")
            resumed_from[:] = [latest]
            run_id = (previous or {}).get("run_id") or _manifest_run(latest) or uuid.uuid4().hex
            return _run_record(run_id, created=(previous or {}).get("created"))
        held = checkpoints(directory)
        # a stopped run without a checkpoint (its first save failed) has nothing to overwrite
        if held or os.path.exists(os.path.join(directory, LATEST)):
            owner = f"run {previous['run_id']}" if previous else "another run"
            last = f", latest {os.path.basename(held[-1])}" if held else ""
            raise CheckpointError(
                f"checkpoint folder {directory!r} already holds {owner}{last}; a new run "
                "would overwrite it. Resume it (train.resume=true) or choose an empty folder")
        return _run_record(uuid.uuid4().hex)

    claim = claim_folder(directory, decide, resume=resume)
    return RunInfo(directory, claim.run_id, resumed_from[0] if resumed_from else None, claim,
                   created)


def _run_record(run_id: str, created: str | None = None) -> dict:
    return {**run_record(run_id, created), "format": FORMAT}


def _manifest_run(path: str) -> str | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ save / load --
def folder_run(directory: str, run_id: str | None) -> str:
    """The run a one-process save writes for: ``run_id``, default the folder's (``run.json``);
    a folder of another run is refused, one without ``run.json`` (the Python API, no
    :func:`prepare_run`) is named this run's by its first save."""
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
    if run is None:  # no prepare_run (the Python API): the first save names the folder's run
        mine = run_id or uuid.uuid4().hex
        if not create_record(directory, _run_record(mine)):  # another one named it first
            theirs = (read_run(directory) or {}).get("run_id")
            if run_id is not None and theirs != run_id:
                raise CheckpointError(f"checkpoint folder {directory!r} belongs to run {theirs}, "
                                      f"not to this run ({run_id}); refusing to mix two runs")
            mine = theirs or mine
        run_id = mine
    return run_id


def optimizer_groups(optimizer) -> list[dict]:
    """The optimizer's hyperparameters per group (``param_groups`` without the parameters),
    as JSON for meta.json; restored by :func:`restore_groups`."""
    out = []
    for group in [] if optimizer is None else optimizer.param_groups:
        saved = {}
        for k, v in group.items():
            if k == "params":
                continue
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            if v is None or isinstance(v, (bool, int, float, str, list)):
                saved[k] = v
        out.append(saved)
    return out


def restore_groups(optimizer, groups) -> None:
    """Hyperparameters saved by :func:`optimizer_groups` (or a legacy ``optimizer.pt``'s
    ``param_groups``) into ``optimizer``, when it has as many groups."""
    if optimizer is None or not groups or len(groups) != len(optimizer.param_groups):
        return
    for group, saved in zip(optimizer.param_groups, groups):
        for k, v in saved.items():
            if k == "params" or k not in group:
                continue
            now = group[k]
            if isinstance(now, torch.Tensor):
                now.fill_(v)
            else:
                group[k] = tuple(v) if isinstance(now, tuple) else v


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


def check_owner(path: str, manifest: dict) -> None:
    """Refuse a checkpoint whose manifest names another run than its folder's run.json."""
    run = read_run(os.path.dirname(os.path.abspath(path)))
    if run is not None and manifest.get("run_id") not in (None, run.get("run_id")):
        raise CheckpointError(f"checkpoint {path!r} belongs to run {manifest['run_id']}, but its "
                              f"folder to run {run.get('run_id')}: two runs were mixed; refused")


def replica_meta(optimizer) -> dict:
    """What meta.json holds beside the state for a replica's resume: the hyperparameters."""
    return {GROUPS: optimizer_groups(optimizer)}


def replica_files() -> dict:
    """The files beside the state (rank 0's): its RNG states (tensors and numbers)."""
    return {RNG: rng_state()}

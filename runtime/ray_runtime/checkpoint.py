"""Atomic checkpoints: model, optimizer, step, RNG states and the run's configuration.

Layout of ``<dir>``::

    step-000003/          one directory per checkpoint (written as .tmp-*, then renamed)
        model.pt          model state_dict
        optimizer.pt      optimizer state_dict
        rng.pt            torch (+ CUDA), numpy and python RNG states
        meta.json         step, config (resolved), plan settings, run statistics
    latest                the name of the newest complete checkpoint (replaced atomically)

A crash while writing leaves at worst a ``.tmp-*`` directory, never a half checkpoint under a
final name; ``latest`` only ever names a complete one. Pure torch: no Ray here.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import uuid

import numpy as np
import torch

LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


def step_name(step: int) -> str:
    return f"step-{int(step):06d}"


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


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: str, step: int, model, optimizer, meta: dict | None = None) -> str:
    """Write checkpoint ``step`` atomically; returns its final path."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, step_name(step))
    tmp = tempfile.mkdtemp(prefix=f".tmp-{step_name(step)}-", dir=directory)
    try:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()},
                   os.path.join(tmp, "model.pt"))
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save(rng_state(), os.path.join(tmp, "rng.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": int(step), **(meta or {})}, f, indent=1, default=_jsonable)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # rewriting a step: move the old one away first
            trash = os.path.join(directory, f".old-{uuid.uuid4().hex}")
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(directory)
        pointer = os.path.join(directory, f".{LATEST}-{uuid.uuid4().hex}")
        with open(pointer, "w") as f:
            f.write(step_name(step) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, os.path.join(directory, LATEST))
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def latest_checkpoint(directory: str | None) -> str | None:
    """The newest complete checkpoint in ``directory``, or None."""
    if not directory or not os.path.isdir(directory):
        return None
    pointer = os.path.join(directory, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        path = os.path.join(directory, name)
        if os.path.isfile(os.path.join(path, "meta.json")):
            return path
    names = sorted(n for n in os.listdir(directory) if n.startswith("step-")
                   and os.path.isfile(os.path.join(directory, n, "meta.json")))
    return os.path.join(directory, names[-1]) if names else None


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path!r} is unreadable: {exc}") from None


def load_checkpoint(path: str, model, optimizer=None, *, restore_rng: bool = True) -> dict:
    """Load ``path`` into ``model`` (and ``optimizer``); returns its meta."""
    meta = read_meta(path)
    device = next(model.parameters()).device
    state = torch.load(os.path.join(path, "model.pt"), map_location=device, weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: missing "
                              f"{list(missing)[:5]}, unexpected {list(unexpected)[:5]}")
    if optimizer is not None:
        opt_state = torch.load(os.path.join(path, "optimizer.pt"), map_location=device,
                               weights_only=False)
        optimizer.load_state_dict(opt_state)
    if restore_rng:
        set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=False))
    return meta


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)

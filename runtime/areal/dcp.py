"""DCP (``torch.distributed.checkpoint``) save/load of a ``DTATrainEngine``: the
``weight_format="dcp"`` that AReaL's ``RecoverHandler`` hard-codes for recover checkpoints.

The state is the engine core's DCP view (``EngineCore.sharded_state``: the weights the
optimizer steps -- the fp32 masters where kept, so a resumed run continues bit-identically --
and the optimizer state, keyed by parameter name; every rank its part under zero1 / fsdp)
plus AReaL's LR scheduler (FSDPEngine does not save it, so its schedule restarts on
recovery). It is written through the project's one sharded-checkpoint implementation,
``runtime/dcp.py`` (``save_sharded`` / ``load_sharded``: every rank, atomic, resumable under
any layout), into the folder AReaL names (``SaveLoadMeta.path``)::

    <path>/step-<version>/   DCP files + meta.json (runtime/dcp.py) + manifest.json
    <path>/latest            the newest one; older steps are removed after a save

Trust (``runtime/checkpoints/checkpoint.py``): rank 0 writes ``manifest.json`` (size and
SHA-256 of every file); a load verifies every file against it before DCP reads anything
(DCP's ``.metadata`` is a pickle), and refuses a checkpoint without one. The core's state is
layout-free (``runtime.sharding.logical``): a checkpoint written under one
``actor.dta.sharding`` and world size loads under another.
"""
from __future__ import annotations

import os
import shutil

from runtime.checkpoints.checkpoint import verify_manifest, write_manifest
from runtime.dcp import latest_sharded, load_sharded, save_sharded, step_name
from runtime.engine import comm

__all__ = ["save_state", "load_state"]

_KIND = "dta-areal-dcp"


def save_state(path: str, state: dict, *, step: int = 0, sharding: str = "replicate") -> str:
    """Write ``state`` (DCP entries: tensors, DTensors, Stateful objects — the engine core's
    ``sharded_state()`` and the LR scheduler) as checkpoint ``step`` under ``path``,
    recording the engine's ``sharding``; keeps only this one (every rank calls this)."""
    final = save_sharded(path, step, state, meta={"kind": _KIND, "sharding": sharding})
    if comm.rank() == 0:
        write_manifest(final, run_id=None, step=step, extra={"kind": _KIND})
        for name in os.listdir(path):  # AReaL keeps one recover checkpoint
            if name.startswith("step-") and name != step_name(step):
                shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    comm.barrier()
    return final


def load_state(path: str, state: dict, *, sharding: str = "replicate") -> dict:
    """The newest checkpoint under ``path`` into ``state`` in place (every rank), verified
    against its manifest first. The core's state is its logical view: written under any
    ``actor.dta.sharding`` and world size, it loads under this engine's (``sharding``, kept
    for the callers). Returns its meta."""
    final = latest_sharded(path)
    if final is None:
        raise FileNotFoundError(f"no DCP checkpoint under {path!r} (expected "
                                f"step-*/meta.json written by save_state)")
    verify_manifest(final)
    return load_sharded(final, state)

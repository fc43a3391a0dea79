"""One process's checkpoint of a whole training state, in the one format every layout writes
(:mod:`.sharded`: the logical view as DCP files, ``rng.pt``, ``meta.json``, a manifest): a
replica's (the engine core under ``replicate``, rank 0) and a plain model's -- the Python
API, :func:`save_checkpoint` / :func:`load_checkpoint` of a ``torch.nn.Module`` (a LoRA
model: its adapters) and its optimizer, no process group needed. The folder's run, retention
and trust rules are :mod:`.checkpoint`'s; the load goes through :mod:`.reshard` (any
layout's checkpoint, or a legacy one)."""
from __future__ import annotations

from runtime.checkpoints.checkpoint import folder_run, prune, replica_files, replica_meta
from runtime.checkpoints.logical import WholeModel
from runtime.checkpoints.reshard import load
from runtime.checkpoints.sharded import save_sharded

__all__ = ["save_local", "save_checkpoint", "load_checkpoint"]


def save_local(directory: str, step: int, mode, meta: dict | None = None, *,
               run_id: str | None = None, keep_last: int | None = None) -> str:
    """The whole state of ``mode`` (a one-shard layout: a replica, or a plain model as
    :class:`~runtime.checkpoints.logical.WholeModel`) written by this process alone,
    atomically; returns its final path. ``run_id`` defaults to the folder's (``run.json``);
    ``keep_last`` deletes all but the newest N of this run's checkpoints afterwards."""
    run_id = folder_run(directory, run_id)
    final = save_sharded(directory, step, mode.sharded_state(), local=True,
                         meta={**(meta or {}), **replica_meta(mode.optimizer), "run_id": run_id},
                         files=replica_files())
    if keep_last:
        prune(directory, int(keep_last), keep=final, run_id=run_id)
    return final


def save_checkpoint(directory: str, step: int, model, optimizer, meta: dict | None = None, *,
                    run_id: str | None = None, keep_last: int | None = None) -> str:
    """Write checkpoint ``step`` of a plain model (a LoRA model: its adapters) and its
    optimizer (AdamW, Adam or SGD) atomically; returns its final path."""
    return save_local(directory, step, WholeModel(model, optimizer), meta, run_id=run_id,
                      keep_last=keep_last)


def load_checkpoint(path: str, model, optimizer=None, *, restore_rng: bool = True) -> dict:
    """Verify ``path`` (manifest, run), then load it into a plain ``model`` (and
    ``optimizer``, its hyperparameters, and the RNG states): a checkpoint of any layout, or a
    legacy one (:mod:`.legacy`); returns its meta. A checkpoint that is not this model's is
    refused before anything is touched."""
    return load(WholeModel(model, optimizer), path, local=True, replica=True, rng=restore_rng)

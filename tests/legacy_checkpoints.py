"""Old-format checkpoint fixtures, written by the tests themselves (the library no longer
writes them; ``runtime.checkpoints.legacy`` reads them): a replica's checkpoint as DTA wrote
it up to 2026-12-07 (a946503 and before, until issue 54's one format)::

    <directory>/step-000001/
        model.pt        the trained tensors by name (a LoRA model: its adapters; a replica
                        keeping fp32 masters: the masters) and the model's buffers
        optimizer.pt    optimizer.state_dict()
        rng.pt          torch, numpy and python RNG states
        meta.json       {"step", "run_id", ...}: no "format"
        manifest.json   the SHA-256 and size of every file above
    <directory>/latest
"""
from __future__ import annotations

import json
import os

import torch

from dta.model.lora import trained_state
from runtime.checkpoints.checkpoint import publish, rng_state, step_name, write_manifest


def write_legacy_replica(directory: str, step: int, model, optimizer, *,
                         weights: dict | None = None, meta: dict | None = None,
                         run_id: str | None = None) -> str:
    """``model`` (``weights``: tensors standing for its own, by name) and ``optimizer`` as a
    replica's ``model.pt`` / ``optimizer.pt`` checkpoint; returns its folder."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".tmp-{step_name(step)}-legacy")
    os.makedirs(tmp)
    state = {k: v.detach().cpu().clone() for k, v in {**trained_state(model),
                                                      **(weights or {})}.items()}
    torch.save(state, os.path.join(tmp, "model.pt"))
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    torch.save(rng_state(), os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"step": int(step), "run_id": run_id, **(meta or {})}, f)
    write_manifest(tmp, run_id=run_id, step=int(step))
    final = os.path.join(directory, step_name(step))
    publish(tmp, final)
    return final


def write_legacy_worker(directory: str, step: int, w) -> str:
    """A Ray worker's replicated state as the legacy format (its fp32 masters, if kept)."""
    mode = w.core.sharding
    masters = getattr(mode, "masters", None)
    weights = None if masters is None else dict(zip(mode.names, masters))
    return write_legacy_replica(directory, step, w.model, w.optimizer, weights=weights,
                                meta={"num_workers": 1})

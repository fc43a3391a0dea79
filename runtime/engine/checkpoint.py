"""The engine core's checkpoints and Hugging Face export.

- replicated state (``replicate``): one rank writes the model and the optimizer
  (``runtime.checkpoints.checkpoint``: tensors only, a SHA-256 manifest, atomic);
- sharded state (``zero1`` / ``fsdp``): every rank writes its shards with DCP
  (``runtime.dcp.save_sharded``), loaded at any world size in the same mode, or re-sharded
  into one replica, or a replicated checkpoint cut into this rank's shards
  (``runtime.sharding.reshard``); anything else is refused before a parameter is touched;
- the model as a Hugging Face folder (``save_pretrained``, compute dtype; LoRA: the adapter
  in PEFT format or merged weights), gathered where sharded.
"""
from __future__ import annotations

import os

__all__ = ["save", "load", "export_hf"]


def save(core, directory: str, step: int, meta: dict, *, run_id: str | None = None,
         keep_last: int | None = None) -> str:
    """Replicated: call it on one rank (it writes the whole state). Sharded: every rank calls
    it and writes its shards (rank 0 then applies ``keep_last``)."""
    if core.layout.sharded:
        from runtime.checkpoints.checkpoint import prune
        from runtime.dcp import save_sharded

        path = save_sharded(directory, step, core.mode.sharded_state(),
                            meta={**meta, "sharding": core.layout.sharding, "run_id": run_id})
        if keep_last and core.layout.rank == 0:
            prune(directory, keep_last, keep=path, run_id=run_id)
        return path
    from runtime.checkpoints.checkpoint import save_checkpoint

    return save_checkpoint(directory, step, core.model, core.optimizer, meta, run_id=run_id,
                           keep_last=keep_last)


def load(core, path: str) -> dict:
    """Load ``path`` into the core (sharded: every rank calls it); returns its meta."""
    from runtime.sharding.reshard import (check_resumable, load_into_replica,
                                          load_replicated_into_sharded)

    sharded = core.layout.sharded
    saved = check_resumable(path, core.layout.world, core.layout.sharding)
    if saved["format"] == "dcp" and not sharded:
        return load_into_replica(path, core.model, core.optimizer)
    if saved["format"] == "replicated" and sharded:
        return load_replicated_into_sharded(path, core.mode)
    if sharded:  # the same mode; DCP re-cuts for another world size
        from runtime.dcp import load_sharded

        return load_sharded(path, core.mode.sharded_state(), allow_reshard=True)
    from runtime.checkpoints.checkpoint import load_checkpoint

    return load_checkpoint(path, core.model, core.optimizer)


def export_hf(core, path: str, *, merged: bool = False) -> str:
    """The model as a Hugging Face folder. Replicated: call it on one rank. Sharded: every
    rank calls it (gathering the whole state is a collective) and rank 0 writes, in the
    compute dtype (what a replicated run holds and exports)."""
    from dta.model.lora import is_peft_model, save_adapter

    rank0 = core.layout.rank == 0
    if is_peft_model(core.model):  # the adapter in PEFT format, or merged weights
        # zero1 keeps the gathered compute copy in the model itself: nothing to gather
        if rank0:
            os.makedirs(path, mode=0o755, exist_ok=True)
            save_adapter(core.model, path, merged=merged)
        return path
    if not core.layout.sharded:
        os.makedirs(path, mode=0o755, exist_ok=True)
        core.model.save_pretrained(path)
        return path
    state = core.mode.full_state()
    if rank0:
        state = {k: v.to(core.compute_dtype) if v.is_floating_point() else v
                 for k, v in state.items()}
        os.makedirs(path, mode=0o755, exist_ok=True)
        core.model.save_pretrained(path, state_dict=state)
    return path

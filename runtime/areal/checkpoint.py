"""AReaL's ``save`` / ``load`` (``SaveLoadMeta``) in its two formats, as ``FSDPEngine`` has them,
translated onto the engine core's state (``DTATrainEngine.save`` / ``load`` call these):

* ``hf``: the core's Hugging Face export (``EngineCore.export_hf``: ``save_pretrained`` in
  the compute dtype, gathered where sharded, written by rank 0; LoRA: the adapter folder with
  the base config and no tokenizer, as FSDPEngine) plus the tokenizer/processor when given;
  ``with_optim`` adds ``optim_world_size_{W}_rank_{r}.pt`` (``runtime.checkpoints.hf``) (replicated only: sharded, the
  optimizer state is split over the ranks, use ``dcp``). Loading reads a local directory
  only (nothing is ever downloaded) into the core (``EngineCore.load_full_state``: the
  weights, FSDP's shards and the masters).
* ``dcp``: the core's checkpoint as DCP in every mode (``EngineCore.save(every_rank=True)``: the
  weights the optimizer steps -- the fp32 masters where kept, so a resumed run continues
  bit-identically -- and the optimizer state, every rank its part; ``runtime/checkpoints/sharded.py``:
  atomic, a SHA-256 manifest verified before DCP reads anything) with AReaL's LR scheduler
  as its ``extra_state`` (FSDPEngine does not save it, so its schedule restarts on
  recovery), in the folder AReaL names -- what AReaL's ``RecoverHandler`` writes and reads::

      <path>/step-<version>/   DCP files + meta.json + manifest.json
      <path>/latest            the newest one; AReaL keeps one (the core's ``keep_last=1``)

  Loaded in place (``EngineCore.load``) in the same mode: a checkpoint written under another
  ``actor.dta.sharding`` is refused naming both. With an optimizer, ``with_optim=False`` is
  refused (the state holds the weights with the optimizer's: use ``hf`` for the weights
  alone).

A failure to write or read storage (a full disk, a missing file, one wrapped by DCP) is one
line saying what was being done, on which rank, and the cause with its path — an ``OSError``
of the same errno (``runtime.errors.storage_failure``).
"""
from __future__ import annotations

import contextlib
import os

from areal.api.io_struct import SaveLoadMeta

from runtime.checkpoints.hf import (  # noqa: F401  (local_state_dict: AReaL's hf folders)
    load_hf_into_core,
    load_optimizer_file,
    local_state_dict,
    save_optimizer_file,
)

__all__ = ["save", "load", "check_format", "says", "dcp_extra", "local_state_dict"]

DCP_KIND = "dta-areal-dcp"  # what AReaL's recover checkpoints are, in their meta.json
NO_OPTIMIZER = "no optimizer: the engine's config has optimizer=None (inference only)"


def optimizer_of(core):
    """The core's optimizer, or the one-line refusal of an inference-only engine."""
    if core.optimizer is None:
        raise RuntimeError(NO_OPTIMIZER)
    return core.optimizer


def save(core, meta: SaveLoadMeta, *, version: int, lr_scheduler, use_lora: bool) -> None:
    """AReaL's ``save(meta)``: ``hf`` or ``dcp`` (see the module doc)."""
    check_format(meta.weight_format)
    with says(f"saving the engine ({meta.weight_format}) to {str(meta.path)!r} on rank "
              f"{core.layout.rank}", str(meta.path)):
        if meta.weight_format == "dcp":
            save_dcp(core, meta, version, dcp_extra(core, meta, lr_scheduler))
        else:
            save_hf(core, meta, use_lora=use_lora)


def load(core, meta: SaveLoadMeta, *, lr_scheduler) -> None:
    """AReaL's ``load(meta)``: ``hf`` reads the directory's safetensors (a local path only)
    and the optimizer state when ``with_optim``; ``dcp`` restores what :func:`save` wrote, in
    place."""
    check_format(meta.weight_format)
    with says(f"loading the engine ({meta.weight_format}) from {str(meta.path)!r} on rank "
              f"{core.layout.rank}", str(meta.path)):
        if meta.weight_format == "dcp":
            load_dcp(core, meta, dcp_extra(core, meta, lr_scheduler))
        else:
            load_hf(core, meta)


def check_format(weight_format: str) -> None:
    if weight_format not in ("hf", "dcp"):
        raise ValueError(f"unknown weight_format {weight_format!r}; DTATrainEngine saves and "
                         "loads 'hf' and 'dcp'")


@contextlib.contextmanager
def says(action: str, path: str):
    """A storage failure inside as one line naming ``action`` (see the module doc)."""
    from runtime.errors import storage_failure

    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        plain = storage_failure(exc, action, path)
        if plain is None:
            raise
        raise plain from exc


def dcp_extra(core, meta: SaveLoadMeta, lr_scheduler) -> dict | None:
    """What AReaL's recover checkpoint holds beside the core's state: its LR scheduler."""
    if meta.with_optim:
        optimizer_of(core)
    elif core.optimizer is not None:
        raise ValueError(f"weight_format='dcp' with with_optim=False under "
                         f"actor.dta.sharding={core.layout.sharding}: the DCP state holds the "
                         "weights the optimizer steps (the fp32 masters where kept) with "
                         "the optimizer state; save weight_format='hf' for the weights "
                         "alone")
    return None if lr_scheduler is None else {"lr_scheduler": lr_scheduler}


def save_dcp(core, meta: SaveLoadMeta, version: int, extra: dict | None) -> None:
    core.save(str(meta.path), version, {"kind": DCP_KIND}, keep_last=1, extra_state=extra,
              every_rank=True)


def _check_hf(core, meta: SaveLoadMeta) -> None:
    if core.layout.sharded and meta.with_optim:
        raise ValueError(f"weight_format='hf' with with_optim=True under "
                         f"actor.dta.sharding={core.layout.sharding}: the optimizer state is "
                         "sharded over the ranks; use weight_format='dcp'")


def save_hf(core, meta: SaveLoadMeta, *, use_lora: bool) -> None:
    _check_hf(core, meta)
    layout = core.layout
    main = layout.rank == 0
    if main or layout.sharded:  # sharded: gathered on every rank's part
        core.export_hf(meta.path)
    if main:
        os.makedirs(meta.path, exist_ok=True)
        if use_lora:  # as FSDPEngine: the base config beside the adapter, no tokenizer
            core.model.config.save_pretrained(meta.path)
        if meta.tokenizer is not None and not use_lora:
            meta.tokenizer.save_pretrained(meta.path)
        if meta.processor is not None and not use_lora:
            meta.processor.save_pretrained(meta.path)
    if meta.with_optim:
        save_optimizer_file(optimizer_of(core), meta.path, layout.world, layout.rank)


def load_dcp(core, meta: SaveLoadMeta, extra: dict | None) -> None:
    final, _ = core.find_checkpoint(str(meta.path), kind=DCP_KIND, name="DCP checkpoint",
                                    whose="a DTATrainEngine recover checkpoint",
                                    writer="save")
    # the core's state is its layout-free view: written under any actor.dta.sharding,
    # world size or allocation, it loads under this engine's (runtime.checkpoints.reshard)
    core.load(final, extra_state=extra)


def load_hf(core, meta: SaveLoadMeta) -> None:
    _check_hf(core, meta)
    load_hf_into_core(core, meta.path, what=f"checkpoint {meta.path!r}")
    if meta.with_optim:
        layout = core.layout
        load_optimizer_file(optimizer_of(core), meta.path, layout.world, layout.rank)

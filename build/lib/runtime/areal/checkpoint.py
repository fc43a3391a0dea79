"""``save`` / ``load`` of ``DTATrainEngine`` in AReaL's two formats, as ``FSDPEngine`` has them,
mapped onto the engine core's state:

* ``hf``: the core's Hugging Face export (``EngineCore.export_hf``: ``save_pretrained`` in
  the compute dtype, gathered where sharded, written by rank 0; LoRA: the adapter folder with
  the base config and no tokenizer, as FSDPEngine) plus the tokenizer/processor when given;
  ``with_optim`` adds ``optim_world_size_{W}_rank_{r}.pt`` (replicated only: sharded, the
  optimizer state is split over the ranks, use ``dcp``). Loading reads a local directory
  only (nothing is ever downloaded) into the core (``EngineCore.load_full_state``: the
  weights, FSDP's shards and the masters).
* ``dcp``: the core's checkpoint as DCP in every mode (``EngineCore.save(dcp=True)``: the
  weights the optimizer steps -- the fp32 masters where kept, so a resumed run continues
  bit-identically -- and the optimizer state, every rank its part; ``runtime/dcp.py``:
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
import glob
import os

import torch
from areal.api.io_struct import SaveLoadMeta

from runtime.engine import comm

__all__ = ["CheckpointMixin", "load_hf_into_core", "load_hf_weights", "local_state_dict",
           "local_tokenizer"]

DCP_KIND = "dta-areal-dcp"  # what AReaL's recover checkpoints are, in their meta.json


class CheckpointMixin:
    """The checkpoint members of the engine (needs ``core``, ``groups``, ``rank``,
    ``world_size``, ``use_lora``, ``lr_scheduler``, ``_require_model``,
    ``_require_optimizer``, ``_offload_aware``)."""

    def _optim_path(self, path: str) -> str:
        return os.path.join(path, f"optim_world_size_{self.world_size}_rank_{self.rank}.pt")

    def save(self, meta: SaveLoadMeta):
        """``hf`` or ``dcp`` (see the module doc)."""
        self._require_model()
        _check_format(meta.weight_format)
        with self._offload_aware(), _says(f"saving the engine ({meta.weight_format}) to "
                                          f"{str(meta.path)!r} on rank {self.rank}",
                                          str(meta.path)):
            if meta.weight_format == "dcp":
                self._save_dcp(meta)
            else:
                self._save_hf(meta)
        comm.barrier(self.groups.cpu)

    def _dcp_extra(self, meta: SaveLoadMeta) -> dict | None:
        """What AReaL's recover checkpoint holds beside the core's state: its LR scheduler."""
        if meta.with_optim:
            self._require_optimizer()
        elif self.optimizer is not None:
            raise ValueError(f"weight_format='dcp' with with_optim=False under "
                             f"actor.dta.sharding={self.sharding}: the DCP state holds the "
                             "weights the optimizer steps (the fp32 masters where kept) with "
                             "the optimizer state; save weight_format='hf' for the weights "
                             "alone")
        return None if self.lr_scheduler is None else {"lr_scheduler": self.lr_scheduler}

    def _save_dcp(self, meta: SaveLoadMeta):
        self.core.save(str(meta.path), self.get_version(), {"kind": DCP_KIND}, keep_last=1,
                       extra_state=self._dcp_extra(meta), dcp=True)

    def _check_hf(self, meta: SaveLoadMeta) -> None:
        if self.core.layout.sharded and meta.with_optim:
            raise ValueError(f"weight_format='hf' with with_optim=True under "
                             f"actor.dta.sharding={self.sharding}: the optimizer state is "
                             "sharded over the ranks; use weight_format='dcp'")

    def _save_hf(self, meta: SaveLoadMeta):
        self._check_hf(meta)
        main = self.rank == 0
        if main or self.core.layout.sharded:  # sharded: gathered on every rank's part
            self.core.export_hf(meta.path)
        if main:
            os.makedirs(meta.path, exist_ok=True)
            if self.use_lora:  # as FSDPEngine: the base config beside the adapter, no tokenizer
                self.model.config.save_pretrained(meta.path)
            if meta.tokenizer is not None and not self.use_lora:
                meta.tokenizer.save_pretrained(meta.path)
            if meta.processor is not None and not self.use_lora:
                meta.processor.save_pretrained(meta.path)
        if meta.with_optim:
            self._require_optimizer()
            from runtime.checkpoints.checkpoint import save_tensors  # a failed write names the file

            os.makedirs(meta.path, exist_ok=True)
            save_tensors(self.optimizer.state_dict(), self._optim_path(meta.path))

    def load(self, meta: SaveLoadMeta):
        """The inverse of :meth:`save`: ``hf`` reads the directory's safetensors (a local path
        only) and the optimizer state when ``with_optim``; ``dcp`` restores what
        :meth:`save` wrote in place."""
        self._require_model()
        _check_format(meta.weight_format)
        with self._offload_aware(), _says(f"loading the engine ({meta.weight_format}) from "
                                          f"{str(meta.path)!r} on rank {self.rank}",
                                          str(meta.path)):
            if meta.weight_format == "dcp":
                self._load_dcp(meta)
            else:
                self._load_hf(meta)
        comm.barrier(self.groups.cpu)

    def _load_dcp(self, meta: SaveLoadMeta):
        extra = self._dcp_extra(meta)
        try:
            final, saved = self.core.find_checkpoint(str(meta.path))
        except FileNotFoundError:
            raise FileNotFoundError(f"no DCP checkpoint under {str(meta.path)!r} (expected "
                                    "step-*/meta.json written by save)") from None
        if saved.get("kind") != DCP_KIND:
            raise ValueError(f"checkpoint {final!r} is a {saved.get('kind')!r} checkpoint, not "
                             f"a DTATrainEngine recover checkpoint ({DCP_KIND})")
        # the core's state is its layout-free view: written under any actor.dta.sharding,
        # world size or allocation, it loads under this engine's (runtime.sharding.reshard)
        self.core.load(final, extra_state=extra)

    def _load_hf(self, meta: SaveLoadMeta):
        self._check_hf(meta)
        load_hf_into_core(self.core, meta.path, what=f"checkpoint {meta.path!r}")
        if meta.with_optim:
            self._require_optimizer()
            from runtime.checkpoints.checkpoint import load_tensors  # tensors only

            self.optimizer.load_state_dict(load_tensors(self._optim_path(meta.path)))


@contextlib.contextmanager
def _says(action: str, path: str):
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


def _check_format(weight_format: str) -> None:
    if weight_format not in ("hf", "dcp"):
        raise ValueError(f"unknown weight_format {weight_format!r}; DTATrainEngine saves and "
                         "loads 'hf' and 'dcp'")


def local_tokenizer(path: str):
    """The tokenizer saved in a local directory, or None (a weights-only directory: training
    needs no tokenizer)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        return None


def local_state_dict(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files of a local directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint path {path!r} is not a local directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path!r}")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def is_adapter_dir(path: str) -> bool:
    """Whether ``path`` holds a PEFT adapter (``adapter_config.json``) rather than weights."""
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def load_adapter(model, path: str, *, what: str):
    """A PEFT LoRA adapter folder into ``model``: a PEFT model gets its adapter weights
    replaced in place (every key must match), a plain model is wrapped
    (``PeftModel.from_pretrained``). Returns ``(model, state read)``."""
    from peft import PeftModel, load_peft_weights, set_peft_model_state_dict

    if not hasattr(model, "peft_config"):
        model = PeftModel.from_pretrained(model, path, is_trainable=False)
        return model, load_peft_weights(path, device="cpu")
    state = load_peft_weights(path, device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected or not state:
        raise ValueError(f"{what} {path!r} does not match the model's adapters: unexpected "
                         f"{sorted(unexpected)[:5]}{', empty' if not state else ''}")
    return model, state


def load_hf_into_core(core, path: str, *, what: str) -> None:
    """An HF folder into the engine core (its weights, shards and masters): every parameter
    must be there (a tied ``lm_head.weight`` may be absent), nothing else. A LoRA model takes
    an adapter folder (:func:`load_adapter`, in place)."""
    from dta.model.lora import is_peft_model

    model = core.model
    if is_peft_model(model):
        if not is_adapter_dir(path):
            raise ValueError(f"{what} holds no adapter_config.json: a LoRA model loads PEFT "
                             "adapter folders")
        load_adapter(model, path, what=what)
        state = {n: p.detach() for n, p in model.named_parameters()}  # the masters from them
    else:
        state = local_state_dict(path)
    core.load_full_state(state, what=what)


def load_hf_weights(model, path: str, *, what: str) -> dict[str, torch.Tensor]:
    """An HF weights folder into ``model`` in place; every key must match (a tied
    ``lm_head.weight`` may be absent). ``what`` names the folder in the error. Returns the
    state dict read. A PEFT model takes an adapter folder (:func:`load_adapter`)."""
    if hasattr(model, "peft_config"):
        if not is_adapter_dir(path):
            raise ValueError(f"{what} {path!r} holds no adapter_config.json: a LoRA model "
                             "loads PEFT adapter folders")
        return load_adapter(model, path, what=what)[1]
    state = local_state_dict(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = ({"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False)
            else set())
    if unexpected or set(missing) - tied:
        raise ValueError(f"{what} {path!r} does not match the model: missing "
                         f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return state

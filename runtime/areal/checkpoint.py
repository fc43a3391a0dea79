"""``save`` / ``load`` of ``DTATrainEngine`` in AReaL's two formats, as ``FSDPEngine`` has them:

* ``hf``: ``save_pretrained`` on rank 0 (weights in the compute dtype) plus the
  tokenizer/processor when given; ``with_optim`` adds ``optim_world_size_{W}_rank_{r}.pt``.
  Loading reads a local directory only; nothing is ever downloaded.
* ``dcp``: ``torch.distributed.checkpoint`` of the parameters the optimizer steps (the fp32
  masters with mixed precision), the optimizer state when ``with_optim``, and the LR
  scheduler, through the project's sharded-checkpoint module ``runtime/dcp.py``
  (``runtime/areal/dcp.py``) — what AReaL's ``RecoverHandler`` writes and reads.

Sharded (``actor.dta.sharding`` zero1 / fsdp, ``runtime/areal/sharded.py``): ``hf`` gathers
the whole weights (compute dtype) and rank 0 writes them; loading fills the shards and the
fp32 masters. ``dcp`` writes the sharded state itself — every rank its slice of the masters
and of the optimizer state, the step counts, the LR scheduler — and loads it in place at the
same world size. Refused there, naming the reason: ``hf`` with ``with_optim`` (the optimizer
state is sharded: use ``dcp``) and ``dcp`` without ``with_optim`` (the sharded state holds
the masters and the optimizer state together: use ``hf`` for weights only).

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

__all__ = ["CheckpointMixin", "load_hf_weights", "local_state_dict", "local_tokenizer"]


class CheckpointMixin:
    """The checkpoint members of the engine (needs ``model``, ``optimizer``, ``parallel``,
    ``master``, ``_trainable``, ``_require_model``, ``_require_optimizer``)."""

    def _optim_path(self, path: str) -> str:
        return os.path.join(path, f"optim_world_size_{self.parallel.world_size}_rank_"
                                  f"{self.parallel.rank}.pt")

    def _stepped_parameters(self):
        """``[(name, Parameter)]`` the optimizer steps: the fp32 masters under the model's
        parameter names with mixed precision, else the model's own trainable parameters."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        params = self.master.master if self.master is not None else self._trainable()
        return list(zip(names, params))

    def save(self, meta: SaveLoadMeta):
        """``hf`` (see the module doc) or ``dcp``."""
        self._require_model()
        _check_format(meta.weight_format)
        with self._offload_aware(), _says(f"saving the engine ({meta.weight_format}) to "
                                          f"{str(meta.path)!r} on rank {self.parallel.rank}",
                                          str(meta.path)):
            if meta.weight_format == "dcp":
                self._save_dcp(meta)
            else:
                self._save_hf(meta)
        self.parallel.barrier()

    def _save_dcp(self, meta: SaveLoadMeta):
        from runtime.areal.dcp import save_dcp, save_state

        if self.layout is not None:
            self._check_sharded_dcp(meta)
            save_state(str(meta.path), self._sharded_dcp_state(), step=self.get_version(),
                       sharding=self.sharding)
            return
        if meta.with_optim:
            self._require_optimizer()
        save_dcp(str(meta.path), self._stepped_parameters(),
                 self.optimizer if meta.with_optim else None,
                 self.lr_scheduler if meta.with_optim else None, step=self.get_version())

    def _check_sharded_dcp(self, meta: SaveLoadMeta) -> None:
        self._require_optimizer()
        if not meta.with_optim:
            raise ValueError(f"weight_format='dcp' with with_optim=False under "
                             f"actor.dta.sharding={self.sharding}: the sharded state holds the "
                             "fp32 masters with the optimizer state; save weight_format='hf' "
                             "for the weights alone")

    def _sharded_dcp_state(self) -> dict:
        state = dict(self.layout.dcp_state())
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler
        return state

    def _check_sharded_hf(self, meta: SaveLoadMeta) -> None:
        if self.layout is not None and meta.with_optim:
            raise ValueError(f"weight_format='hf' with with_optim=True under "
                             f"actor.dta.sharding={self.sharding}: the optimizer state is "
                             "sharded over the ranks; use weight_format='dcp'")

    def _save_hf(self, meta: SaveLoadMeta):
        self._check_sharded_hf(meta)
        os.makedirs(meta.path, exist_ok=True)
        if self.layout is not None:  # gathered on every rank's part, written by rank 0
            state = self.layout.full_state_dict(keep=self.parallel.rank == 0)
            if self.parallel.rank == 0:
                self.model.save_pretrained(meta.path, state_dict=state)
        elif self.parallel.rank == 0:
            self.model.save_pretrained(meta.path)  # LoRA: the adapter (PEFT format)
        if self.parallel.rank == 0:
            if self.use_lora:  # as FSDPEngine: the base config beside the adapter, no tokenizer
                self.model.config.save_pretrained(meta.path)
            if meta.tokenizer is not None and not self.use_lora:
                meta.tokenizer.save_pretrained(meta.path)
            if meta.processor is not None and not self.use_lora:
                meta.processor.save_pretrained(meta.path)
        if meta.with_optim:
            self._require_optimizer()
            from runtime.checkpoints.checkpoint import save_tensors  # a failed write names the file

            save_tensors(self.optimizer.state_dict(), self._optim_path(meta.path))

    def load(self, meta: SaveLoadMeta):
        """The inverse of :meth:`save`: ``hf`` reads the directory's safetensors (a local path
        only) and the optimizer state when ``with_optim``; ``dcp`` restores what
        :meth:`save` wrote in place."""
        self._require_model()
        _check_format(meta.weight_format)
        with self._offload_aware(), _says(f"loading the engine ({meta.weight_format}) from "
                                          f"{str(meta.path)!r} on rank {self.parallel.rank}",
                                          str(meta.path)):
            if meta.weight_format == "dcp":
                self._load_dcp(meta)
            else:
                self._load_hf(meta)
        self.parallel.barrier()

    def _load_dcp(self, meta: SaveLoadMeta):
        from runtime.areal.dcp import load_dcp, load_state

        if self.layout is not None:
            self._check_sharded_dcp(meta)
            load_state(str(meta.path), self._sharded_dcp_state(), sharding=self.sharding)
            if self.lr_scheduler is not None:  # the shards carry no param_groups: the
                # optimizer steps with the restored schedule's learning rate
                for group, lr in zip(self.optimizer.param_groups,
                                     self.lr_scheduler.get_last_lr()):
                    group["lr"] = lr
            return
        if meta.with_optim:
            self._require_optimizer()
        load_dcp(str(meta.path), self._stepped_parameters(),
                 self.optimizer if meta.with_optim else None,
                 self.lr_scheduler if meta.with_optim else None)
        if self.master is not None:
            self.master.master_to_model()

    def _load_hf(self, meta: SaveLoadMeta):
        self._check_sharded_hf(meta)
        if self.layout is not None:
            self.layout.load_full_state(local_state_dict(meta.path),
                                        what=f"checkpoint {meta.path!r}")
            return
        load_hf_weights(self.model, meta.path, what="checkpoint")
        if self.master is not None:
            self.master.model_to_master()
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

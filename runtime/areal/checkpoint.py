"""``save`` / ``load`` of ``DTATrainEngine`` in AReaL's ``hf`` format, as ``FSDPEngine`` writes
it: ``save_pretrained`` on rank 0 (weights in the compute dtype) plus the tokenizer/processor
when given; ``with_optim`` adds ``optim_world_size_{W}_rank_{r}.pt``. Loading reads a local
directory only; nothing is ever downloaded."""
from __future__ import annotations

import glob
import os

import torch

from areal.api.io_struct import SaveLoadMeta

__all__ = ["CheckpointMixin", "local_state_dict", "local_tokenizer"]


class CheckpointMixin:
    """The checkpoint members of the engine (needs ``model``, ``optimizer``, ``parallel``,
    ``master``, ``_trainable``, ``_require_model``, ``_require_optimizer``)."""

    def _optim_path(self, path: str) -> str:
        return os.path.join(path, f"optim_world_size_{self.parallel.world_size}_rank_"
                                  f"{self.parallel.rank}.pt")

    def save(self, meta: SaveLoadMeta):
        """``hf``: ``model.save_pretrained`` (rank 0; weights in the compute dtype, as
        FSDPEngine exports them) plus the tokenizer/processor when given; ``with_optim`` adds
        ``optim_world_size_{W}_rank_{r}.pt`` as FSDPEngine does."""
        self._require_model()
        if meta.weight_format != "hf":
            raise NotImplementedError(f"DTATrainEngine saves weight_format 'hf' only, got "
                                      f"{meta.weight_format!r}")
        os.makedirs(meta.path, exist_ok=True)
        if self.parallel.rank == 0:
            self.model.save_pretrained(meta.path)
            if meta.tokenizer is not None:
                meta.tokenizer.save_pretrained(meta.path)
            if meta.processor is not None:
                meta.processor.save_pretrained(meta.path)
        if meta.with_optim:
            self._require_optimizer()
            torch.save(self.optimizer.state_dict(), self._optim_path(meta.path))
        self.parallel.barrier()

    def load(self, meta: SaveLoadMeta):
        """The inverse of :meth:`save`: weights from the directory's safetensors (a local
        path only), the optimizer state when ``with_optim``."""
        self._require_model()
        if meta.weight_format != "hf":
            raise NotImplementedError(f"DTATrainEngine loads weight_format 'hf' only, got "
                                      f"{meta.weight_format!r}")
        state = local_state_dict(meta.path)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = ({"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False)
                else set())
        if unexpected or set(missing) - tied:
            raise ValueError(f"checkpoint {meta.path!r} does not match the model: missing "
                             f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
        if self.master is not None:
            self.master.model_to_master()
        if meta.with_optim:
            self._require_optimizer()
            self.optimizer.load_state_dict(torch.load(self._optim_path(meta.path),
                                                      weights_only=False))
        self.parallel.barrier()


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

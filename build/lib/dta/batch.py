"""A batch of token sequences with per-token fields, validated before anything is touched.

Per-token fields are aligned with ``input_ids``: the value at index j belongs to token j as a
*target* (its loss-mask bit, its advantage, its behaviour log-prob). Token 0 has no context
and is never a target: its ``loss_mask`` flag is ignored (set to 0), so an all-ones mask (SFT
data, Hugging Face's shifted-labels convention) trains every token that can be predicted.
Per-sequence fields (``weight``) are one number per sequence. The record fields and their
rules are those of :mod:`dta.records.fields`; :meth:`Batch.from_records` checks every record and
:meth:`Batch.validate` checks the assembled batch against the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from dta.records.fields import ALIASES, LOGPROB_FIELDS, BatchError, validate_record
from dta.tree import unpad  # a batch format's reader (the doors import it from here)

TOKEN_FIELDS = ("loss_mask", "advantages", "old_logprobs", "prox_logprobs")
SEQUENCE_FIELDS = ("weight",)

__all__ = ["Batch", "BatchError", "TOKEN_FIELDS", "SEQUENCE_FIELDS", "ALIASES"]


@dataclass
class Batch:
    input_ids: list[np.ndarray]
    fields: dict[str, list[np.ndarray]] = field(default_factory=dict)  # per-token, float64
    weight: np.ndarray | None = None  # per-sequence multiplier of every loss term
    group_id: list | None = None
    sources: list[str] | None = None  # per sequence: where it came from ("f.jsonl line 3")
    # MoE routing replay: per sequence [tokens, MoE layers, k] expert ids (dta/model/routing.py)
    routed_experts: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.input_ids], dtype=np.int64)

    def where(self, i: int) -> str:
        """How errors name sequence ``i``: its source (file and line) when known."""
        if self.sources is not None and i < len(self.sources) and self.sources[i]:
            return f"sequence {i} ({self.sources[i]})"
        return f"sequence {i}"

    # ------------------------------------------------------------------ constructors --
    @classmethod
    def from_records(cls, records: Iterable[Mapping], *, sources: Sequence[str] | None = None,
                     vocab_size: int | None = None) -> "Batch":
        """From dicts with ``input_ids`` and optional fields (see :mod:`dta.records.fields`; a
        scalar ``advantages`` is broadcast to every token). Every record is checked first;
        errors name ``sources[i]`` (e.g. ``data.jsonl line 7``) or ``sequence i``."""
        records = list(records)
        if sources is not None and len(sources) != len(records):
            raise BatchError(f"{len(sources)} sources for {len(records)} records")
        ids, fields, weights, groups, routed = [], {}, [], [], {}
        for i, rec in enumerate(records):
            where = sources[i] if sources is not None else f"sequence {i}"
            rec = validate_record(dict(rec) if isinstance(rec, Mapping) else rec, where,
                                  vocab_size=vocab_size)
            ids.append(rec["input_ids"])
            for key, value in rec.items():
                name = ALIASES.get(key, key)
                if name in TOKEN_FIELDS:
                    if name == "loss_mask" and value[0] != 0:
                        value = value.copy()
                        value[0] = 0  # token 0 is never a target (see the module doc)
                    fields.setdefault(name, {})[i] = np.asarray(value, dtype=np.float64)
            if "routed_experts" in rec:
                routed[i] = rec["routed_experts"]
            weights.append(float(rec.get("weight", 1.0)))
            groups.append(rec.get("group_id"))
        out = {}
        for name, per_seq in fields.items():
            missing = [i for i in range(len(ids)) if i not in per_seq]
            if missing:
                where = sources[missing[0]] if sources is not None else f"sequence {missing[0]}"
                raise BatchError(f"{where}: field '{name}' is missing (given for other "
                                 "sequences)")
            out[name] = [per_seq[i] for i in range(len(ids))]
        if routed and len(routed) != len(ids):
            i = next(i for i in range(len(ids)) if i not in routed)
            where = sources[i] if sources is not None else f"sequence {i}"
            raise BatchError(f"{where}: field 'routed_experts' is missing (given for other "
                             "sequences)")
        return cls(ids, out, np.array(weights), groups,
                   list(sources) if sources is not None else None,
                   [routed[i] for i in range(len(ids))] if routed else None)

    @classmethod
    def from_padded(cls, input_ids, attention_mask, **token_fields) -> "Batch":
        """From right-padded ``[B, S]`` tensors/arrays: padding is cut from every field."""
        seqs = unpad(input_ids, attention_mask)
        records = []
        for i, s in enumerate(seqs):
            rec = {"input_ids": s}
            for name, value in token_fields.items():
                arr = np.asarray(value.cpu() if hasattr(value, "cpu") else value)
                rec[name] = arr[i, :len(s)]
            records.append(rec)
        return cls.from_records(records)

    def subset(self, ids) -> "Batch":
        ids = [int(i) for i in ids]
        return Batch([self.input_ids[i] for i in ids],
                     {k: [v[i] for i in ids] for k, v in self.fields.items()},
                     None if self.weight is None else self.weight[ids],
                     None if self.group_id is None else [self.group_id[i] for i in ids],
                     None if self.sources is None else [self.sources[i] for i in ids],
                     None if self.routed_experts is None else [self.routed_experts[i] for i in ids])

    # ------------------------------------------------------------------- validation --
    def loss_mask(self, i: int) -> np.ndarray:
        """Sequence ``i``'s 0/1 target flags; token 0's is always 0 (nothing predicts it)."""
        if "loss_mask" in self.fields:
            m = self.fields["loss_mask"][i]
            if len(m) and m[0] != 0:
                m = np.array(m, dtype=np.float64)
                m[0] = 0.0
            return m
        m = np.ones(len(self.input_ids[i]))
        m[0] = 0.0
        return m

    def trained_tokens(self) -> int:
        """Tokens with a loss term (loss-mask flags set, token 0 excluded)."""
        return int(sum(self.loss_mask(i).sum() for i in range(len(self))))

    def validate(self, *, vocab_size: int | None = None, max_positions: int | None = None,
                 required: Iterable[str] = ()) -> "Batch":
        if len(self.input_ids) == 0:
            raise BatchError("the batch has no sequences")
        for name in required:
            if name not in self.fields:
                raise BatchError(f"field '{name}' is required by the loss but absent from the batch")
        for name in self.fields:  # (extra per-token fields a runtime adds are allowed)
            if len(self.fields[name]) != len(self.input_ids):
                raise BatchError(f"field '{name}' holds {len(self.fields[name])} sequences, "
                                 f"'input_ids' {len(self.input_ids)}")
        for i, seq in enumerate(self.input_ids):
            seq = np.asarray(seq)
            n = len(seq)
            if seq.ndim != 1 or (n and seq.dtype.kind not in "iu"):
                raise BatchError(f"{self.where(i)}: 'input_ids' must be a 1-D array of ints, got "
                                 f"{seq.dtype} of shape {seq.shape}")
            if n == 0:
                raise BatchError(f"{self.where(i)}: 'input_ids' is empty")
            if vocab_size is not None and (seq.min() < 0 or seq.max() >= vocab_size):
                bad = int(seq[(seq < 0) | (seq >= vocab_size)][0])
                raise BatchError(f"{self.where(i)}: 'input_ids' holds token id {bad}, outside "
                                 f"the vocabulary [0, {vocab_size})")
            if max_positions is not None and n > max_positions:
                raise BatchError(f"{self.where(i)}: length {n} exceeds the model's maximum "
                                 f"positions {max_positions}")
            for name, per_seq in self.fields.items():
                arr = np.asarray(per_seq[i])
                if arr.ndim != 1 or len(arr) != n:
                    raise BatchError(f"{self.where(i)}: field '{name}' has shape {arr.shape}, "
                                     f"'input_ids' has length {n}")
                if not np.all(np.isfinite(arr)):
                    j = int(np.flatnonzero(~np.isfinite(arr))[0])
                    raise BatchError(f"{self.where(i)}: field '{name}' is {arr[j]} at token {j}")
                if name == "loss_mask" and not np.all((arr == 0) | (arr == 1)):
                    j = int(np.flatnonzero((arr != 0) & (arr != 1))[0])
                    raise BatchError(f"{self.where(i)}: field 'loss_mask' is {arr[j]} at token "
                                     f"{j}, expected 0 or 1")
                if name in LOGPROB_FIELDS and arr.max() > 0:
                    j = int(np.flatnonzero(arr > 0)[0])
                    raise BatchError(f"{self.where(i)}: field '{name}' is {arr[j]} at token {j}, "
                                     "but a log-prob is <= 0")
        if self.weight is not None:
            w = np.asarray(self.weight, dtype=np.float64)
            if len(w) != len(self.input_ids) or not np.all(np.isfinite(w)) or np.any(w < 0):
                raise BatchError("field 'weight' must hold one finite number >= 0 per sequence")
        return self

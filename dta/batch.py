"""A batch of token sequences with per-token fields, validated before anything is touched.

Per-token fields are aligned with ``input_ids``: the value at index j belongs to token j as a
*target* (its loss-mask bit, its advantage, its behaviour log-prob). Token 0 has no context
and is never a target. Per-sequence fields (``weight``) are one number per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

TOKEN_FIELDS = ("loss_mask", "advantages", "old_logprobs", "prox_logprobs")
SEQUENCE_FIELDS = ("weight",)
ALIASES = {"logprobs": "old_logprobs", "prox_logp": "prox_logprobs"}


class BatchError(ValueError):
    """Bad input, raised before any gradient or parameter is touched."""


@dataclass
class Batch:
    input_ids: list[np.ndarray]
    fields: dict[str, list[np.ndarray]] = field(default_factory=dict)  # per-token, float64
    weight: np.ndarray | None = None  # per-sequence multiplier of every loss term
    group_id: list | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.input_ids], dtype=np.int64)

    # ------------------------------------------------------------------ constructors --
    @classmethod
    def from_records(cls, records: Iterable[Mapping]) -> "Batch":
        """From dicts with ``input_ids`` and optional per-token fields (a scalar
        ``advantages`` is broadcast to every token), ``weight`` and ``group_id``."""
        records = list(records)
        ids, fields, weights, groups = [], {}, [], []
        for i, rec in enumerate(records):
            if "input_ids" not in rec:
                raise BatchError(f"sequence {i}: missing field 'input_ids'")
            seq = _int_array(rec["input_ids"], i)
            ids.append(seq)
            for key, value in rec.items():
                name = ALIASES.get(key, key)
                if name in TOKEN_FIELDS:
                    arr = np.asarray(value, dtype=np.float64)
                    if arr.ndim == 0 and name == "advantages":
                        arr = np.full(len(seq), float(arr))
                    fields.setdefault(name, {})[i] = arr
            weights.append(float(rec.get("weight", 1.0)))
            groups.append(rec.get("group_id"))
        out = {}
        for name, per_seq in fields.items():
            missing = [i for i in range(len(ids)) if i not in per_seq]
            if missing:
                raise BatchError(f"sequence {missing[0]}: field '{name}' is missing "
                                 f"(given for other sequences)")
            out[name] = [per_seq[i] for i in range(len(ids))]
        return cls(ids, out, np.array(weights), groups)

    @classmethod
    def from_padded(cls, input_ids, attention_mask, **token_fields) -> "Batch":
        """From right-padded ``[B, S]`` tensors/arrays: padding is cut from every field."""
        from dta.tree import unpad

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
                     None if self.group_id is None else [self.group_id[i] for i in ids])

    # ------------------------------------------------------------------- validation --
    def loss_mask(self, i: int) -> np.ndarray:
        if "loss_mask" in self.fields:
            return self.fields["loss_mask"][i]
        m = np.ones(len(self.input_ids[i]))
        m[0] = 0.0
        return m

    def validate(self, *, vocab_size: int | None = None, max_positions: int | None = None,
                 required: Iterable[str] = ()) -> "Batch":
        if len(self.input_ids) == 0:
            raise BatchError("the batch has no sequences")
        for name in required:
            if name not in self.fields:
                raise BatchError(f"field '{name}' is required by the loss but absent from the batch")
        for i, seq in enumerate(self.input_ids):
            n = len(seq)
            if n == 0:
                raise BatchError(f"sequence {i}: 'input_ids' is empty")
            if vocab_size is not None and (seq.min() < 0 or seq.max() >= vocab_size):
                bad = int(seq[(seq < 0) | (seq >= vocab_size)][0])
                raise BatchError(f"sequence {i}: 'input_ids' holds token id {bad}, outside the "
                                 f"vocabulary [0, {vocab_size})")
            if max_positions is not None and n > max_positions:
                raise BatchError(f"sequence {i}: length {n} exceeds the model's maximum "
                                 f"positions {max_positions}")
            for name, per_seq in self.fields.items():
                arr = per_seq[i]
                if arr.ndim != 1 or len(arr) != n:
                    raise BatchError(f"sequence {i}: field '{name}' has shape {arr.shape}, "
                                     f"'input_ids' has length {n}")
                if not np.all(np.isfinite(arr)):
                    j = int(np.flatnonzero(~np.isfinite(arr))[0])
                    raise BatchError(f"sequence {i}: field '{name}' is {arr[j]} at token {j}")
            if self.loss_mask(i)[0] != 0:
                raise BatchError(f"sequence {i}: 'loss_mask' is set on token 0, which has no "
                                 "context to be predicted from")
        if self.weight is not None:
            if len(self.weight) != len(self.input_ids) or not np.all(np.isfinite(self.weight)):
                raise BatchError("field 'weight' must hold one finite number per sequence")
        return self


def _int_array(value, i: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise BatchError(f"sequence {i}: 'input_ids' must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise BatchError(f"sequence {i}: 'input_ids' must hold integers, got {arr.dtype}")
    return arr.astype(np.int64)

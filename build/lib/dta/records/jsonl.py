"""Batches as JSONL: one JSON object per line, one training sequence per object.

The fields of a line are those of :mod:`dta.records.fields` (``input_ids`` required; ``loss_mask``,
``advantages``, ``logprobs``/``old_logprobs``, ``prox_logprobs``/``prox_logp``, ``reward``,
``weight``, ``group_id``; metadata ``id``, ``uid``, ``episode``, ``task``, ``call``,
``calls``, ``meta``). Any other field is an error naming it and listing the allowed ones; so
are a pair of aliases given together, a ``loss_mask`` flag other than 0/1, a non-finite
number, a positive log-prob and an id beyond int64 (or, given ``vocab_size``, outside the
vocabulary).

:func:`read_jsonl` returns dicts of numpy arrays: ``input_ids`` int64, ``loss_mask`` int8,
``advantages`` and the log-probs float64 (a scalar advantage is broadcast); fields absent from
a line stay absent from its dict. Every error names the file, the line number and the field
(bad UTF-8 and bad JSON included). Blank lines are skipped. :func:`write_jsonl` writes the
same format back; an ``advantages`` array whose entries are all equal is written as one number,
which reads back identically.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

import numpy as np

from dta.records.fields import RecordError, validate_record

__all__ = ["JsonlError", "read_jsonl", "write_jsonl", "validate_record"]


class JsonlError(RecordError):
    """A malformed line; the message starts with ``<file> line <n>: ``."""


def _where(path: str | os.PathLike, line: int) -> str:
    return f"{os.fspath(path)} line {line}"


def _checked(obj, where: str, vocab_size: int | None) -> dict:
    try:
        return validate_record(obj, where, vocab_size=vocab_size)
    except JsonlError:
        raise
    except RecordError as exc:
        raise JsonlError(str(exc)) from None


def read_jsonl(path: str | os.PathLike, *, vocab_size: int | None = None,
               return_lines: bool = False):
    """Read every non-blank line of ``path`` as one record (see module doc); with
    ``return_lines``, also each record's 1-based line number: ``(records, lines)``."""
    records, lines = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = _where(path, lineno)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise JsonlError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
            records.append(_checked(obj, where, vocab_size))
            lines.append(lineno)
    return (records, lines) if return_lines else records


def _plain(value: Any) -> Any:
    """numpy scalars/arrays -> JSON-serializable Python values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write ``records`` (dicts of lists or numpy arrays) one per line; returns the count.

    Each record is validated first (same rules as reading), so a file this writes always
    reads back; an error names the 1-based record number as its line.
    """
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for n, rec in enumerate(records, start=1):
            if not isinstance(rec, dict):
                raise JsonlError(f"{_where(path, n)}: expected a dict, got {type(rec).__name__}")
            checked = _checked(
                {k: v if isinstance(v, np.ndarray) else _plain(v) for k, v in rec.items()},
                _where(path, n), None)
            adv = checked.get("advantages")
            plain = {}
            for k, v in checked.items():
                if k == "advantages" and len(adv) and np.all(adv == adv[0]):
                    plain[k] = float(adv[0])
                else:
                    plain[k] = _plain(v)
            f.write(json.dumps(plain, separators=(",", ":"), allow_nan=False))
            f.write("\n")
    return n


def json_safe(value):
    """JSON-safe: NaN/inf become null (strict JSON has no NaN), numpy values plain."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy / torch scalar
        value = value.item()
    if hasattr(value, "tolist"):
        return json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)

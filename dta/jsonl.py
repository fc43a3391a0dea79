"""Batches as JSONL: one JSON object per line, one training sequence per object.

Fields of a line:

* ``input_ids`` (required): a non-empty list of non-negative ints.
* ``loss_mask`` (optional): a list of 0/1 ints (or booleans), as long as ``input_ids``.
* ``advantages`` (optional): a list of numbers as long as ``input_ids``, or one number that
  applies to every token.
* ``logprobs`` (optional): behaviour log-probs, a list of numbers as long as ``input_ids``.
* ``group_id`` (optional): an int or a string (the GRPO group of the sequence).
* any other field is kept as parsed (nothing is dropped).

:func:`read_jsonl` returns dicts of numpy arrays: ``input_ids`` int64, ``loss_mask`` int8,
``advantages`` and ``logprobs`` float64 (a scalar advantage is broadcast); fields absent from a
line stay absent from its dict. Every error names the file, the line number and the field.
Blank lines are skipped. :func:`write_jsonl` writes the same format back; an ``advantages``
array whose entries are all equal is written as one number, which reads back identically.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable

import numpy as np

__all__ = ["JsonlError", "read_jsonl", "write_jsonl", "validate_record"]

_PER_TOKEN_FLOAT = ("advantages", "logprobs")


class JsonlError(ValueError):
    """A malformed line; the message starts with ``<file> line <n>: ``."""


def _where(path: str | os.PathLike, line: int) -> str:
    return f"{os.fspath(path)} line {line}"


def _first_bad(values: list, ok) -> tuple[int, Any]:
    for i, v in enumerate(values):
        if not ok(v):
            return i, v
    return -1, None  # pragma: no cover - only called once a failure is known


def _as_array(values: Any) -> tuple[np.ndarray | None, list]:
    """(array or None if numpy cannot make a 1-D one, the values as a list for messages)."""
    if isinstance(values, np.ndarray):
        return values, values.tolist() if values.ndim != 1 else values
    try:
        return np.array(values), values
    except (ValueError, TypeError, OverflowError):
        return None, values


def _int_array(where: str, field: str, values: Any) -> np.ndarray:
    if not isinstance(values, (list, np.ndarray)):
        raise JsonlError(f"{where}: field '{field}' must be a list of ints, got {type(values).__name__}")
    arr, items = _as_array(values)
    if len(items) and (arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu"):
        i, v = _first_bad(list(items), lambda x: isinstance(x, (int, np.integer))
                          and not isinstance(x, (bool, np.bool_)) and -2**63 <= x < 2**63)
        raise JsonlError(f"{where}: field '{field}' item {i} is {v!r}, expected an int")
    return arr.reshape(-1).astype(np.int64, copy=False)


def _float_array(where: str, field: str, values: Any, n: int, allow_scalar: bool) -> np.ndarray:
    if allow_scalar and isinstance(values, (int, float, np.integer, np.floating)) \
            and not isinstance(values, (bool, np.bool_)):
        if not math.isfinite(values):
            raise JsonlError(f"{where}: field '{field}' is {values!r}, expected a finite number")
        return np.full(n, float(values), dtype=np.float64)
    if not isinstance(values, (list, np.ndarray)):
        kind = "a list of numbers or one number" if allow_scalar else "a list of numbers"
        raise JsonlError(f"{where}: field '{field}' must be {kind}, got {type(values).__name__}")
    arr, items = _as_array(values)
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iuf" or not np.all(np.isfinite(arr)):
        ok = lambda x: (isinstance(x, (int, float, np.integer, np.floating))
                        and not isinstance(x, (bool, np.bool_)) and math.isfinite(x))
        i, v = _first_bad(list(items), ok)
        raise JsonlError(f"{where}: field '{field}' item {i} is {v!r}, expected a finite number")
    if len(arr) != n:
        raise JsonlError(f"{where}: field '{field}' has length {len(arr)}, input_ids has {n}")
    return arr.astype(np.float64, copy=False)


def validate_record(obj: Any, where: str = "record") -> dict:
    """Check one parsed JSON object and convert it to numpy arrays (see module doc)."""
    if not isinstance(obj, dict):
        raise JsonlError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "input_ids" not in obj:
        raise JsonlError(f"{where}: field 'input_ids' is missing")
    out = dict(obj)
    ids = _int_array(where, "input_ids", obj["input_ids"])
    if len(ids) == 0:
        raise JsonlError(f"{where}: field 'input_ids' is empty")
    if ids.min() < 0:
        i = int(np.argmax(ids < 0))
        raise JsonlError(f"{where}: field 'input_ids' item {i} is {int(ids[i])}, expected >= 0")
    out["input_ids"] = ids
    n = len(ids)
    if "loss_mask" in obj:
        m = obj["loss_mask"]
        if isinstance(m, np.ndarray) and m.dtype == bool:
            m = m.astype(np.int8)
        elif isinstance(m, list) and m and all(type(x) is bool for x in m):
            m = [int(x) for x in m]
        mask = _int_array(where, "loss_mask", m)
        if len(mask) != n:
            raise JsonlError(f"{where}: field 'loss_mask' has length {len(mask)}, input_ids has {n}")
        if len(mask) and (mask.min() < 0 or mask.max() > 1):
            i = int(np.argmax((mask < 0) | (mask > 1)))
            raise JsonlError(f"{where}: field 'loss_mask' item {i} is {int(mask[i])}, expected 0 or 1")
        out["loss_mask"] = mask.astype(np.int8)
    for field in _PER_TOKEN_FLOAT:
        if field in obj:
            out[field] = _float_array(where, field, obj[field], n, field == "advantages")
    if "group_id" in obj:
        g = obj["group_id"]
        if isinstance(g, bool) or not isinstance(g, (int, str)):
            raise JsonlError(f"{where}: field 'group_id' is {g!r}, expected an int or a string")
    return out


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read every non-blank line of ``path`` as one record (see module doc)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = _where(path, lineno)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
            records.append(validate_record(obj, where))
    return records


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
            checked = validate_record(
                {k: v if isinstance(v, np.ndarray) else _plain(v) for k, v in rec.items()},
                _where(path, n))
            adv = checked.get("advantages")
            plain = {}
            for k, v in checked.items():
                if k == "advantages" and np.all(adv == adv[0]):
                    plain[k] = float(adv[0])
                else:
                    plain[k] = _plain(v)
            f.write(json.dumps(plain, separators=(",", ":"), allow_nan=False))
            f.write("\n")
    return n

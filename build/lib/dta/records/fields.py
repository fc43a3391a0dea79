"""The fields of one training record, and the check every record passes before step 0.

One record is one training sequence. Its fields (any other name is an error that lists these):

* ``input_ids`` (required): a non-empty 1-D list of ints in ``[0, 2**63)`` (and below the
  model's vocabulary size when it is known).
* ``loss_mask``: one 0/1 flag per token (ints, booleans, or numbers equal to 0 or 1). Index
  ``j`` says whether token ``j`` is a training *target*. Token 0 has nothing to predict it,
  so its flag is ignored (an all-ones mask, as SFT data often has, means "every token that
  can be predicted", exactly as Hugging Face's shifted labels treat it). Default: all ones.
* ``advantages``: one finite number per token, or one number for every token.
* ``logprobs`` (or ``old_logprobs``, the same field; give one): the behaviour policy's
  log-probs, one per token, finite and ``<= 0`` (a positive value is a probability or a logit
  given by mistake).
* ``prox_logprobs`` (or ``prox_logp``; give one): proximal-policy log-probs, same rules.
* ``reward``: one finite number (GRPO: ``dta train`` turns rewards into advantages).
* ``weight``: one finite number ``>= 0`` multiplying every loss term of the sequence.
* ``group_id``: an int or a string (the GRPO group, i.e. the prompt the sequence answers).
* ``routed_experts``: MoE routing replay (``docs/moe.md``): per token, per MoE layer, the
  top-k expert ids the rollout used -- a nested list ``[tokens][layers][k]`` of ints >= 0,
  the same number of layers and of ids for every token, no id twice in one token's layer.
  The model check (layers, k, ids below the number of experts) is ``dta.model.routing``'s. It may
  hold one token less than ``input_ids`` (SGLang's export: the last token, which no rollout
  forward saw, is routed by the model itself; its output predicts nothing).
* metadata, kept as given and never used for training: ``id``, ``uid``, ``episode``,
  ``task``, ``call``, ``calls`` (ints or strings) and ``meta`` (anything JSON).

:func:`validate_record` checks one record and returns it as numpy arrays (``input_ids``
int64, ``loss_mask`` int8, the per-token floats float64, a scalar advantage broadcast).
Every error names where the record came from (``<file> line <n>`` or ``sequence <i>``) and
the field. This module is metadata only: it imports neither torch nor the model.
"""
from __future__ import annotations

import difflib
import math
from typing import Any

import numpy as np

__all__ = ["BatchError", "RecordError", "FIELDS", "ALIASES", "validate_record"]


class BatchError(ValueError):
    """Bad input, raised before any gradient or parameter is touched."""


class RecordError(BatchError):
    """A bad record; the message starts with where it came from."""


TOKEN_FLOAT_FIELDS = ("advantages", "logprobs", "old_logprobs", "prox_logprobs", "prox_logp")
LOGPROB_FIELDS = ("logprobs", "old_logprobs", "prox_logprobs", "prox_logp")
METADATA_FIELDS = ("id", "uid", "episode", "task", "call", "calls", "meta")
FIELDS = ("input_ids", "loss_mask", *TOKEN_FLOAT_FIELDS, "reward", "weight", "group_id",
          "routed_experts", *METADATA_FIELDS)
# alternative name -> the name the library uses; a record may hold only one of a pair
ALIASES = {"logprobs": "old_logprobs", "prox_logp": "prox_logprobs"}
INT64_MAX = 2 ** 63 - 1


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _shown(v) -> str:
    if isinstance(v, np.generic):
        v = v.item()
    return repr(v)


def _items(where: str, field: str, values: Any, kind: str) -> tuple[np.ndarray | None, list | np.ndarray]:
    """(a 1-D numpy array or None when numpy cannot make a numeric one, the raw items)."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise RecordError(f"{where}: field '{field}' must be 1-D, got shape {values.shape}")
        return (values if values.dtype.kind in "biuf" else None), values
    if not isinstance(values, (list, tuple)):
        raise RecordError(f"{where}: field '{field}' must be {kind}, got {type(values).__name__}")
    try:
        arr = np.array(values)
    except (ValueError, TypeError, OverflowError):
        return None, values
    if arr.ndim != 1 or arr.dtype.kind not in "biuf":
        return None, values
    return arr, values


def _first(items, ok) -> tuple[int, Any]:
    for i, v in enumerate(items):
        if not ok(v):
            return i, v
    return 0, items[0] if len(items) else None  # pragma: no cover - a failure is known


def _ids(where: str, values: Any, vocab_size: int | None) -> np.ndarray:
    arr, items = _items(where, "input_ids", values, "a list of ints")
    ok_int = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
    if arr is None or (len(arr) and arr.dtype.kind not in "iu"):
        i, v = _first(list(items), lambda x: ok_int(x) and 0 <= x <= INT64_MAX)
        if ok_int(v) and v > INT64_MAX:
            raise RecordError(f"{where}: field 'input_ids' item {i} is {v}, beyond int64 "
                              f"(at most {INT64_MAX})")
        raise RecordError(f"{where}: field 'input_ids' item {i} is {_shown(v)}, expected an int")
    if len(arr) == 0:
        raise RecordError(f"{where}: field 'input_ids' is empty")
    if arr.dtype.kind == "u" and int(arr.max()) > INT64_MAX:  # 2**63 and above: not int64
        i = int(np.argmax(arr > INT64_MAX))
        raise RecordError(f"{where}: field 'input_ids' item {i} is {int(arr[i])}, beyond int64 "
                          f"(at most {INT64_MAX})")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise RecordError(f"{where}: field 'input_ids' item {i} is {int(arr[i])}, expected >= 0")
    if vocab_size is not None and arr.max() >= vocab_size:
        i = int(np.argmax(arr >= vocab_size))
        raise RecordError(f"{where}: field 'input_ids' item {i} is {int(arr[i])}, outside the "
                          f"model's vocabulary [0, {vocab_size})")
    return arr


def _mask(where: str, values: Any, n: int) -> np.ndarray:
    arr, items = _items(where, "loss_mask", values, "a list of 0/1 flags")
    if arr is None:
        i, v = _first(list(items), lambda x: isinstance(x, (int, float, np.number, bool, np.bool_))
                      and x in (0, 1))
        raise RecordError(f"{where}: field 'loss_mask' item {i} is {_shown(v)}, expected 0 or 1")
    if len(arr) != n:
        raise RecordError(f"{where}: field 'loss_mask' has length {len(arr)}, input_ids has {n}")
    bad = ~((arr == 0) | (arr == 1))
    if bad.any():
        i = int(np.argmax(bad))
        raise RecordError(f"{where}: field 'loss_mask' item {i} is {_shown(arr[i])}, "
                          "expected 0 or 1")
    return arr.astype(np.int8)


def _floats(where: str, field: str, values: Any, n: int) -> np.ndarray:
    scalar_ok = field == "advantages"
    if scalar_ok and _is_number(values):
        if not math.isfinite(values):
            raise RecordError(f"{where}: field '{field}' is {_shown(values)}, expected a finite "
                              "number")
        return np.full(n, float(values), dtype=np.float64)
    kind = "a list of numbers or one number" if scalar_ok else "a list of numbers"
    arr, items = _items(where, field, values, kind)
    if arr is None or arr.dtype.kind == "b" or not np.all(np.isfinite(arr)):
        i, v = _first(list(items), lambda x: _is_number(x) and math.isfinite(x))
        raise RecordError(f"{where}: field '{field}' item {i} is {_shown(v)}, expected a finite "
                          "number")
    if len(arr) != n:
        raise RecordError(f"{where}: field '{field}' has length {len(arr)}, input_ids has {n}")
    arr = arr.astype(np.float64, copy=False)
    if field in LOGPROB_FIELDS and arr.max() > 0:
        i = int(np.argmax(arr > 0))
        raise RecordError(f"{where}: field '{field}' item {i} is {_shown(arr[i])}, but a log-prob is "
                          "<= 0 (a probability or a logit given by mistake?)")
    return arr


def _routing(where: str, values: Any, n: int) -> np.ndarray:
    """[n, layers, k] int64 expert ids; an error names the first bad token."""
    field = "routed_experts"
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        values = values.detach().cpu().numpy()
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise RecordError(f"{where}: field '{field}' must be a nested list [tokens][layers][k], "
                          f"got {type(values).__name__}")
    if len(values) not in (n, n - 1) or (n == 1 and len(values) == 0):
        raise RecordError(f"{where}: field '{field}' has {len(values)} tokens, input_ids has {n} "
                          f"(give {n}, or {n - 1}: the last token routed by the model)")
    shape = None
    ok_int = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
    for j, tok in enumerate(values):
        try:
            arr = np.asarray(tok)
        except (ValueError, TypeError):  # ragged layers
            arr = np.asarray(tok, dtype=object)
        if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0 or arr.dtype == object:
            raise RecordError(f"{where}: field '{field}' token {j} must be [layers][k] expert "
                              "ids (a non-empty list of equally long non-empty lists)")
        if shape is None:
            shape = arr.shape
        elif arr.shape != shape:
            raise RecordError(f"{where}: field '{field}' token {j} has {arr.shape[0]} layers x "
                              f"{arr.shape[1]} experts, token 0 has {shape[0]} x {shape[1]}")
        if arr.dtype.kind not in "iu":
            flat = [x for layer in tok for x in layer]
            i = next((i for i, x in enumerate(flat) if not ok_int(x)), 0)
            raise RecordError(f"{where}: field '{field}' token {j} layer {i // shape[1]} holds "
                              f"{_shown(flat[i])}, expected an expert id (an int >= 0)")
        if arr.min() < 0:
            layer = int(np.argwhere(arr < 0)[0][0])
            raise RecordError(f"{where}: field '{field}' token {j} layer {layer} holds "
                              f"{int(arr.min())}, expected an expert id (an int >= 0)")
        srt = np.sort(arr, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]).any(axis=1)
        if dup.any():
            layer = int(np.flatnonzero(dup)[0])
            raise RecordError(f"{where}: field '{field}' token {j} layer {layer} names an "
                              f"expert twice: {arr[layer].tolist()}")
    out = np.asarray(values, dtype=np.int64).reshape(len(values), *shape)
    if len(values) == n - 1:  # SGLang's export: the last token was never forwarded
        out = np.concatenate([out, np.full((1, *shape), -1, dtype=np.int64)])
    return out


def _number(where: str, field: str, value: Any, minimum: float | None = None) -> float:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if not _is_number(value) or not math.isfinite(value):
        raise RecordError(f"{where}: field '{field}' is {_shown(value)}, expected one finite "
                          "number")
    if minimum is not None and value < minimum:
        raise RecordError(f"{where}: field '{field}' is {_shown(value)}, expected >= {minimum:g}")
    return float(value)


def _unknown(where: str, key: str) -> RecordError:
    close = difflib.get_close_matches(str(key), FIELDS, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return RecordError(f"{where}: unknown field '{key}'{hint}; the fields of a record are "
                       f"{', '.join(FIELDS)}")


def validate_record(obj: Any, where: str = "record", *, vocab_size: int | None = None) -> dict:
    """Check one record (see the module doc); return it with numpy arrays."""
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: expected a JSON object (a dict), got {type(obj).__name__}")
    for key in obj:
        if key not in FIELDS:
            raise _unknown(where, key)
    for alt, name in ALIASES.items():
        if alt in obj and name in obj:
            raise RecordError(f"{where}: fields '{alt}' and '{name}' are the same field; give "
                              "one of them")
    if "input_ids" not in obj:
        raise RecordError(f"{where}: field 'input_ids' is missing")
    out = dict(obj)
    ids = _ids(where, obj["input_ids"], vocab_size)
    out["input_ids"] = ids
    n = len(ids)
    if "loss_mask" in obj:
        out["loss_mask"] = _mask(where, obj["loss_mask"], n)
    for field in TOKEN_FLOAT_FIELDS:
        if field in obj:
            out[field] = _floats(where, field, obj[field], n)
    if "routed_experts" in obj:
        out["routed_experts"] = _routing(where, obj["routed_experts"], n)
    if "reward" in obj:
        out["reward"] = _number(where, "reward", obj["reward"])
    if "weight" in obj:
        out["weight"] = _number(where, "weight", obj["weight"], minimum=0.0)
    for field in ("group_id", "id", "uid", "episode", "task", "call", "calls"):
        if field in obj:
            g = obj[field]
            if isinstance(g, np.generic):
                g = out[field] = g.item()
            if isinstance(g, bool) or not isinstance(g, (int, str)):
                raise RecordError(f"{where}: field '{field}' is {_shown(g)}, expected an int or "
                                  "a string")
    return out

"""AReaL batches <-> DTA: one-sequence micro-batches in AReaL's packed layout, the DFS
batch they are walked as, and the right-padded output of ``forward_batch``.

Two alignments meet here:

* AReaL's *training* tensors (after ``PPOActor.compute_advantages``) are **rolled**: position
  ``t`` belongs to the prediction of token ``t+1`` (``loss_mask[t]``, ``logprobs[t]``,
  ``advantages[t]``, ``prox_logp[t]``), and the log-probs the engine hands to ``loss_fn`` are
  ``log p(input_ids[t+1] | input_ids[:t+1])``. The last position of a sequence has no next
  token: AReaL's label there is ``roll(input_ids, -1)`` of the packed micro-batch, i.e. the
  token that follows in the micro-batch (the next sequence's first token, or the padding id 0).
* DTA's per-token fields are **token-aligned**: index ``j`` belongs to token ``j`` as a target;
  index 0 is never a target.

The engine walks every sequence with its AReaL *wrap label* appended (what AReaL's FSDP engine
sees with one sequence per micro-batch: the padding id 0, or the sequence's own first token when
the micro-batch needs no padding), so ``loss_fn`` receives exactly the tensors AReaL would give
it at every position, the last one included. Nothing here imports torch.distributed.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
from areal.engine.core.model import is_qwen3_5_model, is_qwen3_moe_model, is_qwen3_vl_model
from areal.utils.data import (
    DEFAULT_MAX_TOKENS_PER_MB,
    N_TOKENS_PER_PAGE,
    amend_position_ids,
    concat_batch,
    pack_tensor_dict,
    pad_and_stack_tensors_along_first_dim,
    split_batch,
    unpack_sequence,
)

from dta.batch import Batch, unpad
from dta.records.fields import validate_record

__all__ = ["normalize_input", "split_sequences", "take_routing", "wrap_label", "walk_batch",
           "areal_view", "pad_outputs", "split_batch", "to_dta_batch", "from_records",
           "SEQ_INDEX", "ROUTING_KEYS"]

ROUTING_KEYS = ("routed_experts", "r3_routing_valid")  # AReaL's R3 trajectory tensors
SEQ_INDEX = "seq_index"  # the per-token field that tells an opaque loss which sequence it sees
_ROLLED = ("loss_mask", "logprobs", "prox_logp", "advantages")


def normalize_input(input_: list[dict[str, Any]] | dict[str, Any]):
    """A dict of right-padded ``[B, S]`` tensors, and the metadata to split outputs back into
    trajectories when the input was a list (``FSDPEngine._normalize_batch_input``)."""
    if isinstance(input_, list):
        return concat_batch(input_)
    if not isinstance(input_, Mapping):
        raise TypeError(f"expected a dict of [B, S] tensors or a list of them, got "
                        f"{type(input_).__name__}")
    return dict(input_), None


def split_sequences(batched: Mapping[str, Any], *, model_type: str = "",
                    device=None) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """The token ids of each sequence and its one-sequence micro-batch, in the packed layout
    ``FSDPEngine`` hands to ``loss_fn`` (``_prepare_mb_list`` with one sequence per
    micro-batch): ``[L]`` tensors, ``cu_seqlens = [0, L]``, ``max_seqlen``, ``position_ids``,
    the flash-attention keys, and every non-``[B, S]`` value unchanged."""
    for key in ("input_ids", "attention_mask"):
        if key not in batched:
            raise ValueError(f"the batch has no '{key}' (AReaL batches are dicts of right-padded "
                             "[B, S] tensors with input_ids and attention_mask)")
    if any(k in batched for k in ROUTING_KEYS):  # take_routing pops them first
        raise ValueError(f"split_sequences: the batch still has "
                         f"{[k for k in ROUTING_KEYS if k in batched]}; take_routing(batched) "
                         "takes AReaL's R3 keys out first")
    if any(str(k).startswith("multi_modal_input") for k in batched):
        raise NotImplementedError("DTATrainEngine trains text-only models; the batch has "
                                  "multi-modal inputs")
    mask = batched["attention_mask"]
    if not torch.is_tensor(mask) or mask.ndim != 2:
        raise ValueError(f"'attention_mask' must be a [B, S] tensor, got "
                         f"{getattr(mask, 'shape', type(mask).__name__)}")
    ids = unpad(batched["input_ids"], mask)  # raises, naming the row, on left padding or holes
    B, S = mask.shape
    drop_mask = is_qwen3_moe_model(model_type) or is_qwen3_vl_model(model_type) or \
        is_qwen3_5_model(model_type)
    mbs = []
    for i in range(B):
        one = {}
        for key, value in batched.items():
            if key == "position_ids" or (torch.is_tensor(value) and value.numel() == B * S
                                         and value.shape[0] == B):
                one[key] = value[i:i + 1]
            else:
                one[key] = value
        one = pack_tensor_dict(amend_position_ids(one))
        one["max_length_q"] = one["max_length_k"] = one["max_seqlen"] = int(one["max_seqlen"])
        one["cu_seq_lens_q"] = one["cu_seq_lens_k"] = one["cu_seqlens"]
        one["use_cache"] = False
        one["attention_mask"] = None if drop_mask else dict(full_attention=None,
                                                            sliding_attention=None)
        if device is not None:
            one = {k: v.to(device) if torch.is_tensor(v) else v for k, v in one.items()}
        mbs.append(one)
    return ids, mbs


def take_routing(batched: dict[str, Any]) -> list[np.ndarray] | None:
    """Pop AReaL's R3 keys from ``batched`` and return each sequence's replayed routing as
    the record field ``routed_experts`` (``dta.records.fields``): ``[n, MoE layers, k]`` int64, the
    last token's row -1 (routed by the model itself), or None when the batch has no routing.

    AReaL's layout (``areal/engine/r3/preprocess.py``, what its RLVR / OpenAI workflows put in
    a trajectory when SGLang returns routing): ``routed_experts`` int32 ``[B, S, MoE layers,
    top_k]`` right-padded with zeros, and ``r3_routing_valid`` bool ``[B]``. Rows ``0..n-2``
    of a sequence of ``n`` tokens are SGLang's (it exports ``n - 1``: the last generated token
    was never forwarded); row ``n - 1`` is AReaL's fill (a copy of the nearest earlier row),
    not a routing any rollout computed, so it is not replayed: the last token is routed as
    the record field's ``n - 1`` form says (docs/moe.md). A sequence AReaL marked invalid
    (holes in its routing) is an error: DTA replays every sequence's routing or none."""
    routed = batched.pop("routed_experts", None)
    valid = batched.pop("r3_routing_valid", None)
    if routed is None:
        if valid is not None:
            raise ValueError("the batch has 'r3_routing_valid' but no 'routed_experts' (AReaL's "
                             "R3 keys come in pairs)")
        return None
    if "input_ids" not in batched or "attention_mask" not in batched:
        raise ValueError("the batch has 'routed_experts' but no 'input_ids' / 'attention_mask'")
    ids = unpad(batched["input_ids"], batched["attention_mask"])
    B, S = batched["attention_mask"].shape
    shape = tuple(getattr(routed, "shape", ()))
    if torch.is_tensor(routed) and routed.ndim == 4 and shape[0] != B:
        raise ValueError(f"the batch's 'routed_experts' has {shape[0]} sequences, input_ids "
                         f"{B}: AReaL 1.0.4's PPOActor hands every minibatch the whole R3 "
                         "tensors (its split leaves [B, S, layers, k] unsplit): set "
                         "ppo_n_minibatches=1, or pass them through the side channel")
    if not torch.is_tensor(routed) or routed.ndim != 4 or shape[:2] != (B, S) or \
            routed.dtype.is_floating_point or routed.dtype == torch.bool:
        got = f"{type(routed).__name__} {list(shape)}" + \
            (f" {routed.dtype}" if torch.is_tensor(routed) else "")
        raise ValueError(f"the batch's 'routed_experts' must be an integer tensor [B, S, MoE "
                         f"layers, top_k] with [B, S] = [{B}, {S}] (AReaL's R3 layout, "
                         f"areal/engine/r3/preprocess.py), got {got}")
    if valid is not None:
        valid = torch.as_tensor(valid)
        if tuple(valid.shape) != (B,):
            raise ValueError(f"the batch's 'r3_routing_valid' must be [B] = [{B}], got "
                             f"{list(valid.shape)}")
        bad = torch.nonzero(~valid.bool().cpu()).flatten()
        if len(bad):
            raise ValueError(f"sequence {int(bad[0])}: 'r3_routing_valid' is False (AReaL found "
                             "tokens without a rollout routing); DTATrainEngine replays every "
                             "sequence's routing or none: drop that sequence or the R3 keys")
    rows = routed.detach().cpu().numpy()
    out = []
    for i, s in enumerate(ids):
        n = len(s)
        if n < 2:
            raise ValueError(f"sequence {i}: 'routed_experts' of a 1-token sequence (SGLang "
                             "exports none); drop the sequence or the R3 keys")
        rec = validate_record({"input_ids": s, "routed_experts": rows[i, :n - 1]},
                              f"sequence {i}")
        out.append(rec["routed_experts"])
    return out


def wrap_label(ids: np.ndarray, *, pad_to_maximum: bool = False,
               max_tokens_per_mb: int | None = None) -> int:
    """The label AReaL's ``roll(input_ids, -1)`` gives a sequence's last token when the
    sequence is alone in its micro-batch: the padding id 0 when ``pad_mb_list`` pads the
    micro-batch (to a multiple of 256 tokens, or to ``max_tokens_per_mb`` with
    ``pad_to_maximum``), else the sequence's own first token."""
    n = len(ids)
    if pad_to_maximum and max_tokens_per_mb not in (None, DEFAULT_MAX_TOKENS_PER_MB):
        padded = int(max_tokens_per_mb)
    else:
        padded = -(-n // N_TOKENS_PER_PAGE) * N_TOKENS_PER_PAGE
    return 0 if padded > n else int(ids[0])


def walk_batch(ids: list[np.ndarray], weights: Iterable[float] | None = None, *,
               labels: list[int] | None = None, max_positions: int | None = None,
               routing: list[np.ndarray] | None = None) -> Batch:
    """The DTA batch the engine walks: each sequence with its wrap label appended (when the
    model has a position for it) and a ``seq_index`` field, so that an opaque
    :class:`dta.losses.SequenceLoss` knows which AReaL micro-batch it is evaluating.

    ``routing`` (``take_routing``) is replayed; the wrap label gets no routing of its own
    (-1: the router's, or a longer sequence's where it shares that token): its hidden state
    predicts nothing the walk records and no token of its sequence attends to it, so its
    routing cannot reach the loss (the router aux loss, which would count it, is not added
    by the adapter, nor by AReaL's own engines)."""
    seqs, routed = [], None if routing is None else []
    for i, s in enumerate(ids):
        if labels is not None and (max_positions is None or len(s) < max_positions):
            s = np.append(s, np.int64(labels[i]))
        seqs.append(np.asarray(s, dtype=np.int64))
        if routing is not None:
            r = routing[i]
            extra = np.full((len(s) - len(r), *r.shape[1:]), -1, dtype=r.dtype)
            routed.append(np.concatenate([r, extra]))
    fields = {SEQ_INDEX: [np.full(len(s), float(i)) for i, s in enumerate(seqs)]}
    w = None if weights is None else np.asarray(list(weights), dtype=np.float64)
    return Batch(seqs, fields, w, routed_experts=routed)


def areal_view(x: torch.Tensor, n: int) -> torch.Tensor:
    """A token-aligned per-sequence tensor (index j: the prediction of token j, as the walker
    records it, over the sequence plus its wrap label) as AReaL's rolled ``[n]`` tensor
    (index t: the prediction of token t+1; the last index: the wrap label's). Keeps the graph.
    Without a wrap label (no position left for it) the last index is 0."""
    if len(x) == n + 1:
        return x[1:]
    return torch.cat([x[1:n], x.new_zeros(1)])


def pad_outputs(outputs: list[torch.Tensor], output_seqlens: list[int],
                aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat
                ) -> torch.Tensor:
    """``reorder_and_pad_outputs`` with every sequence its own micro-batch, in input order:
    aggregate, split by ``output_seqlens``, right-pad with zeros into ``[B, max_len]``."""
    res = aggregate_fn(outputs)
    return pad_and_stack_tensors_along_first_dim(list(unpack_sequence(res, lens=output_seqlens)))


# ------------------------------------------------------------ DTA records <-> AReaL --
def _roll(x: torch.Tensor) -> torch.Tensor:
    return torch.roll(x, shifts=-1, dims=-1)


def from_records(records: Iterable[Mapping], *, rolled: bool = True,
                 logprobs_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """DTA records (token-aligned ``input_ids``, ``loss_mask``, ``advantages``, ``logprobs``,
    ``prox_logprobs``/``prox_logp``; see :mod:`dta.records.jsonl`) as one AReaL batch of right-padded
    ``[B, S]`` tensors. ``rolled=True`` gives the training form (what ``PPOActor.ppo_update``
    hands to ``train_batch``: per-token fields rolled by -1); ``rolled=False`` the rollout form
    (token-aligned, as a rollout workflow returns it, before ``compute_advantages``)."""
    records = list(records)
    if not records:
        raise ValueError("no records")
    B, S = len(records), max(len(r["input_ids"]) for r in records)
    out = {"input_ids": torch.zeros(B, S, dtype=torch.long),
           "attention_mask": torch.zeros(B, S, dtype=torch.bool)}
    names = {"loss_mask": "loss_mask", "advantages": "advantages", "logprobs": "logprobs",
             "old_logprobs": "logprobs", "prox_logprobs": "prox_logp", "prox_logp": "prox_logp"}
    for i, rec in enumerate(records):
        ids = np.asarray(rec["input_ids"])
        n = len(ids)
        out["input_ids"][i, :n] = torch.as_tensor(ids, dtype=torch.long)
        out["attention_mask"][i, :n] = True
        for key, name in names.items():
            if key not in rec:
                continue
            value = np.asarray(rec[key], dtype=np.float64)
            if value.ndim == 0:
                value = np.full(n, float(value))
            dtype = torch.int32 if name == "loss_mask" else logprobs_dtype
            if name not in out:
                out[name] = torch.zeros(B, S, dtype=dtype)
            out[name][i, :n] = torch.as_tensor(value, dtype=dtype)
    if rolled:
        for name in _ROLLED:
            if name in out:
                out[name] = _roll(out[name])
    return out


def to_dta_batch(batched: Mapping[str, Any]) -> Batch:
    """An AReaL training-form batch (rolled fields) as a :class:`dta.batch.Batch` with
    token-aligned ``loss_mask``, ``advantages``, ``old_logprobs`` and ``prox_logprobs``
    (index 0, never a target, gets 0; a rolled value at a sequence's last position has no
    token to belong to and is dropped)."""
    ids = unpad(batched["input_ids"], batched["attention_mask"])
    records = []
    for i, s in enumerate(ids):
        rec = {"input_ids": s}
        n = len(s)
        for name in _ROLLED:
            if name not in batched:
                continue
            row = batched[name][i, :n].detach().cpu().double().numpy()
            aligned = np.zeros(n)
            aligned[1:] = row[:n - 1]
            rec[name] = aligned
        records.append(rec)
    return Batch.from_records(records)

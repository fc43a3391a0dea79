"""verl's no-padding batches <-> DTA: the sequences to walk, one-sequence micro-batches in
verl's layout, and the nested outputs verl's losses and trainer read.

verl (0.9.1) hands an engine a ``TensorDict`` whose ``input_ids`` / ``position_ids`` are
jagged nested tensors (``left_right_2_no_padding``) and whose model outputs are nested too:
``log_probs[i][t] = log p(input_ids[i][t+1] | input_ids[i][:t+1])``, rolled over the packed
micro-batch, so the last position of a sequence holds the log-prob of whatever token follows
it in the pack. With one sequence per micro-batch that is the sequence's own first token; the
walk appends it (the *wrap label*), so the loss function sees at every position exactly what
verl's FSDP engine gives it with one sequence per micro-batch. DTA's walk records
token-aligned tensors (index j: the prediction of token j); :func:`verl_view` shifts them.
"""
from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

from dta.batch import Batch
from runtime.engine import comm

__all__ = ["SEQ_INDEX", "sequences", "one_sequence_batches", "walk_batch", "verl_view",
           "nested", "temperature_of", "batch_normalizers"]

SEQ_INDEX = "seq_index"  # the per-token field that tells an opaque loss which sequence it sees


def sequences(data: TensorDict) -> list[np.ndarray]:
    """The token ids of each row, checked: nested ``input_ids``, positions ``0..L-1`` (the walk
    places every token by its depth in the prefix tree), text only, log-probs and entropy
    asked for (nothing else)."""
    ids = data.get("input_ids", None)
    if ids is None or not isinstance(ids, torch.Tensor) or not ids.is_nested:
        raise ValueError("the batch's 'input_ids' must be a nested (jagged) tensor, as verl's "
                         "left_right_2_no_padding makes it")
    for key in ("calculate_sum_pi_squared", "distillation_use_topk", "distillation_only"):
        if tu.get_non_tensor_data(data, key, False):
            raise NotImplementedError(f"the batch asks for {key}=True: the dta engine "
                                      "returns log-probs and entropy only")
    if any(str(k).startswith("multi_modal") for k in data.keys()):
        raise NotImplementedError("the dta engine trains text-only language models; the batch "
                                  "has multi-modal inputs")
    pad_mode = tu.get_non_tensor_data(data=data, key="pad_mode", default=None)
    if pad_mode is not None and str(getattr(pad_mode, "value", pad_mode)) != "no_padding":
        raise NotImplementedError(f"the dta engine reads verl's no-padding batches; pad_mode="
                                  f"{pad_mode!r}")
    rows = [t.detach().cpu().numpy().astype(np.int64) for t in ids.unbind()]
    pos = data.get("position_ids", None)
    if pos is not None:
        if pos.dim() == 3 or (pos.is_nested and pos.values().dim() != 1):
            raise NotImplementedError("3-D (multi-modal rope) position_ids are not supported by "
                                      "the dta engine")
        for i, p in enumerate(pos.unbind() if pos.is_nested else pos):
            p = p.detach().cpu().numpy()
            if len(p) != len(rows[i]) or not np.array_equal(p, np.arange(len(p))):
                raise ValueError(f"sequence {i}: position_ids must be 0..{len(rows[i]) - 1} (one "
                                 "unpacked sequence per row); the dta engine places tokens "
                                 "by their depth in the prefix tree")
    for i, r in enumerate(rows):
        if len(r) < 2:
            raise ValueError(f"sequence {i}: {len(r)} token(s); a sequence needs a prompt token "
                             "and a response token")
    return rows


def one_sequence_batches(data: TensorDict) -> list[TensorDict]:
    """Row ``i`` alone, in verl's layout (nested tensors of one row, non-tensor data kept):
    the micro-batch verl's FSDP engine builds with ``micro_batch_size_per_gpu=1``."""
    return [tu.index_select_tensor_dict(data, [i]) for i in range(len(data))]


def walk_batch(rows: list[np.ndarray], *, max_positions: int | None = None) -> Batch:
    """The DTA batch: each row with its wrap label (its own first token) appended where the
    model has a position for it, and a ``seq_index`` field for the opaque loss."""
    seqs = []
    for s in rows:
        if max_positions is None or len(s) < max_positions:
            s = np.append(s, s[0])
        seqs.append(np.asarray(s, dtype=np.int64))
    fields = {SEQ_INDEX: [np.full(len(s), float(i)) for i, s in enumerate(seqs)]}
    return Batch(seqs, fields)


def verl_view(x: torch.Tensor, n: int) -> torch.Tensor:
    """A token-aligned walk tensor of a row of ``n`` tokens (plus its wrap label) as verl's
    rolled ``[n]`` tensor. Keeps the graph. Without a wrap label the last index is 0."""
    if len(x) == n + 1:
        return x[1:]
    return torch.cat([x[1:n], x.new_zeros(1)])


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows as one jagged nested tensor (the autograd graph of each row kept)."""
    values = torch.cat(rows) if len(rows) > 1 else rows[0]
    lengths = torch.tensor([len(r) for r in rows], device=values.device)
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def temperature_of(data: TensorDict) -> float:
    """The batch's sampling temperature (verl's ``temperature`` key: a scalar, or one value per
    row) as verl's engines apply it (in float32); the walk divides the logits by one
    temperature, so rows must agree."""
    t = data.get("temperature", None)
    if t is None:
        raise ValueError("the batch has no 'temperature' (verl's trainer sets it from "
                         "rollout.temperature)")
    t = tu.unwrap_non_tensor_data(t) if not isinstance(t, torch.Tensor) else t
    if isinstance(t, torch.Tensor):
        values = torch.unique(t.detach().float().cpu().reshape(-1))
        if values.numel() != 1:
            raise NotImplementedError(f"per-row temperatures {values.tolist()}: the dta engine "
                                      "walks a batch at one temperature")
        t = float(values[0])
    t = float(t)
    if not t > 0:
        raise ValueError(f"temperature must be > 0, got {t}")
    # verl's engines divide the logits by the temperature as a float32 tensor (0.8 is
    # 0.800000011920929): the walk uses that same value
    return float(torch.tensor(t, dtype=torch.float32))


def batch_normalizers(data: TensorDict, rows: list[np.ndarray], group, dp_size: int,
                      device=None) -> None:
    """Fill in what verl's losses normalize by, over the data-parallel group (``group``, of
    ``dp_size`` ranks: one rank of each context-parallel group, which walk the same rows),
    before the batch is split into one-sequence micro-batches: ``batch_num_tokens`` and
    ``dp_size`` (as verl's FSDP engine always does), and -- only where the caller left them
    unset -- the ``global_batch_size`` (sequences with a trained token) and
    ``max_response_len`` (the horizon of ``seq-mean-token-sum-norm``) that verl's losses would
    otherwise take from each micro-batch. Set that way, the per-sequence losses sum to the loss
    verl's FSDP engine computes with the whole batch as one micro-batch; set by the caller
    (verl's trainer sets both), they are used unchanged. ``device``: where the collectives'
    tensors live (the engine's device: NCCL reduces device tensors only)."""
    mask = data["loss_mask"]
    per_row = [int(m.sum()) for m in (mask.unbind() if mask.is_nested else mask)]
    totals = torch.tensor([sum(per_row), sum(1 for n in per_row if n > 0)], dtype=torch.float64,
                          device=device)
    comm.all_reduce(totals, group)
    tu.assign_non_tensor(data, batch_num_tokens=int(totals[0]), dp_size=int(dp_size))
    if tu.get_non_tensor_data(data=data, key="global_batch_size", default=None) is None:
        tu.assign_non_tensor(data, global_batch_size=int(totals[1]))
    if "responses" in data.keys() and \
            tu.get_non_tensor_data(data=data, key="max_response_len", default=None) is None:
        resp = data["responses"]
        longest = torch.tensor([int(resp.offsets().diff().max()) if resp.is_nested
                                else resp.shape[-1]], dtype=torch.float64, device=device)
        comm.all_reduce(longest, group, op="max")
        tu.assign_non_tensor(data, max_response_len=int(longest[0]))

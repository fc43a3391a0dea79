"""DTA records (``dta.records``: token-aligned ``input_ids``, ``loss_mask``, ``advantages``,
``logprobs``) as the batch verl's trainer hands an actor engine: left-padded prompts (the
tokens before the first trained one), right-padded responses with ``response_mask`` (the loss
mask: tool and user turns inside the response stay 0), per-token ``advantages`` and
``old_log_probs``, converted by verl's own ``left_right_2_no_padding``; plus the non-tensor
keys verl's trainer sets (temperature, global batch size, micro-batching). Used by the tests
and experiments/bench_verl.py to feed the same batch to the dta engine and verl's FSDP one.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding

__all__ = ["records_to_verl"]


def records_to_verl(records: Iterable[Mapping], *, temperature: float = 1.0,
                    old_logprobs: torch.Tensor | None = None, dtype=torch.float32,
                    calculate_entropy: bool = True, use_remove_padding: bool = True,
                    micro_batch_size: int | None = None,
                    max_token_len: int | None = None) -> TensorDict:
    """One verl actor batch of ``records`` (see the module doc). ``old_logprobs``: ``[B, R]``
    over the padded responses (default: each record's ``logprobs``, 0 where it has none);
    ``micro_batch_size``: verl's ``micro_batch_size_per_gpu`` (default: the whole batch);
    ``max_token_len``: verl's dynamic micro-batching instead (``use_dynamic_bsz`` with
    ``max_token_len_per_gpu``)."""
    if micro_batch_size is not None and max_token_len is not None:
        raise ValueError("give micro_batch_size or max_token_len, not both")
    recs = list(records)
    prompts, responses, masks, advs, olds = [], [], [], [], []
    for i, r in enumerate(recs):
        ids = np.asarray(r["input_ids"], dtype=np.int64)
        lm = np.asarray(r["loss_mask"], dtype=np.int64)
        if len(lm) != len(ids) or not lm.any():
            raise ValueError(f"record {i}: loss_mask must have one flag per token and at least "
                             "one trained token")
        start = int(np.argmax(lm > 0))
        if start == 0:
            raise ValueError(f"record {i}: token 0 is trained; verl needs a prompt token first")
        prompts.append(ids[:start])
        responses.append(ids[start:])
        masks.append(lm[start:])
        adv = r.get("advantages")
        advs.append(np.zeros(len(ids) - start) if adv is None else
                    np.broadcast_to(np.asarray(adv, dtype=np.float64), ids.shape)[start:].copy())
        lp = r.get("logprobs")
        olds.append(np.zeros(len(ids) - start) if lp is None else
                    np.asarray(lp, dtype=np.float64)[start:])
    B = len(recs)
    P, R = max(map(len, prompts)), max(map(len, responses))
    input_ids = torch.zeros(B, P + R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    advantages = torch.zeros(B, R, dtype=dtype)
    old = torch.zeros(B, R, dtype=dtype)
    for i in range(B):
        p, s = prompts[i], responses[i]
        input_ids[i, P - len(p):P] = torch.as_tensor(p)
        input_ids[i, P:P + len(s)] = torch.as_tensor(s)
        attention[i, P - len(p):P + len(s)] = 1
        response_mask[i, :len(s)] = torch.as_tensor(masks[i])
        advantages[i, :len(s)] = torch.as_tensor(advs[i], dtype=dtype)
        old[i, :len(s)] = torch.as_tensor(olds[i], dtype=dtype)
    if old_logprobs is not None:
        if tuple(old_logprobs.shape) != (B, R):
            raise ValueError(f"old_logprobs must be [B, R] = [{B}, {R}], got "
                             f"{list(old_logprobs.shape)}")
        old = old_logprobs.to(dtype)
    td = TensorDict(dict(prompts=input_ids[:, :P], responses=input_ids[:, P:],
                         input_ids=input_ids, attention_mask=attention,
                         position_ids=torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0),
                         response_mask=response_mask, advantages=advantages,
                         old_log_probs=old), batch_size=[B])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=float(temperature),
                         calculate_entropy=calculate_entropy,
                         use_remove_padding=use_remove_padding,
                         use_dynamic_bsz=max_token_len is not None,
                         micro_batch_size_per_gpu=micro_batch_size or B,
                         max_token_len_per_gpu=max_token_len, use_fused_kernels=False,
                         global_batch_size=B)
    return td

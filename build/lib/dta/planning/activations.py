"""One rank's activation bytes at its peak, by part (``dta.planning.memory`` prices them with
the model state; the module doc there describes each part).

Mixture-of-experts layers save, per routed row, the gathered input and the expert's output
and the expert MLP's 4 I (:attr:`dta.planning.shapes.ModelShape.mlp_saved`). Routing is
assumed **balanced**: under expert parallelism (E > 1) a rank receives as many routed rows
as it sends (its own rows x top_k), so E moves the experts' activations between ranks and
does not divide them; it adds ``ep_buffers``, one MoE layer call's dispatch send and
receive buffers (the rank's rows x top_k x hidden, twice).
"""
from __future__ import annotations

import math

from dta.planning import cp
from dta.planning.chunks import logits_rows  # the head's chunk rule (logits within LOGITS_BYTES)
from dta.planning.cp import CP_SCHEME, check_scheme
from dta.planning.shapes import ModelShape

# CP sizes `dta plan --memory` tries (those dividing the world); beyond a model's KV heads a
# split group shares each KV head's rows (dta.planning.cp.HeadSplit)
CONTEXT_PARALLEL = (1, 2, 4, 8, 16)


def check_context_parallel(size) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"context_parallel must be an integer >= 1 (ranks per tree), got "
                         f"{size!r}")
    return size


def activation_split(shape: ModelShape, *, path_tokens: int, call_tokens: int, policy: str,
                     compute_bytes: int, logits_chunk: int,
                     block_tokens: int | None = None, context_parallel: int = 1,
                     cp_scheme: str = CP_SCHEME, expert_parallel: int = 1) -> dict:
    """Activation bytes by part (``dta.planning.memory``'s module doc): ``path_kv``,
    ``graphs``, ``head`` (and ``cp_buffers`` with ``context_parallel`` > 1 ranks per tree,
    priced by ``cp_scheme``: :func:`dta.planning.cp.activations`; ``ep_buffers`` with
    ``expert_parallel`` > 1, module doc)."""
    if policy not in ("retain", "recompute"):
        raise ValueError(f"unknown memory policy {policy!r}; choose retain or recompute")
    C = check_context_parallel(context_parallel)
    check_scheme(cp_scheme)
    c = compute_bytes
    call = min(call_tokens, block_tokens) if block_tokens else call_tokens
    path = max(int(path_tokens), 0)
    pieces = math.ceil(path / max(call, 1)) if path else 0  # graphs along the path (retain)
    if C > 1:
        split = cp.activations(shape, cp_scheme, C, path=path, call=call, pieces=pieces,
                               policy=policy, compute_bytes=c, logits_chunk=logits_chunk)
    else:
        split = _alone(shape, path, call, pieces, policy, c, logits_chunk)
    if int(expert_parallel) > 1 and shape.is_moe:
        n = max(min(call, path) if path else call, 1)
        rows = n if C > 1 and cp_scheme == "replicated" else math.ceil(n / C)
        split["ep_buffers"] = int(2 * rows * shape.experts.top_k * shape.hidden * c)
    return split


def _alone(shape: ModelShape, path: int, call: int, pieces: int, policy: str, c: int,
           logits_chunk: int) -> dict:
    """One rank walking its tree alone (C = 1)."""
    kv = 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * c  # per token, K and V
    q = shape.heads * shape.head_dim
    # saved per token per layer: norms' inputs, q/k/v, attention out; the MLPs' (mlp_saved)
    saved = ((4 * shape.hidden + q + 2 * shape.kv_heads * shape.head_dim + q) * shape.layers
             + shape.mlp_saved) * c
    if policy == "retain":
        graph_tokens, read = path, path * (pieces + 1) / 2
    else:
        graph_tokens, read = min(call, path) if path else call, path
    states = 2 * pieces * shape.gdn_layers * shape.gdn_state * 4  # leaf + gradient, fp32
    head = 3 * min(logits_rows(logits_chunk, shape.vocab), max(call, 1)) * shape.vocab * 4
    return {"path_kv": int(kv * (2 * path + read) + states), "graphs": int(saved * graph_tokens),
            "head": int(head)}

"""Context parallelism priced: what a group of C ranks walking one tree divides, holds, sends.

Two schemes (:data:`CP_SCHEMES`), both priced from a :class:`~dta.planning.shapes.ModelShape`:

``split`` (the default, :data:`CP_SCHEME`; issue 41's work-dividing design). Each decoder
call's T rows are split over the group for everything outside attention (embedding, norms,
projections, MLP/MoE, LM head and loss: rank r takes rows [r T // C, (r + 1) T // C)).
Inside each attention call one all-to-all turns the rows' q/k/v (all heads) into all T rows
of the rank's heads, attention runs over the path for those heads (the path's K/V, and their
gradient accumulators, are stored split by KV heads), and one all-to-all turns the output
back into rows; the backward does the same in reverse, and under *recompute* the re-forward
once more. Gated DeltaNet layers split the same way by value head. Where C exceeds the KV
heads, the G = C // H_kv ranks sharing a KV head split its path rows and the call's keys and
merge by log-sum-exp: the partial (out, lse) go back to the rows' owners with the output.

``replicated`` (round 4, docs/context-parallel.md). Every rank runs the whole call; only the
path's K/V are stored sliced by rows and the attention over them divided: a call attends to
its own keys on every rank; per attention layer call, (out, lse) and dQ are all-gathered,
and a popped pack's K/V gradients (its own rows).

Per rank, with U the group's tokens, A their attention context (Σ over tokens of tree
position + 1) and a call of T tokens, ``token`` and ``attention`` the coefficients of
:class:`~dta.planning.cost.CostModel` (forward + backward = 3 forwards; *recompute* forwards
twice: x 4/3, :data:`RECOMPUTE_FACTOR`):

==========  ======================================  ==============================================
scheme      FLOPs per rank                          bytes sent per rank per attention layer, pass
==========  ======================================  ==============================================
split       token Σ ceil(T / C) + attention A s     (C−1)/C c [U h_q (2 d + [G>1]) + Σ ceil(T/G) 2 h_kv d]
replicated  token U + attention (O + (A − O) / C)   (C−1) c [U H (2 d + 1) + Σ ceil(T / C) 2 H_kv d]
==========  ======================================  ==============================================

(s = h_q / (H G): the most loaded rank's share of the attention, h_q its query heads, h_kv its
KV heads (:class:`HeadSplit`); O = Σ T (T + 1) / 2, the pairs inside calls; d the head dim,
c the compute dtype's bytes. split: 2 passes (forward, backward), 3 under recompute, two
all-to-alls each; replicated: the three all-gathers once (recompute's re-forward reads the
pack's tape); split GDN layers add (C−1)/C c U (in + out channels) x their head share.)
What is not divided by C is what these leave over: the rows and heads a rank takes beyond
T / C and H / C when they do not divide (split), everything but the path's attention
(replicated).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dta.planning.chunks import logits_rows
from dta.planning.shapes import ModelShape

CP_SCHEMES = ("split", "replicated")
CP_SCHEME = "split"  # what the planner prices unless told otherwise
RECOMPUTE_FACTOR = 4 / 3  # recompute: forward, re-forward at pop, backward (= 2 forwards)


def check_scheme(scheme) -> str:
    if scheme not in CP_SCHEMES:
        raise ValueError(f"unknown context-parallel scheme {scheme!r}; choose from "
                         f"{', '.join(CP_SCHEMES)}")
    return scheme


@dataclass(frozen=True)
class HeadSplit:
    """The most loaded rank's part of one attention layer in a split group of C ranks."""

    kv_heads: int  # KV heads whose path K/V (and gradients) it stores
    q_heads: int  # query heads it attends for
    row_groups: int  # G: ranks sharing one KV head, each holding 1/G of its rows (1: C <= H_kv)

    @classmethod
    def of(cls, shape: ModelShape, ranks: int) -> "HeadSplit":
        C, H, Hkv = int(ranks), shape.heads, shape.kv_heads
        if C <= Hkv:
            kv = -(-Hkv // C)
            return cls(kv, -(-H * kv // Hkv), 1)
        return cls(1, -(-H // Hkv), C // Hkv)

    def attention_share(self, shape: ModelShape) -> float:
        return self.q_heads / shape.heads / self.row_groups


def _gdn_share(shape: ModelShape, C: int) -> float:
    return -(-shape.gdn_heads // C) / shape.gdn_heads if shape.gdn_heads else 0.0


def activations(shape: ModelShape, scheme: str, ranks: int, *, path: int, call: int,
                pieces: int, policy: str, compute_bytes: int, logits_chunk: int) -> dict:
    """One rank's activation bytes (``path_kv``, ``graphs``, ``head``, ``cp_buffers``) in a
    group of ``ranks`` > 1 (``dta.planning.memory.activation_split`` prices C = 1). ``call``:
    the largest call (block applied), ``pieces``: calls along the longest path."""
    C, c, d = int(ranks), compute_bytes, shape.head_dim
    n = max(min(call, path) if path else call, 1)  # the call whose graph is alive (recompute)
    states = 2 * pieces * shape.gdn_layers * shape.gdn_state * 4  # leaf + gradient, fp32
    q = shape.heads * d
    if check_scheme(scheme) == "replicated":
        kv = 2 * shape.attention_layers * shape.kv_heads * d * c  # per token, K and V
        share = math.ceil(path / C)  # this rank's rows of the path
        own = path if policy == "retain" else share  # retain: each graph keeps its pack's K/V
        saved = (4 * shape.hidden + 2 * q + 2 * shape.kv_heads * d) * shape.layers \
            + shape.mlp_saved  # per token: norms, q/k/v/out; the MLPs'
        graph = path if policy == "retain" else min(call, path) if path else call
        head = 3 * min(logits_rows(logits_chunk, shape.vocab), max(call, 1)) * shape.vocab * 4
        gathered = 2 * C * n * q * c  # (out, lse) and dQ of one layer call, all-gathered
        scores = 2 * shape.heads * n * math.ceil(n / C) * c  # one piece: scores, probabilities
        return {"path_kv": int(kv * (2 * share + own) + states),
                "graphs": int(saved * c * graph), "head": int(head),
                "cp_buffers": int(gathered + kv * n + scores)}
    hs = HeadSplit.of(shape, C)
    store = 2 * shape.attention_layers * d * c * hs.kv_heads * math.ceil(path / hs.row_groups)
    read = store * (pieces + 1) / 2 if policy == "retain" else store  # what graphs saved
    graph = path if policy == "retain" else min(call, path) if path else call
    rows = (4 * shape.hidden * shape.layers + shape.mlp_saved) * math.ceil(graph / C)  # norms, MLPs
    heads = (2 * hs.q_heads + 2 * hs.kv_heads) * d * graph * shape.layers  # q, out, k, v by heads
    head = 3 * min(logits_rows(logits_chunk, shape.vocab), math.ceil(max(call, 1) / C)) \
        * shape.vocab * 4
    sent = math.ceil(n / C) * (shape.heads + 2 * shape.kv_heads) * d  # one call's q/k/v rows
    got = n * (hs.q_heads + 2 * hs.kv_heads) * d  # ... as this rank's heads
    return {"path_kv": int(2 * store + read + states * _gdn_share(shape, C)),
            "graphs": int((rows + heads) * c), "head": int(head),
            "cp_buffers": int((sent + got) * c)}


def flops(cost, shape: ModelShape, scheme: str, ranks: int, policy: str,
          calls) -> tuple[float, float]:
    """(FLOPs of the most loaded rank, FLOPs of one rank walking the same ``calls`` alone)
    for one step; ``calls``: a :class:`dta.planning.work.Calls`, ``cost`` a FLOP
    :class:`~dta.planning.cost.CostModel` of the same config."""
    C = int(ranks)
    mult = RECOMPUTE_FACTOR if policy == "recompute" else 1.0
    alone = cost.token * calls.tokens + cost.attention * calls.context
    if C == 1:
        return mult * alone, mult * alone
    if check_scheme(scheme) == "split":
        share = HeadSplit.of(shape, C).attention_share(shape)
        rank = cost.token * calls.rows(C) + cost.attention * calls.context * share
    else:
        own = calls.own_pairs()
        rank = cost.token * calls.tokens + cost.attention * (own + (calls.context - own) / C)
    return mult * rank, mult * alone


def exchange(shape: ModelShape, scheme: str, ranks: int, policy: str, calls,
             compute_bytes: int) -> tuple[float, int]:
    """(bytes the most loaded rank sends, collectives it joins) inside its group, one step."""
    C, c, d = int(ranks), compute_bytes, shape.head_dim
    if C == 1:
        return 0.0, 0
    L = shape.attention_layers
    if check_scheme(scheme) == "replicated":
        H, Hkv = shape.heads, shape.kv_heads
        per_layer = (C - 1) * (calls.tokens * H * (2 * d + 1) + calls.rows(C) * 2 * Hkv * d)
        return float(c * L * per_layer), 3 * L * calls.calls
    hs = HeadSplit.of(shape, C)
    passes = 3 if policy == "recompute" else 2
    lse = 1 if hs.row_groups > 1 else 0
    attn = calls.tokens * hs.q_heads * (2 * d + lse) + calls.rows(hs.row_groups) * 2 * hs.kv_heads * d
    gdn = calls.tokens * (shape.gdn_in + shape.gdn_out) * _gdn_share(shape, C)
    sent = passes * (C - 1) / C * c * (L * attn + shape.gdn_layers * gdn)
    return float(sent), passes * 2 * shape.layers * calls.calls

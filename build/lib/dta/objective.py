"""The objective: which loss terms each tree node owns, materialized node by node.

A node covering tree positions [s, e) produces logit rows s..e-1. Row q predicts the token at
position q+1: inside the node that target is shared by every sequence through it; the last
row (the fork row) predicts each child's first token. Every *occurrence* — a (sequence,
target position) pair with a non-zero weight — keeps its own fields and weight; occurrences
sharing a (row, target) pair share one log-prob, gathered per occurrence, so differentiable
indexing sums their gradients (seed 000's loss mapping).

What a walk records: :class:`Recorder` (per-sequence log-probs and entropies) and
:class:`WalkResult` (the walk's loss and counters, re-exported by ``dta.walk``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from dta.batch import Batch
from dta.losses import SequenceLoss, TokenLoss, Totals, sequence_weights, token_weights

if TYPE_CHECKING:
    from dta.planning.packs import PackLayout

_sequence_weights = sequence_weights


@dataclass
class NodeTerms:
    rows: torch.Tensor  # [P] local row of each unique (row, target) pair
    targets: torch.Tensor  # [P] target token of each pair
    occ_pair: torch.Tensor  # [K] pair of each occurrence, sorted
    weight: torch.Tensor  # [K] weight of each occurrence
    fields: dict[str, torch.Tensor]  # [K] each
    occ_pair_np: np.ndarray | None = None  # occ_pair on the host (chunk bounds, no device sync)
    rows_np: np.ndarray | None = None  # rows on the host (a rank's rows: ``within``)
    # for recording log-probs per sequence: pair of each (sequence, position)
    rec_seq: np.ndarray | None = None
    rec_pos: np.ndarray | None = None
    rec_pair: np.ndarray | None = None
    pack_pairs: int | None = None  # pairs of the whole pack (None: these), see ``within``

    @property
    def pairs(self) -> int:
        """(row, target) pairs of the whole pack, whichever rows of it these terms hold."""
        return len(self.rows) if self.pack_pairs is None else self.pack_pairs

    @property
    def empty(self) -> bool:
        """No pair in the whole pack (a context-parallel rank may hold none of a pack's)."""
        return self.pairs == 0

    def within(self, part) -> "NodeTerms":
        """The terms of a pack's rows ``part.lo .. part.hi - 1`` (``dta.model.placement.
        PackPart``: a context-parallel rank's real rows), re-indexed from 0; ``pairs`` still
        counts the whole pack's."""
        if part.whole:
            return self
        rows = self.rows_np if self.rows_np is not None else self.rows.cpu().numpy()
        p0, p1 = (int(x) for x in np.searchsorted(rows, [part.lo, part.hi]))  # rows are sorted
        o0, o1 = (int(x) for x in np.searchsorted(self.occ_pair_np, [p0, p1]))
        out = NodeTerms(self.rows[p0:p1] - part.lo, self.targets[p0:p1],
                        self.occ_pair[o0:o1] - p0, self.weight[o0:o1],
                        {k: v[o0:o1] for k, v in self.fields.items()},
                        occ_pair_np=self.occ_pair_np[o0:o1] - p0,
                        rows_np=rows[p0:p1] - part.lo, pack_pairs=self.pairs)
        if self.rec_pair is not None:
            keep = (self.rec_pair >= p0) & (self.rec_pair < p1)
            out.rec_seq, out.rec_pos = self.rec_seq[keep], self.rec_pos[keep]
            out.rec_pair = self.rec_pair[keep] - p0
        return out

    @staticmethod
    def concat(parts: list[tuple["NodeTerms", int]]) -> "NodeTerms":
        """The terms of several nodes as one, each node's rows shifted by its row offset (its
        place in a pack, or in a batch of head rows); pairs and occurrences stay sorted."""
        whole = sum(t.pairs for t, _ in parts)
        recorded = any(t.rec_pair is not None for t, _ in parts)
        parts = [(t, off) for t, off in parts if len(t.rows)]
        if len(parts) == 1 and parts[0][1] == 0 and parts[0][0].pairs == whole:
            return parts[0][0]
        if not parts:
            none = np.zeros(0, dtype=np.int64)
            out = NodeTerms(*(torch.zeros(0, dtype=torch.long),) * 3, torch.zeros(0), {},
                            occ_pair_np=none, pack_pairs=whole)
            if recorded:
                out.rec_seq = out.rec_pos = out.rec_pair = none
            return out
        pair_off = np.cumsum([0] + [len(t.rows) for t, _ in parts[:-1]])
        t0 = parts[0][0]
        out = NodeTerms(
            torch.cat([t.rows + off for t, off in parts]), torch.cat([t.targets for t, _ in parts]),
            torch.cat([t.occ_pair + int(po) for (t, _), po in zip(parts, pair_off)]),
            torch.cat([t.weight for t, _ in parts]),
            {k: torch.cat([t.fields[k] for t, _ in parts]) for k in t0.fields},
            occ_pair_np=np.concatenate([t.occ_pair_np + po for (t, _), po in zip(parts, pair_off)]),
            pack_pairs=whole)
        if all(t.rows_np is not None for t, _ in parts):
            out.rows_np = np.concatenate([t.rows_np + off for t, off in parts])
        if t0.rec_pair is not None:
            out.rec_seq = np.concatenate([t.rec_seq for t, _ in parts])
            out.rec_pos = np.concatenate([t.rec_pos for t, _ in parts])
            out.rec_pair = np.concatenate([t.rec_pair + po for (t, _), po in zip(parts, pair_off)])
        return out


class Objective:
    """A token loss bound to a batch, its tree and a reduction."""

    def __init__(self, batch: Batch, loss: TokenLoss, reduction: str = "token_mean",
                 totals: Totals | None = None, *, weights: list[np.ndarray] | None = None,
                 fields: dict[str, list[np.ndarray]] | None = None,
                 sequence_weights: np.ndarray | None = None):
        if isinstance(loss, SequenceLoss):
            raise TypeError("a SequenceLoss is trained through Objective.linearized(); "
                            "use dta.train.accumulate_gradients, which does that")
        self.batch, self.loss, self.reduction = batch, loss, reduction
        self.weights = weights if weights is not None else token_weights(batch, reduction, totals)
        self.fields = fields if fields is not None else {k: batch.fields[k] for k in loss.fields}
        # per sequence: the weight of its loss in the reduction (its router aux loss's too:
        # dta/model/router_aux.py); 0 for a sequence without a loss term. Given (``linearize``):
        # taken as is -- an opaque loss's gradient may vanish where its weight does not
        if sequence_weights is None:
            seq_w = _sequence_weights(batch, reduction, totals)
            self.sequence_weights = np.where([self.has_loss(i) for i in range(len(batch))],
                                             seq_w, 0.0)
        else:
            self.sequence_weights = np.asarray(sequence_weights, dtype=np.float64)

    @classmethod
    def record_only(cls, batch: Batch) -> "Objective":
        """No loss terms: only the (row, target) pairs needed to record log-probs."""
        from dta.losses import NLL

        return cls(batch, NLL(), "sum", weights=[np.zeros(len(s)) for s in batch.input_ids])

    def has_loss(self, i: int) -> bool:
        return bool(np.any(self.weights[i]))

    def terms(self, tree, u: int, device, dtype, record: bool = False) -> NodeTerms:
        s, e = int(tree.start[u]), int(tree.end[u])
        seq_ids = tree.through(u)
        cols = {"pos": [], "tgt": [], "w": [], **{f"field:{k}": [] for k in self.fields}}
        rec = {"seq": [], "pos": [], "tgt": []}
        for i in seq_ids:
            seq = self.batch.input_ids[i]
            pos = np.arange(s + 1, min(e + 1, len(seq)))  # target positions this node predicts
            w = self.weights[i][pos]
            nz = pos[w != 0]
            cols["pos"].append(nz), cols["tgt"].append(seq[nz]), cols["w"].append(w[w != 0])
            for k, v in self.fields.items():
                cols[f"field:{k}"].append(v[i][nz])
            if record:
                rec["seq"].append(np.full(len(pos), i)), rec["pos"].append(pos), rec["tgt"].append(seq[pos])
        occ = {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}
        occ["pos"], occ["tgt"] = occ["pos"].astype(np.int64), occ["tgt"].astype(np.int64)
        # pairs: those the occurrences need, or (recording) every target through the node
        all_pos = np.concatenate(rec["pos"]) if record else occ["pos"]
        all_tgt = np.concatenate(rec["tgt"]).astype(np.int64) if record else occ["tgt"]
        # unique (row, target) pairs, row = local index of the predicting position
        width = int(all_tgt.max(initial=0)) + 1
        uniq, inverse = np.unique((all_pos - 1 - s) * width + all_tgt, return_inverse=True)
        rows, targets = uniq // width, uniq % width
        occ_pair = np.searchsorted(uniq, (occ["pos"] - 1 - s) * width + occ["tgt"])
        by_pair = np.argsort(occ_pair, kind="stable")  # a chunk of pairs: a slice of occurrences
        occ_pair = occ_pair[by_pair]

        def tensor(x, **kw):
            return torch.as_tensor(x, device=device, **kw)

        fields = {k: tensor(occ[f"field:{k}"][by_pair], dtype=dtype) for k in self.fields}
        t = NodeTerms(tensor(rows), tensor(targets), tensor(occ_pair),
                      tensor(occ["w"][by_pair], dtype=dtype), fields, occ_pair_np=occ_pair,
                      rows_np=rows)
        if record:
            t.rec_seq = np.concatenate(rec["seq"]).astype(np.int64)
            t.rec_pos, t.rec_pair = all_pos, inverse.reshape(-1)
        return t

    def node_loss(self, terms: NodeTerms, occ: slice, first_pair: int, pair_logp: torch.Tensor,
                  pair_entropy: torch.Tensor | None) -> torch.Tensor:
        """Sum over the occurrences `occ` (those of pairs first_pair, first_pair + 1, ...) of
        weight * loss(own log-prob, own entropy, own fields)."""
        idx = terms.occ_pair[occ] - first_pair
        logp = pair_logp[idx]
        ent = pair_entropy[idx] if self.loss.uses_entropy else None
        fields = {k: v[occ] for k, v in terms.fields.items()}
        return (terms.weight[occ] * self.loss.values(logp, ent, fields)).sum()

    def sequence_loss(self, i: int, logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """Sequence i's loss from its full per-token log-probs (the unpacked reference)."""
        w = torch.as_tensor(self.weights[i], device=logp.device, dtype=logp.dtype)
        fields = {k: torch.as_tensor(v[i], device=logp.device, dtype=logp.dtype)
                  for k, v in self.fields.items()}
        nz = w != 0
        ent = entropy[nz] if self.loss.uses_entropy else None
        return (w[nz] * self.loss.values(logp[nz], ent, {k: f[nz] for k, f in fields.items()})).sum()


class Linear(TokenLoss):
    """loss = g * logp + h * entropy: the first-order surrogate of an opaque sequence loss."""

    fields = ("dlogp", "dentropy")

    def __init__(self, uses_entropy: bool):
        self.uses_entropy = uses_entropy

    def values(self, logp, entropy, fields):
        out = fields["dlogp"] * logp
        return out + fields["dentropy"] * entropy if self.uses_entropy else out


def _sequence_fields(batch: Batch, loss: SequenceLoss, i: int, like: torch.Tensor,
                     outputs: dict | None) -> dict:
    """Sequence i's fields as tensors, and the walk's per-sequence ``outputs`` beside them."""
    fields = {k: torch.as_tensor(batch.fields[k][i], dtype=like.dtype, device=like.device)
              for k in loss.fields}
    for k, per_sequence in (outputs or {}).items():
        fields[k] = per_sequence[i]
    return fields


def evaluate(batch: Batch, loss: TokenLoss | SequenceLoss, reduction: str, logprobs,
             entropies, totals: Totals | None = None, *, outputs: dict | None = None) -> float:
    """The loss's value at the given per-sequence log-probs (no gradient): an opaque loss
    once per sequence (``outputs``: as :func:`linearize`), a token loss term by term."""
    coef = sequence_weights(batch, reduction, totals)
    if not isinstance(loss, SequenceLoss):
        objective = Objective(batch, loss, reduction, totals)
        return float(sum(float(objective.sequence_loss(i, logprobs[i], entropies[i]))
                         for i in range(len(batch))))
    total = 0.0
    for i in range(len(batch)):
        fields = _sequence_fields(batch, loss, i, logprobs[i], outputs)
        total += float(loss.fn(logprobs[i], entropies[i], fields) * float(coef[i]))
    return total


def linearize(batch: Batch, loss: SequenceLoss, reduction: str, logprobs, entropies,
              totals: Totals | None = None, *, outputs: dict | None = None
              ) -> tuple[Objective, float]:
    """Evaluate the opaque per-sequence losses at the given log-probs and return a token
    objective with the same gradient (chain rule: dL/dθ = Σ_j dL/dlogp_j · dlogp_j/dθ),
    plus the loss value. Exact, at the price of one extra forward-only walk. ``outputs``:
    more of the walk's per-sequence results (name -> one tensor per sequence, e.g. the
    logits' ``vocab_min`` / ``vocab_max``), handed to the loss among its fields."""
    coef = sequence_weights(batch, reduction, totals)
    g_all, h_all, total = [], [], 0.0
    for i in range(len(batch)):
        lp = logprobs[i].detach().clone().requires_grad_()
        en = entropies[i].detach().clone().requires_grad_()
        fields = _sequence_fields(batch, loss, i, lp, outputs)
        value = loss.fn(lp, en, fields) * float(coef[i])
        if coef[i] != 0 and value.requires_grad:
            g, h = torch.autograd.grad(value, [lp, en], allow_unused=True)
        else:
            g = h = None
        total += float(value.detach())
        n = len(batch.input_ids[i])
        g = np.zeros(n) if g is None else g.detach().cpu().double().numpy()
        h = np.zeros(n) if h is None else h.detach().cpu().double().numpy()
        g[0] = h[0] = 0.0  # token 0 is never predicted
        g_all.append(g)
        h_all.append(h)
    uses_entropy = any(np.any(h) for h in h_all)
    weights = [((g != 0) | (h != 0)).astype(np.float64) for g, h in zip(g_all, h_all)]
    obj = Objective(batch, Linear(uses_entropy), "sum", weights=weights,
                    fields={"dlogp": g_all, "dentropy": h_all},
                    sequence_weights=opaque_sequence_weights(batch, reduction, totals))
    return obj, total


def opaque_sequence_weights(batch: Batch, reduction: str,
                            totals: Totals | None = None) -> np.ndarray:
    """Per sequence, the weight of its router aux loss (docs/moe.md) next to an opaque loss:
    the reduction's weight of a sequence with a trained token (``loss_mask``), else 0 --
    whatever gradient the opaque loss happens to have."""
    has_target = np.array([bool(batch.loss_mask(i).any()) for i in range(len(batch))])
    return np.where(has_target, sequence_weights(batch, reduction, totals), 0.0)


class Recorder:
    """Scatters a walk's per-pair results (log-probs, entropies, ...) into per-sequence,
    per-token arrays, through the terms' record indices."""

    def __init__(self, tree, device, dtype, minmax: bool = False):
        self.lengths = tree.lengths
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        n = int(self.lengths.sum())
        self.buffers = [torch.zeros(n, device=device, dtype=torch.float64 if dtype == torch.float64
                                    else torch.float32) for _ in range(4 if minmax else 2)]

    def add(self, terms: NodeTerms, *per_pair):
        idx = torch.as_tensor(self.offsets[terms.rec_seq] + terms.rec_pos, device=self.buffers[0].device)
        pair = torch.as_tensor(terms.rec_pair, device=self.buffers[0].device)
        for buf, values in zip(self.buffers, per_pair):
            buf[idx] = values.detach()[pair].to(buf.dtype)

    def split(self, combine=None):
        """Per sequence, per buffer; ``combine``: sums the buffers over the processes that
        recorded parts of them (a context-parallel group: each position written by one)."""
        if combine is not None:
            combine(self.buffers)
        sizes = [int(n) for n in self.lengths]
        return [list(torch.split(buf, sizes)) for buf in self.buffers]


@dataclass
class WalkResult:
    """What a walk returns, and its recorder: the walk counts into it as it goes."""
    loss: float = 0.0  # the router's aux loss included (``aux_loss``)
    aux_loss: float = 0.0  # the router's load-balancing loss, coef and weights applied
    nodes: int = 0  # nodes forwarded (first time)
    tokens: int = 0  # tokens forwarded (first time)
    recomputed_tokens: int = 0  # tokens forwarded again at pop (recompute policy)
    max_live_graphs: int = 0  # most pack graphs alive at once
    max_graph_tokens: int = 0  # most tokens whose graphs are alive at once
    max_call_tokens: int = 0  # longest decoder call (recompute: pops included)
    max_path: int = 0  # deepest stack of K/V frames
    packs: int = 0
    masked_packs: int = 0  # packs with branches (forwarded with a tree mask)
    forward_calls: int = 0  # decoder calls (recompute: pops included)
    backward_calls: int = 0  # autograd.backward calls
    head_calls: int = 0  # LM-head evaluations (flushes)
    plan: dict = field(default_factory=dict)
    logprobs: list | None = None  # per sequence [n] (index j predicts token j; 0 at j=0)
    entropy: list | None = None
    vocab_min: list | None = None
    vocab_max: list | None = None

    def calls(self) -> dict:
        return dict(packs=self.packs, masked_packs=self.masked_packs, nodes=self.nodes,
                    forward_calls=self.forward_calls, backward_calls=self.backward_calls,
                    head_calls=self.head_calls)

    def pushed(self, nodes: int, layout: PackLayout, alive: list[int] | None = None) -> None:
        """A pack's first forward; ``alive``: the tokens of the other graphs alive with it."""
        self.packs += 1
        self.masked_packs += not layout.chain
        self.nodes += nodes
        self.tokens += layout.tokens
        self.forward_calls += 1
        self.max_call_tokens = max(self.max_call_tokens, layout.tokens)
        if alive is not None:
            self.graphs_alive(len(alive) + 1, layout.tokens + sum(alive))

    def reforwarded(self, tokens: int) -> None:
        """A pack forwarded again at its pop (recompute): its graph alone is alive."""
        self.recomputed_tokens += tokens
        self.forward_calls += 1
        self.graphs_alive(1, tokens)

    def graphs_alive(self, graphs: int, tokens: int) -> None:
        self.max_live_graphs = max(self.max_live_graphs, graphs)
        self.max_graph_tokens = max(self.max_graph_tokens, tokens)

    def depth(self, frames: int) -> None:
        self.max_path = max(self.max_path, frames)

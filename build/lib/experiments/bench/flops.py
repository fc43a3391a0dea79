"""FLOPs each benchmark mode executes on a batch, and the ideal speed-up of the tree.

Coefficients (per token of the decoder body, per attention (query, key) pair, forward +
backward = 3 x forward) come from :class:`dta.planning.cost.CostModel.from_config` with the
vocabulary set to 0 (its LM-head term is per token, but every mode here runs the head only on
rows that carry a loss term); a fallback formula is used when ``dta.planning`` is absent.
The LM head costs 3 x 2·H·V per (row, target) pair it evaluates (forward, and a backward of
twice the forward: ∂h and ∂W), plus one more forward where it is checkpointed: the baselines
checkpoint it when the rows of one forward span several ``logits_chunk`` chunks; the DFS
walker (dta.model.head) computes the logits once and differentiates them by hand.

Attention pairs are counted as a dense kernel executes them: a causal row without a mask
(one unpadded sequence) computes its causal half, an explicit mask (padding, a tree mask)
computes the full square. The DFS walk's node of positions [a, b) attends to its b ancestors'
and own keys: Σ_{p=a}^{b-1} (p + 1) pairs; a pack of T tokens over a P-token prefix computes
T·P + T(T+1)/2 pairs when it is one path, T·(P + T) when it has branches (dense mask).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dta.batch import Batch
from dta.tree import PrefixTree
from experiments.bench import modes as M


@dataclass(frozen=True)
class Flops:
    """A mode's FLOPs by kind of work: the decoder body's matrix products (per token), its
    attention (per (query, key) pair) and the LM head (per evaluated row)."""

    body: float = 0.0
    attention: float = 0.0
    head: float = 0.0

    @property
    def total(self) -> float:
        return self.body + self.attention + self.head

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(self.body + other.body, self.attention + other.attention, self.head + other.head)


@dataclass(frozen=True)
class Coefs:
    token: float  # decoder body, forward + backward, per token
    attention: float  # forward + backward, per (query, key) pair
    head: float  # LM head, per evaluated (row, target) pair: forward + backward
    source: str

    @property
    def head_forward(self) -> float:
        return self.head / 3

    def head_rows(self, rows: int, chunk: int) -> float:
        """Head FLOPs of one forward over ``rows`` pairs (checkpointed above one chunk)."""
        return rows * (self.head + (self.head_forward if rows > chunk else 0.0))


def coefficients(config) -> Coefs:
    hidden, vocab = int(config.hidden_size), int(config.vocab_size)
    try:
        from dta.planning.cost import CostModel

        body = {**config.to_dict(), "vocab_size": 0}
        cm = CostModel.from_config(body)
        return Coefs(cm.token, cm.attention, 3 * 2 * hidden * vocab, "dta.planning.cost")
    except ImportError:
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        hd = getattr(config, "head_dim", None) or hidden // heads
        params = config.num_hidden_layers * (hidden * hd * (2 * heads + 2 * kv)
                                             + 3 * hidden * config.intermediate_size)
        return Coefs(3 * 2 * params, 3 * 4 * config.num_hidden_layers * heads * hd,
                     3 * 2 * hidden * vocab, "experiments.bench.flops")


def _trainable(batch: Batch) -> list[np.ndarray]:
    return [batch.loss_mask(i) != 0 for i in range(len(batch))]


def _active(batch: Batch) -> list[int]:
    return [i for i, m in enumerate(_trainable(batch)) if m.any()]


def _lcp(a, b) -> int:
    m = min(len(a), len(b))
    d = np.flatnonzero(a[:m] != b[:m])
    return int(d[0]) if len(d) else m


def tree_head_pairs(batch: Batch, ids: list[int]) -> int:
    """Distinct (row, target) pairs with a loss term = trainable prefix-trie tokens (each
    counted in the first sequence, in sorted order, that adds it to the trie)."""
    masks, seqs = _trainable(batch), [batch.input_ids[i] for i in ids]
    order = PrefixTree(seqs).order if len(seqs) > 1 else np.arange(len(seqs))
    n, prev = 0, None
    for k in order:
        i = ids[k]
        lcp = 0 if prev is None else _lcp(prev, batch.input_ids[i])
        n += int(masks[i][lcp:].sum())
        prev = batch.input_ids[i]
    return n


def _chunk(opts) -> int:
    return int(opts.get("logits_chunk") or 1024)


def _padded_flops(batch: Batch, groups, c: Coefs, chunk: int) -> Flops:
    masks, total = _trainable(batch), Flops()
    for g in groups:
        g = [i for i in g if masks[i].any()]
        if not g:
            continue
        lens = [len(batch.input_ids[i]) for i in g]
        S = max(lens)
        pairs = S * (S + 1) / 2 if min(lens) == S else S * S  # no padding: no mask, causal
        total += Flops(len(g) * c.token * S, len(g) * c.attention * pairs,
                       c.head_rows(sum(int(masks[i].sum()) for i in g), chunk))
    return total


def padded_flops(batch, c, opts):
    n, size = len(batch), int(opts.get("pad_batch") or len(batch))
    return _padded_flops(batch, [range(a, min(a + size, n)) for a in range(0, n, size)], c,
                         _chunk(opts))


def microbatch_flops(batch, c, opts):
    return _padded_flops(batch, M.microbatches(batch.lengths, opts.get("microbatch_tokens")), c,
                         _chunk(opts))


def treemask_flops(batch, c, opts):
    active, total = _active(batch), Flops()
    budget = int(opts.get("tree_tokens") or M.DEFAULT_TREE_TOKENS)
    for pack in M.tree_packs([batch.input_ids[i] for i in active], budget):
        ids = [active[k] for k in pack]
        T = PrefixTree([batch.input_ids[i] for i in ids]).stats().unique_tokens
        total += Flops(c.token * T, c.attention * T * T,
                       c.head_rows(tree_head_pairs(batch, ids), _chunk(opts)))
    return total


def _dfs_parts(batch: Batch) -> dict:
    """Unique tokens and attention pairs of the active tree, split by internal/leaf nodes."""
    active = _active(batch)
    tree = PrefixTree([batch.input_ids[i] for i in active])
    a, b = tree.start[1:].astype(float), tree.end[1:].astype(float)
    internal = np.array([bool(tree.children[u]) for u in range(1, len(tree))])
    tokens, pairs = b - a, (b * (b + 1) - a * (a + 1)) / 2
    masks = _trainable(batch)
    # head pairs of internal nodes: trainable tokens predicted from their rows (approximate:
    # the trainable trie tokens whose predicting row lies in an internal node)
    return dict(tokens=tokens.sum(), pairs=pairs.sum(), in_tokens=tokens[internal].sum(),
                in_pairs=pairs[internal].sum(), head=tree_head_pairs(batch, active),
                trainable=sum(int(m.sum()) for m in masks))


def dfs_node_flops(batch, c, opts):
    """The walk node by node: every unique token once, each attending to its root path."""
    p = _dfs_parts(batch)
    return Flops(c.token * p["tokens"], c.attention * p["pairs"], c.head * p["head"])


def _pack_plan(batch: Batch, c: Coefs, opts, policy: str = "retain"):
    """The pack plan the walker makes (same tree, active nodes, cost model and cap)."""
    from dta.options import WalkOptions
    from dta.planning.packs import DEFAULT_CALL_TOKENS, PackCost, default_cap, plan_packs

    tree = PrefixTree(batch.input_ids)
    active = np.zeros(len(tree), bool)
    leaf = tree.leaf_of()
    for i in _active(batch):
        active[leaf[i]] = True
    for u in range(len(tree) - 1, 0, -1):
        if active[u]:
            active[tree.parent[u]] = True
    active[0] = False
    cost = PackCost(c.token, c.attention, DEFAULT_CALL_TOKENS * c.token)
    walk = WalkOptions()  # the walker's defaults
    cap = opts.get("pack_tokens") or min(default_cap(tree, policy), walk.block_tokens)
    return plan_packs(tree, opts.get("packing") or walk.packing, cap=int(cap),
                      cost=cost, active=active)


def _packed_flops(batch, c, opts, recompute: bool):
    """Packs: a pack with branches runs a dense masked kernel (T x (P + T) pairs), a single
    path the causal part only; recompute adds a no-grad forward of every open pack."""
    plan = _pack_plan(batch, c, opts, "recompute" if recompute else "retain")
    p = _dfs_parts(batch)
    total = Flops(head=c.head * p["head"])
    for pk in plan.packs:
        T, P = float(pk.tokens), float(pk.prefix)
        pairs = T * P + T * (T + 1) / 2 if pk.chain else T * (P + T)
        again = 4 / 3 if recompute and pk.children else 1.0
        total += Flops(again * c.token * T, again * c.attention * pairs)
    return total


def dfs_retain_flops(batch, c, opts):
    return _packed_flops(batch, c, opts, False)


def dfs_recompute_flops(batch, c, opts):
    """Retain + a no-grad forward (1/3 of training) of every open pack at push."""
    return _packed_flops(batch, c, opts, True)


MODE_FLOPS: dict[str, Callable[[Batch, Coefs, dict], Flops]] = {
    "padded": padded_flops, "microbatch": microbatch_flops, "treemask": treemask_flops,
    "treemask-flex": treemask_flops, "dfs-node": dfs_node_flops, "dfs-retain": dfs_retain_flops,
    "dfs-recompute": dfs_recompute_flops,
}


def mode_flop_parts(mode: str, batch: Batch, config, opts: dict | None = None) -> Flops | None:
    fn = MODE_FLOPS.get(mode)
    return None if fn is None else fn(batch, coefficients(config), opts or {})


def mode_flops(mode: str, batch: Batch, config, opts: dict | None = None) -> float | None:
    parts = mode_flop_parts(mode, batch, config, opts)
    return None if parts is None else float(parts.total)


def summary(batch: Batch, config, modes, opts: dict | None = None) -> dict:
    """FLOPs per mode, the ideal speed-up of the tree over the best unpacked baseline
    (``FLOPs(min over padded, microbatch) / FLOPs(dfs-node)``: every unique token once, no
    masked-away pairs), and for reference the planning cost model's own ideal speed-up (its
    LM head runs on every token)."""
    opts = opts or {}
    names = list(dict.fromkeys([*modes, "padded", "microbatch", "dfs-node"]))
    fl = {m: mode_flops(m, batch, config, opts) for m in names}
    base = min(fl["padded"], fl["microbatch"])
    out = dict(flops={m: fl[m] for m in modes}, flops_source=coefficients(config).source,
               ideal_speedup=base / fl["dfs-node"], ideal_flops=fl["dfs-node"],
               ideal_baseline="padded" if fl["padded"] < fl["microbatch"] else "microbatch")
    try:
        from dta.planning.cost import CostModel, ideal_speedup

        tree = PrefixTree([batch.input_ids[i] for i in _active(batch)])
        out["ideal_speedup_cost_model"] = float(ideal_speedup(tree, CostModel.from_config(config)))
    except ImportError:
        pass
    return out

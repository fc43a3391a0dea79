"""Cost model of a set of sequences trained together as one prefix tree.

A leaf set S (a set of sequences) is trained once per unique token of the union of its root
paths. Its cost has two terms:

* linear work (projections, MLP, LM head), proportional to the unique tokens U(S);
* attention work, proportional to A(S) = Σ over those unique tokens of their context length
  (tree position + 1): a token at tree position p attends to its p ancestors and itself.

``cost(S) = token * U(S) + attention * A(S) + fixed``. The coefficients come from a model
config (analytic FLOPs, :meth:`CostModel.from_config`) or from measured step times
(:meth:`CostModel.calibrate`, non-negative least squares).

FLOPs per token, forward + backward = 3 x forward:
    linear    3 * (2 * non-embedding params + 2 * hidden * vocab)     [LM head included]
    attention 3 * 4 * layers * (heads * head_dim) per context token   [QK^T and AV]

Hybrid models (Qwen3.5, Qwen3-Next: ``layer_types`` with ``linear_attention``): only the
full-attention layers have attention pairs; a Gated DeltaNet layer is linear in tokens — its
projections and conv are parameters, and its chunked delta rule (chunk C = 64, per value head
of dims d_k, d_v) adds 4·C·d_k + C·(d_k + d_v) + 2·C·d_v + 6·d_k·d_v forward FLOPs per token
(intra-chunk QKᵀ and KKᵀ, the two triangular solves, the intra-chunk read, the state
read/write). Their gated attention's q projection is twice as wide (the output gate). MoE
layers count the experts a token activates (``num_experts_per_tok`` × ``moe_intermediate_size``)
plus the shared expert.

Because positions are tree positions, the attention work of a node spanning positions
[a, b) is Σ_{p=a}^{b-1} (p + 1) = (b(b+1) - a(a+1)) / 2, and a root path of p tokens costs
``token * p + attention * p(p+1)/2`` (:meth:`CostModel.prefix_cost`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from dta.planning.index import PlanningError, TreeIndex
from dta.planning.shapes import gdn_layer, mlp_active_params, text_config
from dta.tree import PrefixTree


def _get(config: Any, *names: str, default=None):
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise PlanningError(f"model config has none of {names}")
    return default


def _index(tree) -> TreeIndex:
    return tree if isinstance(tree, TreeIndex) else TreeIndex(tree)


def node_attention(index: TreeIndex) -> np.ndarray:
    """Per node: Σ over its tokens of (tree position + 1)."""
    a, b = index.start, index.end
    return (b * (b + 1) - a * (a + 1)) // 2


@dataclass(frozen=True)
class CostModel:
    """``cost = token * unique_tokens + attention * Σ context + fixed`` (see module doc)."""

    token: float = 1.0  # per unique token
    attention: float = 0.0  # per unit of attention context
    fixed: float = 0.0  # per tree (a bin, a worker's step)
    unit: str = "token"  # "flop" from a config, "s" after calibration
    name: str = "tokens"

    # --------------------------------------------------------------- constructors --
    @classmethod
    def tokens_only(cls) -> "CostModel":
        """Cost = unique tokens (what fixed-budget packing counts)."""
        return cls()

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> "CostModel":
        """Analytic FLOPs from a Hugging Face config (object or dict; a multimodal config's
        ``text_config``). MoE layers count the experts a token uses
        (:func:`dta.planning.shapes.mlp_active_params`)."""
        config = text_config(config)
        hidden = int(_get(config, "hidden_size", "n_embd", "d_model"))
        layers = int(_get(config, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_get(config, "num_attention_heads", "n_head"))
        kv_heads = int(_get(config, "num_key_value_heads", default=heads))
        head_dim = int(_get(config, "head_dim", default=hidden // heads))
        vocab = int(_get(config, "vocab_size"))
        inter = int(_get(config, "intermediate_size", "n_inner", default=4 * hidden))
        act = str(_get(config, "hidden_act", "activation_function", default="silu"))
        mlp_mats = 3 if act in ("silu", "swiglu", "swish") else 2  # gated MLPs: up/gate/down
        types = list(_get(config, "layer_types", default=["full_attention"] * layers))
        gdn_layers = sum(t == "linear_attention" for t in types)
        attn_layers = layers - gdn_layers
        q_width = 2 if gdn_layers else 1  # Qwen3.5 / Qwen3-Next: q_proj also yields the gate
        attn_params = hidden * head_dim * ((1 + q_width) * heads + 2 * kv_heads)  # q(+gate), o, k, v
        params = attn_layers * attn_params + mlp_active_params(config, layers, hidden, inter,
                                                               mlp_mats)
        gdn_flops = 0.0
        if gdn_layers:
            gdn_params, gdn_flops = _gdn_layer(config, hidden)
            params += gdn_layers * gdn_params
            gdn_flops *= gdn_layers
        token = 3.0 * (2 * params + gdn_flops + 2 * hidden * vocab)
        attention = 3.0 * 4 * attn_layers * heads * head_dim
        label = name or str(_get(config, "name_or_path", "_name_or_path", "model_type",
                                 default="config"))
        return cls(token, attention, 0.0, "flop", label)

    @classmethod
    def calibrate(cls, samples: Iterable[Sequence], name: str = "calibrated") -> "CostModel":
        """Fit the three coefficients to measured times by non-negative least squares.

        Each sample is ``(tree, sequence_ids, seconds)`` or ``(unique_tokens, attention,
        seconds)``. With three unknowns, NNLS is solved exactly by trying every subset of
        free coefficients (the others held at 0) and keeping the best feasible fit.
        """
        rows, times = [], []
        for sample in samples:
            if len(sample) != 3:
                raise PlanningError("a calibration sample is (tree, ids, seconds) or "
                                    "(unique_tokens, attention, seconds)")
            a, b, t = sample
            u, att = features(a, b) if isinstance(a, (PrefixTree, TreeIndex)) else (a, b)
            rows.append((float(u), float(att), 1.0))
            times.append(float(t))
        if not rows:
            raise PlanningError("calibrate: no samples")
        X, y = np.asarray(rows), np.asarray(times)
        scale = np.maximum(np.abs(X).max(axis=0), 1e-30)  # condition the columns
        best, best_err = np.zeros(3), float(np.sum(y * y))
        for k in (1, 2, 3):
            for cols in itertools.combinations(range(3), k):
                cols = list(cols)
                coef, *_ = np.linalg.lstsq(X[:, cols] / scale[cols], y, rcond=None)
                if np.any(coef < 0):
                    continue
                full = np.zeros(3)
                full[cols] = coef / scale[cols]
                err = float(np.sum((X @ full - y) ** 2))
                if err < best_err - 1e-18 * max(best_err, 1.0):
                    best, best_err = full, err
        return cls(float(best[0]), float(best[1]), float(best[2]), "s", name)

    # ------------------------------------------------------------------ evaluation --
    def prefix_cost(self, p):
        """Cost of a root path of p tokens (positions 0..p-1), without ``fixed``."""
        p = np.asarray(p, dtype=np.float64)
        return self.token * p + self.attention * p * (p + 1) / 2

    def node_costs(self, index: TreeIndex) -> np.ndarray:
        """Per node: token * length + attention * Σ (position + 1)."""
        return self.token * index.seg + self.attention * node_attention(index).astype(float)

    def cost(self, tree, sequence_ids) -> float:
        """Cost of training ``sequence_ids`` together as one tree (0 for an empty set)."""
        if len(sequence_ids) == 0:
            return 0.0
        u, a = features(tree, sequence_ids)
        return self.token * u + self.attention * a + self.fixed

    def __call__(self, tree, sequence_ids) -> float:
        return self.cost(tree, sequence_ids)


GDN_CHUNK = 64  # transformers' / flash-linear-attention's delta-rule chunk


def _gdn_layer(config: Any, hidden: int) -> tuple[int, float]:
    """(parameters, per-token forward FLOPs of the delta rule) of one Gated DeltaNet layer."""
    g = gdn_layer(config, hidden)
    c, dk, dv = GDN_CHUNK, g["dk"], g["dv"]
    rule = g["heads"] * (4 * c * dk + c * (dk + dv) + 2 * c * dv + 6 * dk * dv)
    return g["params"], float(rule)


def features(tree, sequence_ids) -> tuple[int, int]:
    """(unique tokens, attention context sum) of the union of the sequences' root paths."""
    ix = _index(tree)
    ids = np.asarray(sequence_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return 0, 0
    if ids.min() < 0 or ids.max() >= ix.n_seq:
        raise PlanningError(f"sequence ids must be in [0, {ix.n_seq})")
    mask = ix.union_mask(ids)
    return int(ix.seg[mask].sum()), int(node_attention(ix)[mask].sum())


def flops(tree, model: CostModel) -> float:
    """Work of training the whole tree once (shared prefixes counted once)."""
    ix = _index(tree)
    return float(model.token * ix.unique_tokens + model.attention * node_attention(ix).sum())


def flops_unpacked(sequences, model: CostModel) -> float:
    """Work of training every sequence on its own (sequences, or their lengths)."""
    if isinstance(sequences, (PrefixTree, TreeIndex)):
        lengths = np.asarray(sequences.lengths, dtype=np.float64)
    else:
        lengths = np.asarray([x if np.isscalar(x) else len(x) for x in sequences], dtype=float)
    return float(np.sum(model.token * lengths + model.attention * lengths * (lengths + 1) / 2))


def ideal_speedup(tree, model: CostModel | None = None) -> float:
    """flops_unpacked / flops: the speedup of perfect prefix sharing under ``model``."""
    model = model or CostModel.tokens_only()
    ix = _index(tree)
    return flops_unpacked(ix, model) / flops(ix, model)

"""Recurrent (Gated DeltaNet) layers in the walk: a node's final states are what it hands on.

Hybrid models (Qwen3.5 dense and MoE, Qwen3-Next) interleave linear-attention layers
(``layer_types == "linear_attention"``, a Gated DeltaNet: a causal depthwise conv and a gated
delta-rule recurrence) with full-attention layers. A GDN layer has no mask and no per-token
K/V: it threads two running states token by token, a causal-conv state (the last
``conv_kernel`` projected inputs) and a recurrent state ``[heads, d_k, d_v]``. For the walk
they play the part K/V play for attention:

- a root node starts from zero state (HF's prefill);
- a node starts from its parent's *final* states, held as detached autograd leaves;
- the node's own final states are its output to its children; at pop they are
  backpropagated with the gradients the children left in the leaves.

Only the parent's states are needed (not the whole path's, as for K/V), and a node's states
do not grow with its length.

Transformers' GDN forward already continues a multi-token chunk from cached states (pure
torch on CPU; flash-linear-attention / causal-conv1d kernels where installed). Its cache
layer, ``LinearAttentionLayer``, updates the states *in place* (``copy_``) — which breaks
autograd when a state is a leaf or was saved for backward. ``dta.model.hf_cache`` (the one
module that knows transformers' cache classes) has that layer with functional updates
(``ForkedStateLayer``) and the pack's carrier layer (``PackStateLayer``).
"""
from __future__ import annotations

import numpy as np
import torch

GDN = "linear_attention"  # HF's layer type of a Gated DeltaNet layer
ATTENTION = "full_attention"
RECURRENT = "recurrent"  # the walker's layer kind: state (conv, recurrent), continued from the parent
KINDS = {ATTENTION: "attention", GDN: RECURRENT}


def layer_types(config) -> list[str]:
    """The decoder's per-layer HF types (``full_attention`` when the config has none)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    return list(types) if types is not None else [ATTENTION] * int(config.num_hidden_layers)


def is_hybrid(model_or_config) -> bool:
    """Whether the model has recurrent (GDN) layers whose state the walk must fork."""
    return GDN in layer_types(getattr(model_or_config, "config", model_or_config))


def layer_kinds(config) -> list[str]:
    """The walker's kind per layer of a hybrid model ("attention" | "recurrent"). Any other
    layer type next to GDN layers (sliding windows, ...) is refused: one clear line."""
    types = layer_types(config)
    bad = sorted({t for t in types if t not in KINDS})
    if bad:
        raise ValueError(f"{type(config).__name__}: hybrid model with layer types {bad}; the walk "
                         f"forks only {ATTENTION!r} K/V and {GDN!r} (Gated DeltaNet) states")
    if ATTENTION not in types:  # HF's hybrid cache reads positions from an attention layer
        raise ValueError(f"{type(config).__name__}: every layer is {GDN!r}; the walk needs at "
                         f"least one {ATTENTION!r} layer (as Qwen3.5 and Qwen3-Next have)")
    return [KINDS[t] for t in types]


def path_state(states: list[tuple]) -> tuple:
    """A GDN layer's cache data for a node: its parent's final (conv, recurrent) state — the
    last node of the path (a recurrence needs no older state)."""
    return states[-1]


def node_state(layer, start: int, end: int, where: str) -> tuple:
    """A GDN layer's state after a node's forward: its final (conv, recurrent) state; after a
    pack's forward (``dta/model/gdn.py``), the final states of its handed-on nodes, stacked
    ([n, conv_dim, kernel], [n, heads, d_k, d_v], in the order of ``gdn.open_nodes``)."""
    if hasattr(layer, "plan"):  # a pack's layer
        if layer.final is None:
            raise RuntimeError(f"{where}: the GDN layer was not run over the pack")
        return layer.final
    from dta.model.hf_cache import gdn_state

    return gdn_state(layer, where)


def state_through(state: tuple, layout, local: int, rows=None) -> tuple:
    """What a pack hanging below local node ``local`` of a pack reads from its GDN state: that
    node's final (conv, recurrent) state, [1, ...] views (reusable)."""
    from dta.model.gdn import open_nodes

    hands_on = open_nodes(layout)
    j = np.flatnonzero(hands_on == local)
    if len(j) != 1:
        raise RuntimeError(f"local node {local} of the pack hands no GDN state on (open: "
                           f"{hands_on.tolist()})")
    j = int(j[0])
    return tuple(x[j:j + 1] for x in state), True


def gdn_modules(model) -> list:
    """The model's Gated DeltaNet modules (one per ``linear_attention`` layer), checked to be
    ones the pack path knows (``dta.model.gdn.supports``): anything else is refused, one line."""
    from dta.model import gdn

    kinds, types = layer_kinds(model.config), layer_types(model.config)

    def is_gdn(m) -> bool:  # its own layer_type (5.13+), or its layer's (before: layer_idx)
        kind = getattr(m, "layer_type", None)
        if kind is None and isinstance(getattr(m, "layer_idx", None), int) \
                and 0 <= m.layer_idx < len(types):
            kind = types[m.layer_idx]
        return kind == GDN and hasattr(m, "A_log")

    mods = [m for m in model.modules() if is_gdn(m)]
    if len(mods) != kinds.count(RECURRENT):
        raise ValueError(f"{type(model).__name__}: found {len(mods)} Gated DeltaNet modules for "
                         f"{kinds.count(RECURRENT)} {GDN!r} layers")
    for m in mods:
        why = gdn.supports(m)
        if why:
            raise ValueError(f"{type(model).__name__}: the walker's pack path cannot run its GDN "
                             f"layer: {why}")
    return mods


def packed(modules: list):
    from dta.model.gdn import packed_gdn

    return packed_gdn(modules)


def pack_plan(layout, module, chunk: int | None = None):
    """The integer GDN plan of a pack (``dta.model.gdn.plan_recurrence``), for ``module``'s conv kernel."""
    from dta.model import gdn

    return gdn.plan_recurrence(layout, int(module.conv_kernel_size), chunk or gdn.CHUNK)


def pack_layer(initial: tuple | None, plan, positions: int = 0):
    from dta.model.hf_cache import PackStateLayer

    return PackStateLayer(initial, plan, positions)


def build_cache(kinds: list[str], data: list | None, positions: int = 0):
    """A fresh per-node cache for a hybrid model (``dta.model.hf_cache.hybrid_cache``):
    ``data[i]`` is the path's K/V (attention) or the parent's final (conv, recurrent) state
    (recurrent); ``data=None`` for a root; ``positions``: the path's length. A forward
    mutates its cache: build one per node."""
    from dta.model import hf_cache

    return hf_cache.hybrid_cache(kinds, data, positions, RECURRENT)


def gdn_config_defaults(kw: dict) -> dict:
    """Gated DeltaNet sizes for a generic size (``dta.model.models.SIZES``): key heads = K/V heads,
    value heads = attention heads, head dims = the attention head dim; a full-attention layer
    every 4 layers (Qwen3.5's and Qwen3-Next's 3:1 pattern) from 4 layers up, every 2 below
    (so a 2-layer test model has one layer of each kind)."""
    heads = int(kw.get("num_attention_heads", 4))
    head_dim = int(kw.get("head_dim") or int(kw.get("hidden_size", 64)) // heads)
    out = dict(linear_num_key_heads=int(kw.get("num_key_value_heads", heads)),
               linear_num_value_heads=heads, linear_key_head_dim=head_dim,
               linear_value_head_dim=head_dim, linear_conv_kernel_dim=4)
    if "layer_types" not in kw:
        out["full_attention_interval"] = 4 if int(kw.get("num_hidden_layers", 4)) >= 4 else 2
    return out


RANDOM_INIT_A = (0.01, 1.0)  # HF draws A from (0.01, 16)


def init_decay(model, seed: int = 0, low: float = RANDOM_INIT_A[0], high: float = RANDOM_INIT_A[1]) -> int:
    """Random-init models only (``dta.model.models.build_model``): draw each GDN head's decay rate A
    from [low, high] instead of HF's [0.01, 16]. With A up to 16 a head's decay over a 64-token
    chunk reaches exp(-1000): the chunked delta rule (exp of cumulative decays, a triangular
    solve) then rounds the tiny gradients of A_log / dt_bias differently for different chunk
    boundaries — ~5e-10 relative between DFS and whole-sequence training, and ~5e-12 between
    HF's own chunked and token-by-token kernels on the same sequence — while every other
    gradient stays at 1e-14. A property of the kernel's conditioning, not of the walk; with the
    milder range every gradient agrees to round-off. Returns the number of layers set."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log") and hasattr(m, "dt_bias"):
                a = torch.empty(m.A_log.shape, dtype=torch.float64).uniform_(low, high, generator=g)
                m.A_log.copy_(a.log().to(m.A_log.dtype))
                n += 1
    return n

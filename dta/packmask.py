"""A pack's attention mask, materialized once per forward from its integer layout.

The layout (:class:`dta.planning.packs.PackLayout`) says: row q sees every cached key
(tree positions ``0 .. prefix-1``, the pack's root path) and pack row k iff k's node is an
ancestor of (or is) q's node and ``pos[k] <= pos[q]``. Sliding-window layers additionally
need ``pos[q] - pos[k] < window`` (positions are tree positions: the distance on the path).

What the forward gets (:func:`pack_mask`):

* ``None`` for a pack that is one path: plain causal attention over [prefix, pack], which
  Hugging Face builds itself from the cache length and the true position ids (sliding
  windows included);
* otherwise one mask per layer type in ``config.layer_types`` (a dict keyed by layer type
  when the model has sliding-window layers: the decoders of transformers 5 take it as is),
  in the form the attention implementation expects: a ``[1, 1, T, prefix + T]`` boolean
  mask (True = visible) for SDPA, an additive float mask for eager attention (eager *adds*
  a boolean mask), a FlexAttention ``BlockMask`` for ``flex_attention`` (GPU: FlexAttention
  has no backward on CPU). Other kernels (flash-attn) cannot take a tree mask: refused.
"""
from __future__ import annotations

import torch

SDPA_LIKE = ("sdpa", "dta_sdpa")
MASKED_KINDS = SDPA_LIKE + ("eager", "flex_attention")
LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config) -> dict[str, int | None]:
    """Layer type -> window (None: full attention), for the layer types the model uses."""
    n = int(getattr(config, "num_hidden_layers", 0) or 0)
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * max(n, 1))
    out = {}
    for t in types:
        if t not in LAYER_TYPES:
            raise ValueError(f"a pack with branches cannot mask layer type {t!r} "
                             f"(supported: {', '.join(LAYER_TYPES)}); use packing='node'")
        if t == "sliding_attention":
            w = getattr(config, "sliding_window", None)
            if not w:
                raise ValueError("config has sliding_attention layers but no sliding_window")
            out[t] = int(w)
        else:
            out[t] = None
    return out


def _index_tensors(layout, device):
    pos = torch.as_tensor(layout.positions, device=device)
    node = torch.as_tensor(layout.node, device=device)
    exit_ = torch.as_tensor(layout.exit, device=device)
    return pos, node, exit_


def dense_mask(layout, device, window: int | None = None) -> torch.Tensor:
    """``[1, 1, T, prefix + T]`` bool, True = visible."""
    pos, node, exit_ = _index_tensors(layout, device)
    T, P = layout.tokens, layout.prefix
    nq, nk = node[:, None], node[None, :]
    inner = (nk <= nq) & (nq < exit_[nk]) & (pos[None, :] <= pos[:, None])
    if P:
        mask = torch.cat([torch.ones(T, P, dtype=torch.bool, device=device), inner], dim=1)
    else:
        mask = inner
    if window is not None:
        kpos = torch.cat([torch.arange(P, device=device), pos])
        mask &= (pos[:, None] - kpos[None, :]) < window
    return mask[None, None]


def flex_mask_mod(layout, device, window: int | None = None):
    """FlexAttention's ``mask_mod(b, h, q, kv)`` of the pack: the dense mask's rule on indices."""
    pos, node, exit_ = _index_tensors(layout, device)
    P = layout.prefix

    def mask_mod(b, h, q, kv):
        k = (kv - P).clamp(min=0)
        nq, nk = node[q], node[k]
        vis = (kv < P) | ((nk <= nq) & (nq < exit_[nk]) & (pos[k] <= pos[q]))
        if window is not None:
            kpos = torch.where(kv < P, kv, pos[k])
            vis = vis & ((pos[q] - kpos) < window)
        return vis

    return mask_mod


def block_mask(layout, device, window: int | None = None):
    """The same visibility as a FlexAttention ``BlockMask`` (Q_LEN T, KV_LEN prefix + T)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(flex_mask_mod(layout, device, window), None, None, layout.tokens,
                             layout.prefix + layout.tokens, device=str(device))


def _materialize(layout, device, window, kind: str, dtype):
    if kind in SDPA_LIKE:
        return dense_mask(layout, device, window)
    if kind == "eager":
        m = dense_mask(layout, device, window)
        return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(
            ~m, torch.finfo(dtype).min)
    if kind == "flex_attention":
        return block_mask(layout, device, window)
    raise ValueError(f"attention implementation {kind!r} cannot take a tree mask: a pack with "
                     f"branches needs one of {', '.join(MASKED_KINDS)} (or packing='node')")


def pack_mask(layout, config, device, dtype=torch.float32):
    """The ``attention_mask`` argument for a pack's forward (see the module doc)."""
    if layout.chain:
        return None
    kind = getattr(config, "_attn_implementation", None) or "eager"
    windows = layer_windows(config)
    masks = {t: _materialize(layout, device, w, kind, dtype) for t, w in windows.items()}
    if set(masks) == {"full_attention"}:
        return masks["full_attention"]
    return masks

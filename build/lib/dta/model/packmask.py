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
  when the model has sliding-window layers and its decoder takes such a dict; a single
  windowed mask when every layer is sliding: Mistral, Mixtral, Phi-3, Starcoder2;
  :func:`mask_support` reads which from the config and the decoder),
  in the form the attention implementation expects: a ``[1, 1, T, prefix + T]`` boolean
  mask (True = visible) for SDPA, an additive float mask for eager attention (eager *adds*
  a boolean mask), a FlexAttention ``BlockMask`` for ``flex_attention`` (GPU: FlexAttention
  has no backward on CPU). Other kernels (flash-attn) cannot take a tree mask: refused.

Under ``dta_sdpa`` (the walk's attention, :mod:`dta.model.attention`) a pack over cached
keys gets a *pack view* instead, chain or not: the pack's own ``[1, 1, T, T]`` boolean mask
(window applied) carrying a :class:`PackView` (``mask.dta_pack``: the number of cached keys,
the window, the rows' positions). The attention splits at the cache boundary from it and no
``[T, prefix + T]`` mask is built on any device; :data:`DENSE_PATH_MASKS` counts, by device
type, every dense mask over cached keys that is built all the same (another attention
implementation, or a call the split cannot serve).
"""
from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass, field

import torch

SDPA_LIKE = ("sdpa", "dta_sdpa")
MASKED_KINDS = SDPA_LIKE + ("eager", "flex_attention")
LAYER_TYPES = ("full_attention", "sliding_attention")
UNMASKED = ("linear_attention",)  # recurrent (GDN) layers: no mask; they follow the pack's
# tree through their state (dta/model/gdn.py), so their entry in a dict of masks is None


_DICT_MASKS = "isinstance(causal_mask_mapping := attention_mask, dict)"
_ALL_SLIDING = "create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask"


def mask_support(model) -> tuple[dict[str, int | None] | None, str]:
    """How a pack with branches can be masked for ``model``: ``(windows, how)`` with windows
    mapping each layer type to its window (None: full attention) and how = "single" (one
    mask for every layer) or "dict" (one per layer type, which the decoder takes as is);
    ``(None, reason)`` when it cannot (the walker then packs single paths only, which need no
    mask). Read from the config and the decoder's own mask selection (its source): a layer
    type the decoder masks some other way is never guessed at."""
    cfg = model.config
    kind = getattr(cfg, "_attn_implementation", None) or "eager"
    if kind not in MASKED_KINDS:
        return None, f"attention implementation {kind!r} takes no tree mask"
    try:
        # a wrapper of the decoder (a runtime's, e.g. its lockstep) names it as __wrapped__
        src = inspect.getsource(type(inspect.unwrap(model.get_decoder())).forward)
    except (OSError, TypeError):
        return None, "the decoder's forward source is not readable"
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if types:
        unknown = sorted(set(types) - set(LAYER_TYPES) - set(UNMASKED))
        if unknown:
            return None, f"layer types {unknown} have no tree mask"
        if set(types) & set(UNMASKED) and _DICT_MASKS not in src:
            return None, "the decoder does not take one mask per layer type"
        windows = {t: (int(window) if t == "sliding_attention" else None) for t in types
                   if t not in UNMASKED}
        if set(types) & set(UNMASKED):
            return windows, "dict"
        if "sliding_attention" in windows and not window:
            return None, "sliding_attention layers without a sliding_window"
        if set(windows) == {"full_attention"} and _ALL_SLIDING not in src:
            return windows, "single"
        if _DICT_MASKS in src:
            return windows, "dict"
        return None, "the decoder does not take one mask per layer type"
    if window and _ALL_SLIDING in src:
        return {"sliding_attention": int(window)}, "single"
    if window:
        return None, "a sliding_window the decoder applies in a way DTA does not model"
    if "create_causal_mask" not in src:
        return None, "the decoder builds its attention mask in a way DTA does not model"
    return {"full_attention": None}, "single"


def _index_tensors(layout, device):
    pos = torch.as_tensor(layout.positions, device=device)
    node = torch.as_tensor(layout.node, device=device)
    exit_ = torch.as_tensor(layout.exit, device=device)
    return pos, node, exit_


DENSE_PATH_MASKS: Counter = Counter()  # dense masks over cached keys built, by device type


def count_dense(mask: torch.Tensor) -> None:
    from dta.model.attention_kernels import device_type  # looked up now: tests stand in

    DENSE_PATH_MASKS[device_type(mask)] += 1


def own_mask(layout, device, window: int | None = None) -> torch.Tensor:
    """``[T, T]`` bool: the pack's own keys as its rows see them (window applied)."""
    pos, node, exit_ = _index_tensors(layout, device)
    nq, nk = node[:, None], node[None, :]
    inner = (nk <= nq) & (nq < exit_[nk]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        inner &= (pos[:, None] - pos[None, :]) < window
    return inner


@dataclass
class PackView:
    """What a pack's attention needs beside its own ``[T, T]`` mask: ``past`` cached keys
    (tree positions 0 .. past-1, visible to a row unless outside its ``window``), the rows'
    ``positions``, and whether the pack is one path (its own mask then causal)."""

    past: int
    window: int | None
    positions: torch.Tensor  # [T]
    chain: bool
    _split: object = field(default=None, repr=False)

    def reach(self) -> int | None:
        """None when every row sees every cached key (the attention splits); else the first
        cached key some row sees (its window's masked call starts there)."""
        if self.window is None or int(self.positions.max()) < self.window:
            return None
        return max(0, int(self.positions.min()) - self.window + 1)

    def split(self, own: torch.Tensor):
        """The split of the attention (made once per forward)."""
        if self._split is None:
            from dta.model.split_attention import Split

            causal = self.chain and self.window is None or self.window is not None and \
                self.chain and int(self.positions.max() - self.positions.min()) < self.window
            self._split = Split(self.past, None if causal else own[0, 0])
        return self._split

    def window_mask(self, own: torch.Tensor, lo: int) -> torch.Tensor:
        """``[1, 1, T, past - lo + T]``: the cached keys lo.. (inside the window of some row)
        and the pack's own -- at most ``window + T`` wide."""
        j = torch.arange(lo, self.past, device=own.device)
        cached = (self.positions[:, None] - j[None, :]) < self.window
        return torch.cat([cached, own[0, 0]], dim=1)[None, None]

    def dense(self, own: torch.Tensor) -> torch.Tensor:
        """The dense ``[1, 1, T, past + T]`` mask (counted in :data:`DENSE_PATH_MASKS`)."""
        j = torch.arange(self.past, device=own.device)
        cached = torch.ones(len(self.positions), self.past, dtype=torch.bool, device=own.device)
        if self.window is not None:
            cached = (self.positions[:, None] - j[None, :]) < self.window
        mask = torch.cat([cached, own[0, 0]], dim=1)[None, None]
        count_dense(mask)
        return mask


def pack_view(layout, device, window: int | None = None) -> torch.Tensor:
    """The pack's own ``[1, 1, T, T]`` mask carrying its :class:`PackView` (``.dta_pack``)."""
    mask = own_mask(layout, device, window)[None, None]
    mask.dta_pack = PackView(layout.prefix, window, torch.as_tensor(layout.positions, device=device),
                             bool(layout.chain))
    return mask


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
    if P:
        count_dense(mask)
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


_said: set = set()


def _say_dense(device, why: str) -> None:
    """Warn once per reason that a pack over cached keys takes a dense mask on a GPU."""
    from dta.model import attention_kernels

    dev = attention_kernels.device_type(device)
    if dev != "cpu" and why not in _said:
        _said.add(why)
        import warnings

        warnings.warn(f"{why} on {dev}: no split kernel; a pack over cached keys takes one "
                      "masked call with a dense [T, prefix + T] mask", stacklevel=3)


def _materialize(layout, device, window, kind: str, dtype):
    if kind == "dta_sdpa" and layout.prefix:
        return pack_view(layout, device, window)
    if kind in SDPA_LIKE:
        return dense_mask(layout, device, window)
    if kind == "eager":
        if layout.prefix:
            _say_dense(device, "eager attention (e.g. Gemma 2's attention soft-capping)")
        m = dense_mask(layout, device, window)
        return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(
            ~m, torch.finfo(dtype).min)
    if kind == "flex_attention":
        return block_mask(layout, device, window)
    raise ValueError(f"attention implementation {kind!r} cannot take a tree mask: a pack with "
                     f"branches needs one of {', '.join(MASKED_KINDS)} (or packing='node')")


def pack_mask(layout, model, device, dtype=torch.float32, support=None):
    """The ``attention_mask`` argument for a pack's forward (see the module doc);
    ``support``: :func:`mask_support` of the model, when already known."""
    kind = getattr(model.config, "_attn_implementation", None) or "eager"
    if layout.chain and not (kind == "dta_sdpa" and layout.prefix):
        return None  # HF's own causal mask: none over cached keys (no prefix, or not dta_sdpa)
    windows, how = support or mask_support(model)
    if windows is None and layout.chain:
        return None
    if windows is None:
        raise ValueError(f"{type(model).__name__}: a pack with branches cannot be masked "
                         f"({how}); plan single-path packs (branches=False) or packing='node'")
    masks = {t: _materialize(layout, device, w, kind, dtype) for t, w in windows.items()}
    if how == "single":
        return next(iter(masks.values()))
    types = getattr(model.config, "layer_types", None) or ()
    return {**masks, **{t: None for t in UNMASKED if t in types}}

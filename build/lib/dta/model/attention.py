"""Attention without copies: SDPA's native grouped-query path, and the walk's K/V cache.

* ``dta_sdpa``: Hugging Face's SDPA path ``repeat_kv``-copies the whole prefix K/V to the
  query heads whenever a mask is passed (a pack with branches, or any forward over a cached
  prefix: a mask is then materialized). :func:`sdpa_gqa_forward` calls
  ``scaled_dot_product_attention(..., enable_gqa=True)`` instead, which reads the K/V heads
  in place and is the same computation. A forward over cached keys is split at the cache
  boundary on every device (:mod:`dta.model.split_attention`: the cached keys without a
  mask, the pack's own keys causal or with their tree mask, through the kernel table of
  :mod:`dta.model.attention_kernels`). The walk's masks are *pack views*
  (:func:`dta.model.packmask.pack_mask`): the pack's own ``[T, T]`` mask and the number of
  cached keys, never a ``[T, path]`` mask; a sliding-window layer whose window does not
  cover the whole path attends, in one masked call, only to the cached keys inside the
  window (a mask at most ``window + T`` wide). Only a call the split cannot serve
  (attention soft-capping, sinks, position bias, dropout) builds the dense mask, and says so
  on a GPU. It is registered under the name ``dta_sdpa`` for attention and (with HF's own
  SDPA mask builder, counted) for masks; :func:`native_gqa` switches a model from ``sdpa``
  to it for the duration of a walk.
* :class:`PathCache`: the cache of one forward, built from the path's K/V *pieces* (the
  autograd leaves of each pack on the path, or their rows on the path): the pieces and the new
  K/V are concatenated once, inside ``update`` -- instead of concatenating the path once to
  build a ``DynamicCache``, once more as its initial ``update`` and again when the forward
  appends. Every layer is a plain full layer (no ``config``): sliding windows are enforced by
  the mask from the true position ids, never by dropping cached keys.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dta.model import attention_kernels
from dta.model.hf_cache import OffsetLayer, new_cache
from dta.model.packmask import PackView, count_dense
from dta.model.split_attention import Split, Tape, additive_mask, split_attention, split_of

GQA_NAME = "dta_sdpa"
FALLBACK_KWARGS = ("position_bias", "softcap", "s_aux", "sinks")
_warned: set = set()


def sdpa_gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """HF's SDPA attention, with grouped-query heads read in place (``enable_gqa``), and a
    forward over cached keys split at the cache boundary (:mod:`dta.model.split_attention`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = getattr(key, "dta_attend", None)  # a cache layer that attends itself (context
    if layer is not None:  # parallelism: dta.model.cp_attention), handed over with the keys
        return layer.attend(module, query, key, value, attention_mask, dropout, scaling,
                            _tape, kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    view = getattr(attention_mask, "dta_pack", None)
    if view is not None:
        return pack_attention(module, query, key, value, attention_mask, view, dropout,
                               scaling, **kwargs)
    if any(kwargs.get(k) is not None for k in FALLBACK_KWARGS):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    forms = _mask_forms(attention_mask, query)
    if forms is not None and forms.split is not None and not (dropout and module.training):
        out = split_attention(query, key, value, forms.split, scaling,
                              _pieces_of(key), _pieces_of(value), _tape,
                              attention_kernels.backend)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    if groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    q_len = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_len:  # an unmasked causal call is upper-left aligned
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask if forms is None else forms.additive(attention_mask),
        dropout_p=dropout, scale=scaling, is_causal=is_causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def pack_attention(module, query, key, value, mask, view: PackView, dropout, scaling, **kwargs):
    """A pack's attention from its view (``mask``: the own keys' [1, 1, T, T] mask): split at
    the cache boundary; a window short of the path: one masked call over the cached keys
    inside it; what the split cannot serve: the dense mask (counted; said on a GPU)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    T, S = query.shape[2], key.shape[2]
    if S != view.past + T:
        raise RuntimeError(f"dta_sdpa: a pack view over {view.past} cached keys got {S} keys for "
                           f"{T} queries")
    why = [k for k in FALLBACK_KWARGS if kwargs.get(k) is not None]
    if dropout and module.training:
        why.append("dropout")
    if not why:
        lo = view.reach()
        if lo is None:
            out = split_attention(query, key, value, view.split(mask), scaling,
                                  _pieces_of(key), _pieces_of(value), _tape,
                                  attention_kernels.backend)
            if out is not None:
                return out.transpose(1, 2).contiguous(), None
            why.append(f"no split kernel for {query.dtype} on {query.device.type}")
        else:  # the cached keys inside the window only: a mask at most window + T wide
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key[:, :, lo:], value[:, :, lo:], attn_mask=view.window_mask(mask, lo),
                scale=scaling, enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
    dense = view.dense(mask)
    dev = attention_kernels.device_type(query)
    if dev != "cpu" and tuple(why) not in _warned:
        _warned.add(tuple(why))
        import warnings

        warnings.warn(f"dta_sdpa on {dev}: {', '.join(why)} -- the split attention cannot serve "
                      f"this call; it falls back to one masked SDPA call with a dense "
                      f"[T, {S}] mask over the cached path", stacklevel=2)
    return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout,
                                  scaling=scaling, is_causal=False, **kwargs)


@dataclass
class MaskForms:
    dtype: torch.dtype
    split: Split | None
    _additive: torch.Tensor | None = None

    def additive(self, mask: torch.Tensor) -> torch.Tensor:
        """0 where visible, -inf elsewhere: what SDPA converts a boolean mask to (made once)."""
        if self._additive is None:
            self._additive = additive_mask(mask, self.dtype)
        return self._additive


def _mask_forms(mask, query) -> MaskForms | None:
    """A boolean mask's additive form and split, made once per forward instead of once per
    layer call: every layer of a forward passes the same mask tensor (per layer type), which
    carries its forms (``dta_forms``: they go with the mask, so nothing derived from a
    forward's mask outlives that forward)."""
    if mask is None or mask.dtype != torch.bool:
        return None
    forms = getattr(mask, "dta_forms", None)
    if forms is None:
        forms = mask.dta_forms = []
    for f in forms:
        if f.dtype == query.dtype:
            return f
    split = split_of(mask, query.dtype)
    forms.append(MaskForms(query.dtype, split))
    return forms[-1]


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(GQA_NAME, sdpa_gqa_forward)
    AttentionMaskInterface.register(GQA_NAME, counted_sdpa_mask)
    return GQA_NAME


def counted_sdpa_mask(*args, **kwargs):
    """HF's SDPA mask builder, counting the masks it builds over cached keys
    (``dta.model.packmask.DENSE_PATH_MASKS``, by device): the walk passes pack views, so a
    count there means a forward over the path built its dense mask."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] > mask.shape[-2]:
        count_dense(mask)
    return mask


def _set_impl(model, name: str) -> None:
    configs = {id(model.config): model.config}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            configs[id(cfg)] = cfg
    for cfg in configs.values():
        cfg._attn_implementation = name


@contextlib.contextmanager
def native_gqa(model, enabled: bool = True, backend: str | None = None):
    """Run a model that uses ``sdpa`` on ``dta_sdpa`` (exact: the same attention without the
    ``repeat_kv`` copies of grouped-query K/V, and split at the cache boundary, through
    ``backend``'s kernels: :data:`dta.model.attention_kernels.BACKENDS`; None: the module's
    current ``attention_kernels.backend``); other models run unchanged."""
    if not enabled or model.config._attn_implementation != "sdpa":
        yield
        return
    backend = attention_kernels.backend if backend is None else backend
    if backend not in attention_kernels.BACKENDS:
        raise ValueError(f"attention backend {backend!r}: one of "
                         f"{', '.join(attention_kernels.BACKENDS)}")
    register()
    _set_impl(model, GQA_NAME)
    before, attention_kernels.backend = attention_kernels.backend, backend
    try:
        yield
    finally:
        attention_kernels.backend = before
        _set_impl(model, "sdpa")


# the tape of the forward running now (:func:`taped`), or None
_tape: Tape | None = None


@contextlib.contextmanager
def taped(tape: Tape | None):
    """A forward whose split attention calls keep their results on ``tape`` -- or, once the
    tape has recorded them, take them back: a pack's re-forward (recompute) skips the
    attention over its path (``dta.model.split_attention.Tape``)."""
    global _tape
    if tape is None:
        yield
        return
    _tape = tape
    try:
        yield
        tape.finish()
    finally:
        _tape = None


# a joined K/V tensor carries the pieces it was made of (``dta_pieces``), which the split
# attention saves for its backward -- the frames' K/V, alive anyway -- instead of the joined
# copy of the whole path's K/V
def _remember_pieces(joined: torch.Tensor, pieces: tuple) -> None:
    joined.dta_pieces = pieces


def _pieces_of(joined: torch.Tensor) -> tuple | None:
    return getattr(joined, "dta_pieces", None)


class PathLayer(OffsetLayer):
    """One layer's cache: the path's K/V pieces, joined with the new K/V in one ``cat``.

    After the forward the layer holds only the new K/V (``keys``/``values``: positions
    ``offset``.. of the path), as computed -- not a slice of the joined tensor: a node state
    read as a view of the join would keep the whole path's K/V alive with it (the attention
    keeps the pieces, not the join), and its gradient would come back as a path-long
    zero-padded ``slice_backward``."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(sum(k.shape[-2] for k, _ in parts))
        self.parts = parts

    def update(self, key_states, value_states, *args, **kwargs):
        joined = join_path(self.parts, key_states, value_states)
        self.store(key_states, value_states)
        self.parts = []
        return joined


def join_path(parts: list, keys: torch.Tensor, values: torch.Tensor) -> tuple:
    """The path's K/V pieces and a forward's own K/V joined along the positions (one ``cat``
    each), carrying their pieces for the split attention's backward."""
    if not parts:
        return keys, values
    ks, vs = (*(k for k, _ in parts), keys), (*(v for _, v in parts), values)
    joined = torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)
    _remember_pieces(joined[0], ks)
    _remember_pieces(joined[1], vs)
    return joined


def path_cache(pieces: list[list[tuple[torch.Tensor, torch.Tensor]]] | None, n_layers: int):
    """A fresh cache (a forward mutates its cache) over ``pieces[layer] = [(k, v), ...]``."""
    return new_cache([PathLayer(pieces[layer] if pieces else []) for layer in range(n_layers)])

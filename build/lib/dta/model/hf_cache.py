"""The one place DTA builds or reads a ``transformers`` cache.

The walk hands a model the states of a node's path through the model's own cache argument
and reads the node's new states back from it. Everything that depends on how transformers
lays out a cache -- its layer classes, their attributes (``keys`` / ``values``,
``conv_states`` / ``recurrent_states``), how a cache counts its positions, which keyword
a GDN module receives its cache under -- lives here, so that the next upstream change is
mended in this file alone (``scripts/check-upstream.sh`` finds such changes; docs/versions.md).

Public API used (stable across transformers 5.x): ``Cache(layers=...)``, ``DynamicCache``,
``DynamicLayer`` and ``LinearAttentionLayer`` with their ``update`` / ``update_conv_state`` /
``update_recurrent_state`` / ``get_seq_length`` methods. Our layers answer ``get_seq_length``
themselves -- the positions the path holds -- instead of relying on the base class's
bookkeeping (5.25 gave the linear-attention layer a counter of its own that a layer built
from stored states never advances; 5.24 read the first attention layer instead).

* Attention layers: :class:`OffsetLayer`, a full layer holding positions ``offset..`` (the
  walk's path layers subclass it: ``dta.model.attention.PathLayer``, the context-parallel
  layer), and :func:`dense_cache` (a plain ``DynamicCache`` of a path's K/V).
* Gated DeltaNet layers: :class:`ForkedStateLayer` (HF's own GDN forward continued from a
  parent's final state, updated functionally so that autograd flows through the states) and
  :class:`PackStateLayer` (a pack's carrier: the GDN forward over a pack is
  ``dta.model.gdn.pack_forward``, which reads the initial state and leaves the final ones).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

try:  # 5.5+: the linear-attention (Gated DeltaNet) cache layer the walk forks states through
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # 5.0 - 5.4: the hybrid families are refused (dta.model.families.needs)
    LinearAttentionLayer = None

# the first transformers release whose cache has LinearAttentionLayer (what the hybrids need)
LINEAR_ATTENTION_SINCE = "5.5.0"

# the keyword a layer's forward receives the cache under, newest first (5.4 renamed
# past_key_values -> cache; the GDN modules of 5.x before 5.25 take cache_params)
CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def cache_kwarg(forward) -> str:
    """The keyword under which ``forward`` (a decoder's or a module's) takes its cache."""
    import inspect

    params = inspect.signature(forward).parameters
    return next((k for k in CACHE_KWARGS if k in params), CACHE_KWARGS[-1])


def cache_in(kwargs: dict):
    """The cache a layer's forward was called with (None: none)."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


def output_cache(out):
    """The cache a model's forward returned (``cache`` from 5.24; ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def new_cache(layers: list) -> Cache:
    """A cache of the given layers (one per decoder layer)."""
    return Cache(layers=layers)


def positions(cache, layer: int = 0) -> int:
    """The number of positions ``cache`` holds before a forward, read from ``layer``."""
    return int(cache.get_seq_length(layer))


# ------------------------------------------------------------------ attention --
def dense_cache(data: list | None) -> DynamicCache:
    """A plain ``DynamicCache`` over ``data[layer] = (keys, values)`` (None: empty)."""
    return DynamicCache(ddp_cache_data=data) if data else DynamicCache()


class OffsetLayer(DynamicLayer):
    """A full attention layer whose path positions ``0..offset-1`` are held elsewhere (pieces
    joined inside ``update``, or another rank's rows); after the forward it holds only the
    new K/V, positions ``offset..``."""

    def __init__(self, offset: int):
        super().__init__()
        self.offset = int(offset)

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep a forward's new K/V (positions ``offset..``)."""
        self.keys, self.values, self.is_initialized = keys, values, True

    def get_seq_length(self) -> int:
        return self.offset + (self.keys.shape[-2] if self.is_initialized else 0)


def layer_kv(layer) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(first position, keys, values) an attention cache layer holds after a forward."""
    return getattr(layer, "offset", 0), layer.keys, layer.values


# ---------------------------------------------------------------- Gated DeltaNet --
def _linear_attention_base():
    """HF's ``LinearAttentionLayer``, or -- on a release without it -- a base that refuses to
    be built, in one line naming the release that brings it."""
    if LinearAttentionLayer is not None:
        return LinearAttentionLayer

    class _Missing:
        def __init__(self, *args, **kwargs):
            import transformers

            raise RuntimeError(f"Gated DeltaNet layers need transformers >= {LINEAR_ATTENTION_SINCE}"
                               f" (its LinearAttentionLayer cache); installed: transformers "
                               f"{transformers.__version__}")

    return _Missing


class _StateLayer(_linear_attention_base()):
    """A GDN layer's cache that starts from a given (conv, recurrent) state (None: zeros) with
    ``positions`` positions before it, and that reports those positions itself."""

    def __init__(self, state: tuple | None, positions: int):
        super().__init__(number_of_states=1)
        self.positions = int(positions)
        # HF's single-token decode updates the conv state in place; "recording the past"
        # routes every forward through the general path (cat + conv), kept functional below
        self.record_past = True
        if state is not None:
            conv, rec = state
            self.conv_states[0], self.recurrent_states[0] = conv, rec
            self.conv_kernel_size[0] = conv.shape[-1]
            self.device, self.dtype = conv.device, conv.dtype
            self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
            self.has_previous_state[0] = True

    def get_seq_length(self) -> int:
        return self.positions

    def increase_count(self, state_idx: int = 0) -> None:  # HF's in-place decode: never taken
        raise RuntimeError("a walk's GDN state is never updated in place")

    def crop(self, tokens_to_remove: int):
        raise RuntimeError("a walk's GDN state cannot be cropped")


class ForkedStateLayer(_StateLayer):
    """HF's linear-attention cache layer, continued from a parent's final state and updated
    functionally: the states are replaced, never written into (HF's ``copy_`` would break
    autograd through a leaf or a saved tensor)."""

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
        kernel = conv_kernel_size or self.conv_kernel_size[state_idx]
        if self.has_previous_state[state_idx]:
            prev = self.conv_states[state_idx]
        else:  # a root: zero state (what HF's prefill pads with)
            prev = conv_states.new_zeros(*conv_states.shape[:-1], kernel)
        full = torch.cat([prev, conv_states], dim=-1)
        self.conv_states[state_idx] = full[..., -kernel:]
        self.conv_kernel_size[state_idx] = kernel
        self.device, self.dtype = conv_states.device, conv_states.dtype
        self.is_conv_states_initialized[state_idx] = True
        self.has_previous_state[state_idx] = True
        if state_idx == 0:
            self.positions += int(conv_states.shape[-1])
        return full

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        if not isinstance(recurrent_states, torch.Tensor):  # 5.25+: a history, the last is the state
            recurrent_states = recurrent_states[-1]
        self.recurrent_states[state_idx] = recurrent_states
        self.is_recurrent_states_initialized[state_idx] = True
        return recurrent_states


class PackStateLayer(_StateLayer):
    """A GDN layer's cache over a pack: the initial (conv, recurrent) state (the final state of
    the node the pack hangs from; None: zeros), the pack's plan, and after the forward the
    handed-on nodes' final states (``final``). Only ``dta.model.gdn.pack_forward`` runs over
    it; HF's cache API sees a layer that has a previous state. ``heads``: None -- every head
    of the layer -- or, on a layer that holds some heads only (context parallelism,
    ``dta.model.cp_gdn``), ``heads(module)``: their split."""

    heads = None

    def __init__(self, initial: tuple | None, plan, positions: int = 0):
        super().__init__(initial, positions)
        self.initial = initial if initial is not None else (None, None)
        self.plan = plan
        self.final = None
        self.kernels = True  # the device's GDN kernel when it has one (gdn_kernels)

    def update_conv_state(self, *args, **kwargs):
        raise RuntimeError("a pack's GDN state is updated by dta.model.gdn.pack_forward only")

    update_recurrent_state = update_conv_state


def gdn_state(layer, where: str) -> tuple:
    """A GDN cache layer's (conv, recurrent) state after a node's forward."""
    if not layer.is_recurrent_states_initialized.get(0):
        raise RuntimeError(f"{where}: the GDN layer was not run; no final state to hand on")
    return layer.conv_states[0], layer.recurrent_states[0]


def hybrid_cache(kinds: list[str], data: list | None, positions: int, recurrent: str) -> Cache:
    """A fresh per-node cache for a hybrid model over ``positions`` path positions:
    ``data[i]`` is the path's K/V (an attention layer) or the parent's final (conv, recurrent)
    state (a layer of kind ``recurrent``); ``data=None`` for a root."""
    layers = []
    for i, kind in enumerate(kinds):
        if kind == recurrent:
            layers.append(ForkedStateLayer(data[i] if data is not None else None, positions))
        else:
            layer = DynamicLayer()
            if data is not None:
                layer.update(*data[i])
            layers.append(layer)
    cache = DynamicCache.__new__(DynamicCache)  # a DynamicCache, as HF builds for these models
    Cache.__init__(cache, layers=layers)
    return cache

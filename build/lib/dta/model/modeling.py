"""The walker's interface to a Hugging Face causal LM: everything DTA assumes about a model.

The walker never touches a model's internals except through ``ModelInterface``:

  embed(ids)            decoder inputs for a node's tokens. A plain lookup, or a lookup times a
                        constant (Gemma's √hidden), becomes an autograd *leaf* (``inputs_embeds``)
                        whose gradient rows are later index-added into the embedding weight,
                        times that constant (``collect_embedding_grads``); any other embedding
                        module (max_norm, a custom forward, ...) is fed ``input_ids`` and
                        differentiated by autograd through the module itself.
  forward(ids, s, path) one decoder call for a node at tree positions s..s+n-1 attending to
                        its ancestors: the path's per-layer states are concatenated into a
                        fresh cache built *without* the model config (plain full layers, never
                        HF's sliding layers that keep only the last window), and the true
                        ``position_ids`` are passed, so HF's own masks enforce every window
                        (all layers, some layers, interleaved). Returns the node's last hidden
                        states [n, H] and its own new per-layer states.
  logits                ``LogitTransform``: what the CausalLM forward does to ``lm_head(h)``
                        (``logit_scale`` ×, ``logits_scaling`` ÷, ``final_logit_softcapping``
                        tanh), then the sampling temperature ÷. ``dta/model/head.py`` applies it and
                        differentiates it by hand.

Per-layer state. A node's state is a list over layers of tuples of tensors (``NodeState``);
for an attention layer the tuple is (keys, values) of the node's own positions, shaped
[1, heads, n, head_dim]. Each layer has a *kind* (``layer_kinds``); how a kind's states
are combined along a path into a cache layer and read back after a forward is one entry in
``_KINDS``, so a recurrent kind (a convolution and a recurrent state that a child continues
from its parent's last value) is one more entry, not a change to the walk. The walker
treats state tensors opaquely: it detaches them into leaves for the descendants
(``state_leaves``) and pairs their ``.grad`` with the graph outputs at backward.

Where the pieces live is a model fact as well (``placement``, ``dta/model/placement.py``): a
process walking alone holds every row and head; under context parallelism (applied to the
model from outside, ``dta/model/context_parallel.py``) it forwards its rows of each pack
(``part``) and stores its heads' K/V, through the placement's cache layers and masks.

Which state tensors need a gradient is a model fact too (``state_needs_grad``). With a frozen
base and adapters on some linear layers (LoRA), a layer's keys may not depend on any trainable
weight (no adapter on ``k_proj`` and nothing trainable below the layer): such a tensor becomes
a plain detached tensor for the descendants -- no leaf, no gradient, no backward through it.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from dta.model import hf_cache, recurrent
from dta.model.placement import placement_of
from dta.model.routing import MoERouters

NodeState = list  # per layer: a tuple of tensors (attention: (keys, values))


class ModelInterfaceError(ValueError):
    """The model breaks an assumption the walker needs; raised before training."""


# ------------------------------------------------------------------------ logits --
@dataclass(frozen=True)
class LogitTransform:
    """z = softcap(scale · z_raw) / temperature, with softcap(y) = cap · tanh(y / cap)."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @classmethod
    def from_model(cls, model, temperature: float = 1.0) -> "LogitTransform":
        cfg = model.config
        scale = 1.0
        if getattr(cfg, "logits_scaling", None) not in (None, 1, 1.0):  # Granite: divides
            scale /= float(cfg.logits_scaling)
        logit_scale = getattr(model, "logit_scale", None)  # Cohere: multiplies
        if logit_scale is not None and not isinstance(logit_scale, torch.nn.Module):
            scale *= float(logit_scale)
        cap = getattr(cfg, "final_logit_softcapping", None)
        return cls(scale=scale, softcap=float(cap) if cap else None, temperature=float(temperature))

    def apply(self, z_raw: torch.Tensor):
        """(z, c): the transformed logits and the cap's tanh (None without soft-capping)."""
        y = z_raw * self.scale if self.scale != 1.0 else z_raw
        c = None
        if self.softcap is not None:
            c = torch.tanh(y / self.softcap)
            y = c * self.softcap
        return (y / self.temperature if self.temperature != 1.0 else y), c

    def backward_(self, g: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
        """∂L/∂z_raw from ∂L/∂z, in place of `g`: dz/dz_raw = scale (1 − c²) / T."""
        if c is not None:
            g.mul_(1 - c * c)
        factor = self.scale / self.temperature
        return g.mul_(factor) if factor != 1.0 else g


# -------------------------------------------------------------------- embeddings --
def embedding_scale(emb) -> torch.Tensor | float | None:
    """The constant `emb`'s forward multiplies a plain lookup by (1.0 for nn.Embedding
    itself), or None when its forward is anything else (then autograd runs through it)."""
    if not isinstance(emb, torch.nn.Embedding) or emb.max_norm is not None \
            or emb.scale_grad_by_freq or emb.sparse:
        return None
    if type(emb).forward is torch.nn.Embedding.forward:
        return 1.0
    scale = getattr(emb, "embed_scale", None)  # Gemma 1/2/3: super().forward(ids) * embed_scale
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        return None
    try:
        source = inspect.getsource(type(emb).forward)
    except (OSError, TypeError):
        return None
    return scale if "super().forward(input_ids) * self.embed_scale" in source else None


class EmbeddingInput:
    """Embeds node tokens as gradient-collecting leaves (see the module docstring)."""

    def __init__(self, model):
        self.module = model.get_input_embeddings()
        self.scale = embedding_scale(self.module)
        self._pending: list = []  # (ids, leaf embeddings) waiting for their gradient

    @property
    def as_leaf(self) -> bool:
        return self.scale is not None

    def inputs(self, ids: torch.Tensor) -> dict:
        if self.scale is None or not torch.is_grad_enabled() or not self.module.weight.requires_grad:
            return {"input_ids": ids}
        with torch.no_grad():
            x = self.module(ids)  # the module's own forward: the values are the model's
        x.requires_grad_()
        self._pending.append((ids, x))
        return {"inputs_embeds": x}

    def collect_grads(self) -> None:
        """Index-add the gradients of the leaves that have one (after a backward)."""
        keep = []
        w = self.module.weight
        for ids, x in self._pending:
            if x.grad is None:
                keep.append((ids, x))
                continue
            g = x.grad.reshape(-1, x.shape[-1]).to(w.dtype)
            if isinstance(self.scale, torch.Tensor):  # the forward multiplied by it
                g = g * self.scale.to(w.dtype)
            flat = ids.reshape(-1)
            if self.module.padding_idx is not None:
                g = g.masked_fill((flat == self.module.padding_idx)[:, None], 0)
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            w.grad.index_add_(0, flat, g)
        self._pending = keep


# ------------------------------------------------------------------ layer states --
def _attention_cache_layer(states: list[tuple]) -> tuple:
    """An attention layer's cache entry for a path: its nodes' K/V, in position order."""
    if len(states) == 1:
        return states[0]
    return tuple(torch.cat([s[j] for s in states], dim=2) for j in (0, 1))


def _own(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it when it is a view into a larger storage."""
    return x.clone() if x.untyped_storage().nbytes() > x.numel() * x.element_size() else x


def _attention_node_state(layer, start: int, end: int, where: str) -> tuple:
    own = getattr(layer, "node_state", None)  # a layer that knows its node's state (dta's)
    if own is not None:
        return own(start, end, where)
    offset, keys, values = hf_cache.layer_kv(layer)  # a PathLayer holds positions offset.. only
    if offset + keys.shape[2] != end or start < offset:  # e.g. a sliding cache layer
        raise ModelInterfaceError(
            f"{where}: the cache layer {type(layer).__name__} holds positions {offset}.."
            f"{offset + keys.shape[2] - 1} after a forward of positions {start}..{end - 1}; "
            "the walker needs every position's keys and values (a full cache layer)")
    if start == offset:
        return keys, values
    return keys[:, :, start - offset:], values[:, :, start - offset:]


class Piece(tuple):
    """(K, V) of one frame's rows on a path -- the rows this process stores of them
    (``kv_rows``; all of them alone) -- with their true ``positions`` (numpy) and
    ``covers``: the path rows the piece stands for."""

    def __new__(cls, kv, positions: np.ndarray, covers: int):
        self = super().__new__(cls, kv)
        self.positions, self.covers = positions, int(covers)
        return self


def _attention_through(state: tuple, layout, local: int, rows: np.ndarray,
                       kv_rows: tuple[int, int]) -> tuple:
    """An attention layer's K/V rows of a pack on the root path through local node ``local``
    -- of the pack's rows ``kv_rows`` this process stores, all of them alone -- and whether
    later packs may reuse them: the whole state or a slice (a view) may; rows gathered by
    ``index_select`` may not (a backward through them frees the saved index)."""
    a, b = kv_rows
    k, v = state
    mine = rows if (a, b) == (0, layout.tokens) else rows[(rows >= a) & (rows < b)]
    kv, reusable = state, True
    if len(mine) == 0:
        kv = k[:, :, :0], v[:, :, :0]
    elif len(mine) != b - a:
        local = mine - a
        lo, hi = int(local[0]), int(local[0]) + len(local)
        if np.array_equal(local, np.arange(lo, hi)):
            kv = k[:, :, lo:hi], v[:, :, lo:hi]
        else:
            idx = torch.as_tensor(local, device=k.device)
            kv, reusable = (k.index_select(2, idx), v.index_select(2, idx)), False
    return Piece(kv, np.asarray(layout.positions)[mine], len(rows)), reusable


_STATE_TENSORS = {"attention": 2, recurrent.RECURRENT: 2}  # (K, V); (conv, recurrent)
_NEEDS_GRAD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (pattern, flags)

# kind -> (path states -> cache data, (cache layer, start, end, where) -> node state,
#          (pack state, layout, local node, path rows) -> (the piece a pack below reads, reusable));
# "recurrent": a Gated DeltaNet layer's (conv, recurrent) state, continued from the final state
# of the node a pack hangs from (dta/model/recurrent.py; inside a pack, dta/model/gdn.py)
_KINDS = {"attention": (_attention_cache_layer, _attention_node_state, _attention_through),
          recurrent.RECURRENT: (recurrent.path_state, recurrent.node_state,
                                lambda state, layout, local, rows, kv_rows:
                                recurrent.state_through(state, layout, local, rows))}


class ModelInterface:
    """How the walker embeds, forwards and reads one node of `model` (module docstring)."""

    def __init__(self, model):
        self.model = model
        self.name = type(model).__name__
        # which rows of a pack and which heads of a layer this process holds: every one, or
        # a context-parallel group's share (dta.model.placement; applied from outside)
        self.placement = placement_of(model)
        self.decoder = model.get_decoder()
        self.embedding = EmbeddingInput(model)
        # transformers >= 5.4 names the kwarg `cache` (and warns on `past_key_values`).
        self.cache_kwarg = hf_cache.cache_kwarg(type(inspect.unwrap(self.decoder)).forward)
        self.layer_kinds = (recurrent.layer_kinds(model.config) if recurrent.is_hybrid(model)
                            else ["attention"] * _num_layers(model.config))
        self.recurrent_modules = recurrent.gdn_modules(model) if recurrent.RECURRENT in self.layer_kinds else []
        self._attention_layer = self.layer_kinds.index("attention") if "attention" in self.layer_kinds else None
        self.moe = MoERouters(model)  # the top-k routers: replay and capture (dta/model/routing.py)

    # -------------------------------------------------------------- packs --
    @contextlib.contextmanager
    def walking(self):
        """A walk's scope: the model's recurrent layers take a pack's tree (``dta/model/gdn.py``)
        and its MoE routers are hooked (``dta/model/routing.py``); outside it the model is
        unchanged."""
        with recurrent.packed(self.recurrent_modules), self.moe.scope():
            yield

    def part(self, layout):
        """The rows of the pack this process forwards (``dta.model.placement.PackPart``)."""
        return self.placement.part(layout.tokens)

    def pack_mask(self, layout, device, dtype, support):
        """The attention mask argument of a pack's forward (``dta.model.packmask``)."""
        return self.placement.mask(layout, self.model, device, dtype, support)

    def pack_cache(self, pieces: list | None, layout):
        """The cache of one pack's forward: per layer, the path's pieces (``state_through``
        of each frame on the path; None for a root pack) -- attention layers join the K/V
        pieces, recurrent layers start from the last piece (the final state of the node the
        pack hangs from) and follow the pack's local tree."""
        attention = self.placement.attention_layer
        if not self.recurrent_modules:
            return hf_cache.new_cache([attention(pieces[i] if pieces else [], layout)
                                       for i in range(len(self.layer_kinds))])
        plan = recurrent.pack_plan(layout, self.recurrent_modules[0])
        layers = [attention(pieces[i] if pieces else [], layout) if kind == "attention" else None
                  for i, kind in enumerate(self.layer_kinds)]
        offset = layers[self._attention_layer].offset  # the path's positions before the pack
        layers = [layer or self.placement.recurrent_layer(pieces[i][-1] if pieces else None,
                                                          plan, offset)
                  for i, layer in enumerate(layers)]
        return hf_cache.new_cache(layers)

    def state_through(self, state: NodeState, layout, local: int) -> tuple[list, bool]:
        """A pack's per-layer state as a pack hanging below local node ``local`` reads it (the
        K/V rows on the root path through it; the recurrent final state at it), and whether
        the pieces may be reused by later packs."""
        rows = layout.path_rows(local)
        kv_rows = self.placement.kv_rows(layout.tokens)
        out, reusable = [], True
        for kind, layer_state in zip(self.layer_kinds, state):
            piece, ok = _KINDS[kind][2](layer_state, layout, local, rows, kv_rows)
            out.append(piece)
            reusable &= ok
        return out, reusable

    def covered(self, piece: list) -> int:
        """Positions a frame's pieces cover (read from an attention layer's piece)."""
        if self._attention_layer is None:
            raise ModelInterfaceError(f"{self.name}: no attention layer to count positions")
        return piece[self._attention_layer].covers

    # ------------------------------------------------------------ trainable states --
    def state_needs_grad(self) -> list[tuple]:
        """Per layer, per state tensor: whether it can depend on a trainable parameter.

        True where anything trainable lies below the layer (the embedding, an earlier layer:
        the residual stream carries it into every tensor of the layer, whatever a router
        picks), or where a one-token probe forward with grad says the layer's own state
        depends on its own trainable weights (adapters on ``k_proj`` / ``v_proj``, on a
        recurrent layer's projections). A trainable embedding puts everything below every
        layer: no probe (full training, every sharded layout). Cached per model until a
        parameter's ``requires_grad`` changes."""
        pattern = tuple(p.requires_grad for p in self.model.parameters())
        cached = _NEEDS_GRAD.get(self.model)
        if cached is None or cached[0] != pattern:
            below = _trainable_below(self.decoder, len(self.layer_kinds))
            if all(below):  # a trainable embedding (full training): every state, no probe
                flags = [(True,) * _STATE_TENSORS[kind] for kind in self.layer_kinds]
            else:
                probe = self._probe_state_grad()
                flags = [tuple(b or x for x in layer) for b, layer in zip(below, probe)]
            cached = _NEEDS_GRAD[self.model] = (pattern, flags)
        return cached[1]

    def _probe_state_grad(self) -> list[tuple]:
        pending = list(self.embedding._pending)  # the probe's embedding leaf is not kept
        p = next(self.model.parameters())
        ids = torch.zeros(1, dtype=torch.long, device=p.device)
        # grad mode for requires_grad to propagate, but nothing saved for a backward
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda _: None):
            _, state = self.forward(ids, 0, [])
        self.embedding._pending = pending
        return [tuple(bool(t.requires_grad) for t in layer) for layer in state]

    def state_leaves(self, state: NodeState) -> NodeState:
        """The node's state as its descendants read it: detached, owning its memory (see
        :meth:`detached`), and an autograd leaf (its ``.grad`` collects their gradient) only
        where it can depend on a trainable weight."""
        leaves = [tuple(x.requires_grad_(need) for x, need in zip(layer, needs))
                  for layer, needs in zip(self.detached(state), self.state_needs_grad())]
        return self.placement.stored(leaves, self.layer_kinds)

    def state_grads(self, state: NodeState, leaves: NodeState) -> list[tuple]:
        """(output, gradient) pairs of a popped pack: each state tensor of its forward with
        the gradient its descendants left in its leaf."""
        return [(out, lf.grad) for layer, layer_leaves in zip(state, leaves)
                for out, lf in zip(layer, layer_leaves) if lf.grad is not None]

    def detached(self, state: NodeState) -> NodeState:
        """The node's state detached, each tensor owning its memory: where a node's K/V are
        a slice of a cache that holds the whole path's K/V (a ``DynamicCache``; a
        ``PathLayer`` keeps the node's own K/V apart), a frame that kept the slice would keep
        every ancestor's K/V once more -- quadratic in the path's length when a long node is
        walked in blocks."""
        return [tuple(_own(x.detach()) for x in layer) for layer in state]

    # ------------------------------------------------------------------ forward --
    def embed(self, ids: torch.Tensor) -> dict:
        return self.embedding.inputs(ids)

    def collect_embedding_grads(self) -> None:
        self.embedding.collect_grads()

    def path_cache(self, path: list[NodeState]):
        """A fresh cache holding the path's states (positions 0..start-1): a forward
        mutates its cache, so every node gets its own. No config: full layers only."""
        data = [_KINDS[kind][0]([node[i] for node in path])
                for i, kind in enumerate(self.layer_kinds)] if path else None
        if recurrent.RECURRENT in self.layer_kinds:  # per-kind layers, roots included
            held = int(data[self._attention_layer][0].shape[2]) if data else 0
            return recurrent.build_cache(self.layer_kinds, data, held)
        return hf_cache.dense_cache(data)

    def node_state(self, cache, start: int, end: int) -> NodeState:
        """The node's own slice (positions start..end-1) of every layer after its forward."""
        layers = cache.layers
        if len(layers) != len(self.layer_kinds):
            raise ModelInterfaceError(f"{self.name}: the cache has {len(layers)} layers, the "
                                      f"config {len(self.layer_kinds)}")
        return [_KINDS[kind][1](layer, start, end, f"{self.name} layer {i}")
                for i, (kind, layer) in enumerate(zip(self.layer_kinds, layers))]

    def forward(self, ids: torch.Tensor, start: int, path: list[NodeState]):
        """One node: `ids` [n] at positions start..start+n-1 after the path's states.
        Returns (last hidden states [n, H], the node's own NodeState)."""
        cache = self.path_cache(path)
        seen = hf_cache.positions(cache)
        if seen != start:
            raise ModelInterfaceError(f"{self.name}: the path's cache holds {seen} positions, "
                                      f"the node starts at {start}")
        end = start + len(ids)
        pos = torch.arange(start, end, device=ids.device).unsqueeze(0)
        out = self.decoder(position_ids=pos, use_cache=True, **self.embed(ids.unsqueeze(0)),
                           **{self.cache_kwarg: cache})
        cache = hf_cache.output_cache(out)
        return out.last_hidden_state[0], self.node_state(cache, start, end)


def _trainable_below(decoder, n_layers: int) -> list[bool]:
    """Per layer: whether a trainable parameter feeds its input (anything outside the layer
    stack counts as below it; a stack that cannot be found makes every layer True)."""
    stack = next((m for m in decoder.children()
                  if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers), None)
    if stack is None:
        return [any(p.requires_grad for p in decoder.parameters())] * n_layers
    inside = {id(p) for p in stack.parameters()}
    outside = any(p.requires_grad for p in decoder.parameters() if id(p) not in inside)
    below, seen = [], outside
    for layer in stack:
        below.append(seen)
        seen = seen or any(p.requires_grad for p in layer.parameters())
    return below


def _num_layers(config) -> int:
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = getattr(cfg, "num_hidden_layers", None)
    if n is None:
        raise ModelInterfaceError(f"{type(config).__name__} has no num_hidden_layers")
    return int(n)


def check_router_aux_loss(model, router_aux_loss) -> None:
    """MoE: the router's auxiliary load-balancing loss is computed only when the walk's
    ``router_aux_loss`` (``dta.options.WalkOptions``, validated there) is a coefficient
    (``dta/model/router_aux.py``; docs/moe.md). A model config that asks for it
    (``output_router_logits=True`` with ``router_aux_loss_coef > 0``, which makes HF's CausalLM
    add it to a labelled loss) is refused while it is ``refuse``; ``exclude`` says explicitly
    to train without it."""
    cfg = model.config
    coef = getattr(cfg, "router_aux_loss_coef", 0) or 0
    if router_aux_loss == "refuse" and getattr(cfg, "output_router_logits", False) and coef > 0:
        raise ModelInterfaceError(
            f"{type(model).__name__}: config.output_router_logits=True with router_aux_loss_coef="
            f"{coef} asks for the router's auxiliary load-balancing loss, but the walk's "
            "router_aux_loss is 'refuse' (off); give it the coefficient "
            f"(actor.router_aux_loss_coef={coef}, --router-aux-loss {coef}, "
            f"router_aux_loss={coef}) to compute it per sequence, router_aux_loss='exclude' to "
            "train the policy loss alone, or set config.output_router_logits=False")

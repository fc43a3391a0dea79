"""Mixture-of-experts routing as a model-interface fact: replay the rollout's experts, and
read what the routers did (for the router's auxiliary loss, ``dta/model/router_aux.py``).

A family's top-k router (HF transformers 5.x) returns ``(router_logits, top-k weights,
top-k expert ids)``; its sparse block sends each token to those ids with those weights.
``MoERouters`` hooks every router of the model for the length of a walk (``scope``) and,
inside one forward call (``call``), may

* *force* the experts: the ids become the given ones and the weights the router's own
  probabilities at those ids, normalized as the family normalizes its top-k
  (``ROUTER_FAMILIES``): ``softmax(logits)`` in float32 (in float64 on a truly float64
  model), gathered at the forced ids, divided by their sum where the family does
  (Mixtral, Qwen3.5-MoE always; Qwen3-MoE, OLMoE, Qwen3-Next when ``norm_topk_prob``), and
  cast back to the logits' dtype where the family does (all but Mixtral);
* *capture* each MoE layer's router logits (with their graph) and the expert ids used.

Nothing else changes: the router's weight gets its gradient through the weights at the
forced ids, exactly as in a per-sequence forward with the same replay. MoE layers are
numbered in layer order (a dense layer of a partly-sparse model has no router and no
entry). The walk never branches on any of this: a model without routers gets a no-op.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import numpy as np
import torch


class RoutingError(ValueError):
    """Routing that cannot be replayed as given; raised before any gradient."""


@dataclass(frozen=True)
class RouterFamily:
    normalize: str  # "always" | "norm_topk_prob": when the top-k weights are divided by their sum
    cast_back: bool  # the weights are cast back to the logits' dtype


# HF transformers 5.x router classes (models/<family>/modeling_<family>.py, *TopKRouter.forward)
ROUTER_FAMILIES = {
    "MixtralTopKRouter": RouterFamily("always", False),
    "Qwen3MoeTopKRouter": RouterFamily("norm_topk_prob", True),
    "OlmoeTopKRouter": RouterFamily("norm_topk_prob", True),
    "Qwen3_5MoeTopKRouter": RouterFamily("always", True),
    "Qwen3NextTopKRouter": RouterFamily("norm_topk_prob", True),
}


def _is_moe_config(cfg) -> bool:
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return any((getattr(cfg, k, 0) or 0) > 1 for k in ("num_experts", "num_local_experts"))


@dataclass
class RouterCall:
    """One forward call's routing: what to force, and what the routers did."""

    forced: torch.Tensor | None  # [T, layers, k] expert ids, or None (the router's own)
    capture: bool = False
    logits: dict = field(default_factory=dict)  # MoE layer -> [T, E] router logits (graph)
    experts: dict = field(default_factory=dict)  # MoE layer -> [T, k] expert ids used


class MoERouters:
    """The model's top-k routers in layer order, and hooks that force or read them."""

    def __init__(self, model):
        self.name = type(model).__name__
        self.routers = [m for m in model.modules() if type(m).__name__ in ROUTER_FAMILIES]
        self.unknown = _is_moe_config(model.config) and not self.routers
        self.num_experts = int(self.routers[0].num_experts) if self.routers else 0
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self._layer = {id(m): i for i, m in enumerate(self.routers)}
        self._call: RouterCall | None = None

    @property
    def layers(self) -> int:
        return len(self.routers)

    def require(self, what: str) -> None:
        """Refuse `what` (replay, the aux loss) on a model whose routers DTA does not know."""
        if not self.routers:
            kind = "an MoE model whose router class DTA does not know" if self.unknown \
                else "a model without MoE routers"
            raise RoutingError(f"{self.name}: {what} needs a top-k router of "
                               f"{', '.join(ROUTER_FAMILIES)}; this is {kind}")

    @contextlib.contextmanager
    def scope(self):
        """Hooks on every router for the length of a walk (removed after, also on error)."""
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._call = None

    @contextlib.contextmanager
    def call(self, forced: torch.Tensor | None = None, capture: bool = False):
        """One forward call: force ``forced`` [T, layers, k] and/or capture the routing."""
        call = RouterCall(forced, capture)
        self._call = call
        try:
            yield call
        finally:
            self._call = None

    def _hook(self, module, args, output):
        call = self._call
        if call is None or _SUSPENDED.get():
            return None
        layer = self._layer[id(module)]
        logits, weights, experts = output
        if call.forced is not None:
            forced = call.forced[:, layer]
            if forced.shape[0] != logits.shape[0]:
                raise RoutingError(f"{self.name}: MoE layer {layer} routes {logits.shape[0]} "
                                   f"tokens, the replay holds {forced.shape[0]}")
            own = forced[:, :1] < 0  # a token without a replayed routing: the router's own
            forced_w = forced_weights(module, logits, forced.clamp_min(0))
            experts = torch.where(own, experts, forced)
            weights = torch.where(own, weights.to(forced_w.dtype), forced_w)
            output = (logits, weights, experts)
        if call.capture:
            call.logits[layer], call.experts[layer] = logits, experts
        return output


_SUSPENDED = contextvars.ContextVar("dta_routing_suspended", default=False)


@contextlib.contextmanager
def suspended():
    """Model calls inside are neither forced nor read: a wrapper's own calls made in the
    middle of a walk's call (FSDP's lockstep pads a rank with one-token dummy calls inside
    the decoder call the replay is set for, runtime/engine/lockstep.py)."""
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


def forced_weights(router, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The router's probabilities at ``experts``, normalized as its family does."""
    fam = ROUTER_FAMILIES[type(router).__name__]
    probs = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, experts)
    if fam.normalize == "always" or getattr(router, "norm_topk_prob", False):
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype) if fam.cast_back else w


# ------------------------------------------------------------------- batch checks --
def check_routing(batch, routers: MoERouters, aux_loss: bool = False) -> None:
    """Every sequence's ``routed_experts`` fits the model: one entry per MoE layer, k ids
    each, every id below the number of experts (errors name the sequence and token). With
    the aux loss, every token needs its routing (the last one included)."""
    if batch.routed_experts is None:
        return
    if aux_loss:
        for i, r in enumerate(batch.routed_experts):
            if r.size and r[-1, 0, 0] < 0:
                raise RoutingError(f"{batch.where(i)}: field 'routed_experts' has no routing "
                                   "for the last token; the router aux loss counts every "
                                   "token's experts: give one per token of input_ids")
    routers.require("routing replay (field 'routed_experts')")
    L, k, E = routers.layers, routers.top_k, routers.num_experts
    for i, r in enumerate(batch.routed_experts):
        if r.shape[1:] != (L, k):
            raise RoutingError(f"{batch.where(i)}: field 'routed_experts' has {r.shape[1]} MoE "
                               f"layers x {r.shape[2]} experts per token; {routers.name} has "
                               f"{L} MoE layers routing each token to {k} experts")
        if r.size and int(r.max()) >= E:
            t, layer, _ = np.argwhere(r >= E)[0]
            raise RoutingError(f"{batch.where(i)}: field 'routed_experts' token {t} layer "
                               f"{layer} names expert {int(r[t, layer].max())}; {routers.name} "
                               f"has experts 0..{E - 1}")


def check_shared_routing(batch, tree) -> None:
    """A token the tree shares carries one routing: every sequence through a node must have
    routed its tokens to the same experts (in any order) as the others that routed them.
    Sequences that disagree are an error naming both and the token, raised before anything
    is forwarded (DTA does not split the tree there; see docs/moe.md)."""
    if batch.routed_experts is None:
        return
    routed = [np.sort(r, axis=-1) for r in batch.routed_experts]  # the order of ids is free
    for u in range(1, len(tree)):
        through = tree.through(u)
        if len(through) < 2:
            continue
        s, e = int(tree.start[u]), int(tree.end[u])
        ref, source = _node_rows(routed, tree, u)
        for j in through:
            other = routed[int(j)][s:e]
            known = (other[:, :1, :1] >= 0) & (ref[:, :1, :1] >= 0)  # a last token may be unknown
            diff = np.flatnonzero(((other != ref) & known).reshape(e - s, -1).any(axis=1))
            if len(diff):
                t, first = s + int(diff[0]), int(source[int(diff[0])])
                layer = int(np.flatnonzero((routed[int(j)][t] != routed[first][t]).any(axis=1))[0])
                raise RoutingError(
                    f"{batch.where(first)} and {batch.where(int(j))} share token {t} (the same "
                    f"prefix) but field 'routed_experts' routes it differently in MoE layer "
                    f"{layer}: {routed[first][t, layer].tolist()} vs "
                    f"{routed[int(j)][t, layer].tolist()}; a shared token has one routing")


def _node_rows(routed, tree, u: int) -> tuple[np.ndarray, np.ndarray]:
    """A node's replayed rows [tokens, layers, k] and, per token, the sequence they come
    from: the first sequence through the node that has the token's routing (a sequence may
    lack it for its last token -- SGLang's export -- or for the AReaL adapter's wrap label;
    then a longer sequence through the same token speaks for it; -1 rows: nobody has it,
    the router routes the token itself)."""
    through = [int(x) for x in tree.through(u)]
    s, e = int(tree.start[u]), int(tree.end[u])
    rows = routed[through[0]][s:e]
    source = np.full(e - s, through[0])
    unknown = rows[:, 0, 0] < 0
    if unknown.any():
        rows = rows.copy()
        for j in through[1:]:
            other = routed[j][s:e]
            fill = unknown & (other[:, 0, 0] >= 0)
            rows[fill], source[fill] = other[fill], j
            unknown &= ~fill
            if not unknown.any():
                break
    return rows, source


class NodeRouting:
    """The replayed experts of a walked tree's nodes (the sequences through a node agree on
    them: ``check_shared_routing``)."""

    def __init__(self, batch, tree, device):
        self.routed, self.tree, self.device = batch.routed_experts, tree, device

    def rows(self, tree_nodes) -> torch.Tensor | None:
        """[T, layers, k] for the rows of these nodes, in order (None: no replay)."""
        if self.routed is None:
            return None
        parts = [_node_rows(self.routed, self.tree, int(u))[0] for u in tree_nodes]
        return torch.as_tensor(np.concatenate(parts), device=self.device)


def synthetic_routing(sequences, layers: int, top_k: int, num_experts: int,
                      seed: int = 0) -> list[np.ndarray]:
    """Random replayed routings for tests and ``dta verify --replay``: per sequence
    [tokens, layers, k] distinct expert ids, a function of the token's *prefix* (so
    sequences sharing a prefix agree on it, as one rollout engine's routing does) and of
    ``seed`` -- not of the router, so most differ from what it would pick."""
    import zlib

    out = []
    for seq in sequences:
        h = zlib.crc32(np.int64(seed).tobytes())
        rows = []
        for tok in np.asarray(seq, dtype=np.int64):
            h = zlib.crc32(tok.tobytes(), h)
            rng = np.random.default_rng(h)
            rows.append(np.argsort(rng.random((layers, num_experts)), axis=1)[:, :top_k])
        out.append(np.asarray(rows, dtype=np.int64).reshape(len(rows), layers, top_k))
    return out

"""Pack plans: which tree nodes the walker forwards together in one decoder call (metadata).

A *pack* is a set of tree nodes hanging from one node ``parent`` (0: the virtual root) and
closed upward inside the pack: every node's parent is in the pack or is ``parent``. Its
tokens are forwarded in one call at their true tree positions, attending to the whole cached
prefix (the root path of ``parent``: positions ``0 .. prefix-1``) and, inside the pack, to
their own ancestors only (seed 000's ancestor-only mask restricted to the pack). A pack node
some of whose children lie in other packs is *open*: the pack stays on the walk's path, and
a pack below it attends to exactly the pack tokens on its own path (:meth:`PackLayout.path_rows`).

Packings (:data:`PACKINGS`):

``node``      every node its own pack (the unpacked walk: one call per node);
``siblings``  sibling leaves share packs of at most ``cap`` tokens; internal nodes alone;
``subtrees``  whole subtrees of at most ``cap`` tokens are packs, siblings' small subtrees
              share packs up to ``cap``; bigger internal nodes alone;
``auto``      the cost model (:class:`PackCost`) chooses, bottom-up: a child subtree is closed
              into a pack when that is no dearer than planning it further, closed siblings are
              merged into one pack and a parent absorbs them into its own pack, each merge
              only while it fits the cap and lowers the modelled cost;
``tree``      the whole (active) forest in one pack: the dense tree mask (no cap).

The cost of a pack of T tokens over a prefix of P tokens is
``call + token * T + attention * pairs`` with pairs = T·P + T(T+1)/2 for a single path
(causal, no mask) and T·(P + T) for a pack with branches (a dense masked kernel computes the
whole rectangle). Merging saves a ``call`` (per-call fixed costs: dispatch, element-wise ops,
autograd, kernel launches) and pays the masked-away pairs; the prefix pairs T·P are paid
either way. Everything here is integers and numpy; :mod:`dta.model.packmask` materializes masks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from dta.planning.index import PlanningError
from dta.tree import PrefixTree

PACKINGS = ("node", "siblings", "subtrees", "auto", "tree")
DEFAULT_CAP = 512  # tokens per pack (a memory cap: activations and the [T, P+T] mask)
# recompute keeps one pack's graph alive at a time; a pack's graph per token is heavier than
# an unpacked sequence's (the tree mask, padded GDN chunks, the path's K/V read): measured on
# the tau2 "small" batch (qwen3_5 small, experiments/hybrid_memory.py), one 854-token pack's
# step peaked above one-sequence-at-a-time training of the 854-token longest sequence (290 vs
# 234 MB live), a 512-token pack below it (215 MB). So the default cap under recompute is
# the longest sequence over RECOMPUTE_CAP_DIVISOR (never below DEFAULT_CAP).
RECOMPUTE_CAP_DIVISOR = 2
# Per-call fixed cost in tokens of linear work. Measured on the 2-core CPU with the "small"
# model: a decoder forward + backward call costs ~13 ms beyond its matmuls, ~50-60 tokens'
# worth (GPU launch overhead on short nodes makes it larger).
DEFAULT_CALL_TOKENS = 64


# Recurrent (Gated DeltaNet) layers, per GDN layer of a hybrid model, in tokens of linear
# work (see PackCost.chunk_step): a GDN layer call's fixed cost (its ~40 element-wise ops, the
# chunk plan's gathers and the batched intra-chunk solves, forward and backward) and one
# sequential step of its chunk scan (~8 small ops forward, ~16 backward).
DEFAULT_GDN_CALL_TOKENS = 8
DEFAULT_GDN_STEP_TOKENS = 2


@dataclass(frozen=True)
class PackCost:
    """``cost(pack) = call + token * tokens + attention * (query, key) pairs
    + chunk_step * chunk steps``.

    Hybrid models: a GDN layer runs a pack as one batched chunked delta rule whose scan takes
    one sequential step per chunk of the pack's deepest chain (``dta/model/gdn.py``); the plan does
    not track chains, so a pack of T tokens is charged ceil(T / chunk) steps, an upper bound
    (exact for a one-segment chain; rows of a branched pack run side by side). ``call``
    includes the GDN layers' per-call cost."""

    token: float = 1.0
    attention: float = 0.0
    call: float = float(DEFAULT_CALL_TOKENS)
    chunk_step: float = 0.0  # cost of one chunk step of all GDN layers (0: no GDN layer)
    chunk: int = 64  # the delta rule's chunk

    @classmethod
    def from_config(cls, config: Any, call_tokens: float = DEFAULT_CALL_TOKENS) -> "PackCost":
        """FLOPs of the decoder body (forward + backward) from a model config; the LM head is
        left out (every plan evaluates the same head rows). Hybrid models add their GDN
        layers' per-call and per-chunk-step costs (:data:`DEFAULT_GDN_CALL_TOKENS`,
        :data:`DEFAULT_GDN_STEP_TOKENS` per GDN layer)."""
        from dta.planning.cost import GDN_CHUNK, CostModel

        body = dict(config) if isinstance(config, Mapping) else config.to_dict()
        cm = CostModel.from_config({**body, "vocab_size": 0})
        gdn = list(body.get("layer_types") or []).count("linear_attention")
        call = float(call_tokens) + gdn * DEFAULT_GDN_CALL_TOKENS
        return cls(cm.token, cm.attention, call * cm.token,
                   gdn * DEFAULT_GDN_STEP_TOKENS * cm.token, GDN_CHUNK)

    def pairs(self, tokens: int, prefix: int, chain: bool) -> float:
        t = float(tokens)
        return t * prefix + t * (t + 1) / 2 if chain else t * (prefix + t)

    def of(self, tokens: int, prefix: int, chain: bool) -> float:
        cost = self.call + self.token * tokens + self.attention * self.pairs(tokens, prefix, chain)
        if self.chunk_step:
            cost += self.chunk_step * -(-int(tokens) // self.chunk)
        return cost


@dataclass
class Pack:
    index: int
    nodes: list[int]  # tree node ids, in pre-order
    parent: int  # the tree node the pack's roots hang from (0: the virtual root)
    prefix: int  # cached tokens before the pack (= end[parent] = start of every root)
    tokens: int
    chain: bool  # the nodes form one path: plain causal attention, no mask
    open: list[int] = field(default_factory=list)  # nodes with children in other packs
    children: list[int] = field(default_factory=list)  # packs below, in walk order


@dataclass(frozen=True)
class PackLayout:
    """Where a pack's tokens sit and what each sees (integers only).

    Row r of the pack is local node ``node[r]`` at tree position ``positions[r]``; local
    nodes are in pre-order, ``enter[a] <= enter[b] < exit[a]`` iff a is b's ancestor or b.
    Row q sees every cached key (positions ``0 .. prefix-1``) and pack row k iff node[k] is
    an ancestor of (or is) node[q] and positions[k] <= positions[q].
    """

    prefix: int
    positions: np.ndarray  # [T]
    node: np.ndarray  # [T] local node of each row
    offsets: np.ndarray  # [m + 1] rows of local node i: offsets[i] .. offsets[i+1]-1
    enter: np.ndarray  # [m]
    exit: np.ndarray  # [m]
    chain: bool
    tree_nodes: np.ndarray  # [m] tree node id of each local node
    open: np.ndarray | None = None  # local nodes with children in other packs (None: unknown)

    @property
    def tokens(self) -> int:
        return len(self.positions)

    def rows(self, local: int) -> slice:
        return slice(int(self.offsets[local]), int(self.offsets[local + 1]))

    def path_rows(self, local: int) -> np.ndarray:
        """Rows of the pack's tokens on the root path through local node ``local`` (its
        ancestors in the pack and itself), in position order."""
        anc = np.flatnonzero((self.enter <= self.enter[local]) & (self.enter[local] < self.exit))
        return np.concatenate([np.arange(self.offsets[a], self.offsets[a + 1]) for a in anc])

    def visible(self, window: int | None = None) -> np.ndarray:
        """[T, prefix + T] bool, True = visible (numpy; for checks and small packs)."""
        T, P = self.tokens, self.prefix
        q = self.positions[:, None]
        nq, nk = self.node[:, None], self.node[None, :]
        inner = ((self.enter[nk] <= self.enter[nq]) & (self.enter[nq] < self.exit[nk])
                 & (self.positions[None, :] <= q))
        out = np.concatenate([np.ones((T, P), bool), inner], axis=1)
        if window is not None:
            kpos = np.concatenate([np.arange(P), self.positions])[None, :]
            out &= (q - kpos) < window
        return out


class PackPlan:
    """A partition of the active tree nodes into packs, and the order the walker visits them."""

    def __init__(self, tree: PrefixTree, packs: list[Pack], packing: str, cap: int | None):
        self.tree, self.packs, self.packing, self.cap = tree, packs, packing, cap
        self.pack_of = np.full(len(tree), -1, dtype=np.int64)
        for p in packs:
            self.pack_of[p.nodes] = p.index
        for p in packs:
            p.children = []
        self.roots = []
        for p in sorted(packs, key=lambda p: p.nodes[0]):  # pre-order of the first node
            (self.roots if p.parent == 0 else packs[self.pack_of[p.parent]].children).append(p.index)
        for p in packs:
            p.open = sorted({int(tree.parent[packs[c].nodes[0]]) for c in p.children})
        self._check()

    def _check(self) -> None:
        tree = self.tree
        for p in self.packs:
            inside = set(p.nodes)
            for u in p.nodes:
                par = int(tree.parent[u])
                if par not in inside and par != p.parent:
                    raise PlanningError(f"pack {p.index}: node {u} hangs from {par}, outside "
                                        f"the pack and not its parent {p.parent}")
            if p.prefix != int(tree.end[p.parent]) if p.parent else p.prefix != 0:
                raise PlanningError(f"pack {p.index}: prefix {p.prefix} != end of its parent")

    def __len__(self) -> int:
        return len(self.packs)

    def layout(self, index: int) -> PackLayout:
        p, tree = self.packs[index], self.tree
        nodes = np.asarray(p.nodes, dtype=np.int64)
        lengths = tree.end[nodes] - tree.start[nodes]
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        local = {int(u): i for i, u in enumerate(nodes)}
        size = np.ones(len(nodes), dtype=np.int64)  # local subtree sizes (pre-order)
        for i in range(len(nodes) - 1, 0, -1):
            par = local.get(int(tree.parent[nodes[i]]))
            if par is not None:
                size[par] += size[i]
        enter = np.arange(len(nodes), dtype=np.int64)
        positions = np.concatenate([np.arange(tree.start[u], tree.end[u]) for u in nodes])
        return PackLayout(p.prefix, positions, np.repeat(enter, lengths), offsets, enter,
                          enter + size, p.chain, nodes,
                          np.asarray([local[int(u)] for u in p.open], dtype=np.int64))

    def walk(self):
        """('push', pack) in pre-order, ('pop', pack) after its children (open packs only)."""
        stack = [(i, False) for i in reversed(self.roots)]
        while stack:
            i, done = stack.pop()
            if done:
                yield "pop", i
                continue
            yield "push", i
            if self.packs[i].children:
                stack.append((i, True))
                stack.extend((c, False) for c in reversed(self.packs[i].children))

    def stats(self) -> dict:
        tokens = [p.tokens for p in self.packs]
        return dict(packing=self.packing, cap=self.cap, packs=len(self.packs),
                    nodes=int(sum(len(p.nodes) for p in self.packs)),
                    open_packs=sum(bool(p.children) for p in self.packs),
                    masked_packs=sum(not p.chain for p in self.packs),
                    max_pack_tokens=max(tokens, default=0),
                    mean_pack_tokens=float(np.mean(tokens)) if tokens else 0.0)


# ------------------------------------------------------------------------ planning --
def default_cap(tree: PrefixTree, policy: str) -> int:
    """The pack cap when none is given: a memory cap. *retain* keeps the graph of every pack
    on the walk's path (they add up): :data:`DEFAULT_CAP`. *recompute* keeps one pack's graph
    alive at a time, so its pack may grow with the batch's longest sequence (which unpacked
    training holds in one graph anyway): longest // :data:`RECOMPUTE_CAP_DIVISOR`, at least
    :data:`DEFAULT_CAP` -- fewer, longer packs on long-sequence batches (fewer decoder calls)."""
    if policy != "recompute":
        return DEFAULT_CAP
    longest = int(np.max(tree.end)) if len(tree) else 0
    return max(DEFAULT_CAP, longest // RECOMPUTE_CAP_DIVISOR)


def plan_packs(tree: PrefixTree, packing: str, *, cap: int = DEFAULT_CAP,
               cost: PackCost | None = None, active: np.ndarray | None = None,
               branches: bool = True) -> PackPlan:
    """Partition the ``active`` nodes of ``tree`` (default: all) into packs (module doc).
    ``branches=False``: single-path packs only (a model whose layers cannot take a tree
    mask: a pack is then one node, or a node with its only child's chain)."""
    if packing not in PACKINGS:
        raise PlanningError(f"unknown packing {packing!r}; choose one of {PACKINGS}")
    if packing == "tree" and not branches:
        raise PlanningError("packing 'tree' needs a tree mask, which this model cannot take")
    if isinstance(cap, bool) or int(cap) != cap or cap < 1:
        raise PlanningError(f"pack cap must be a positive number of tokens, got {cap!r}")
    cap, cost = int(cap), cost or PackCost()
    m = len(tree)
    active = np.ones(m, bool) if active is None else np.asarray(active, bool)
    if active.shape != (m,):
        raise PlanningError(f"active has shape {active.shape}, the tree has {m} nodes")
    kids = [[c for c in tree.children[u] if active[c]] for u in range(m)]
    seg = (tree.end - tree.start).astype(np.int64)
    sub = seg.copy()  # tokens of the active subtree
    chain = np.ones(m, bool)  # the active subtree is one path
    for u in range(m - 1, 0, -1):  # pre-order ids: children after parents
        if active[u]:
            p = int(tree.parent[u])
            if p:
                sub[p] += sub[u]
    for u in range(m - 1, -1, -1):
        chain[u] = len(kids[u]) == 0 or (len(kids[u]) == 1 and chain[kids[u][0]])
    if packing == "tree":
        nodes = [u for u in range(1, m) if active[u]]
        top = kids[0]
        packs = [Pack(0, nodes, 0, 0, int(seg[nodes].sum()), len(top) == 1 and bool(chain[top[0]]))] \
            if nodes else []
        return PackPlan(tree, packs, packing, None)

    # bottom-up: best[u] = modelled cost of u's subtree with u heading a pack; choice[u] =
    # (child subtrees absorbed into u's pack, bins of closed child subtrees, own children)
    best = np.zeros(m)
    closed = np.full(m, np.inf)
    head = _Heads(m)  # u's own pack: tokens, one path?, modelled cost
    choice: dict[int, tuple] = {}
    for u in range(m - 1, -1, -1):
        if not active[u] or u == 0:
            continue
        s = int(tree.start[u])
        if sub[u] <= cap and packing in ("subtrees", "auto"):
            closed[u] = cost.of(int(sub[u]), s, bool(chain[u]))
        if not branches and not chain[u]:
            closed[u] = np.inf
        best[u], choice[u] = _plan_children(kids[u], int(seg[u]), int(tree.end[u]), s, packing,
                                            cap, cost, sub, chain, best, closed, kids, True,
                                            branches, head, u)
    _, choice[0] = _plan_children(kids[0], 0, 0, 0, packing, cap, cost, sub, chain, best, closed,
                                  kids, False, branches)
    packs: list[Pack] = []

    def subtree_nodes(c):
        out, todo = [], [c]
        while todo:
            v = todo.pop()
            out.append(v)
            todo.extend(reversed(kids[v]))
        return out

    def emit(parent, prefix, nodes, is_chain):
        nodes = sorted(nodes)
        packs.append(Pack(len(packs), nodes, parent, prefix, int(seg[nodes].sum()), is_chain))

    def head_pack(u):
        """u's own pack: u, the subtrees it absorbed, and the head packs of the children it
        merged (a chain segment with open nodes), recursively; and the packs hanging below
        (bins of closed subtrees, from u or a merged child)."""
        absorbed, bins, own, merged = choice[u]
        nodes = [u] + [v for c in absorbed for v in subtree_nodes(c)]
        below = [(u, b) for b in bins]
        heads = list(own)
        for c in merged:
            n, b, h = head_pack(c)
            nodes += n
            below += b
            heads += h
        return nodes, below, heads

    todo = [0]
    while todo:
        u = todo.pop()
        if u:
            nodes, below, heads = head_pack(u)
            emit(int(tree.parent[u]), int(tree.start[u]), nodes, bool(head.chain[u]))
        else:
            below, heads = [(0, b) for b in choice[0][1]], list(choice[0][2])
        for v, b in below:
            emit(v, int(tree.end[v]) if v else 0, [x for c in b for x in subtree_nodes(c)],
                 _chain(b, chain))
        todo.extend(heads)
    return PackPlan(tree, packs, packing, cap)


class _Heads:
    """Per node u, the pack u heads (u, its absorbed subtrees, its merged children's head
    packs): tokens, whether it is one path, and its modelled cost."""

    def __init__(self, m: int):
        self.tokens = np.zeros(m, dtype=np.int64)
        self.chain = np.ones(m, bool)
        self.cost = np.zeros(m)


def _plan_children(kids, seg_u, end_u, start_u, packing, cap, cost, sub, chain, best, closed,
                   all_kids, has_head, branches=True, head=None, u=None):
    """Plan u's children: which close into packs (grouped in bins), which u absorbs into its
    own pack, which head their own plans -- and (auto) which of those u's pack merges with
    (their head pack joins u's; what hangs below them stays below). Returns (modelled cost,
    choice = (absorbed, bins, own, merged))."""
    if packing == "node" or (packing == "siblings" and not branches):
        items, own = [], list(kids)
    elif packing == "siblings":
        items = [c for c in kids if not all_kids[c] and sub[c] <= cap]
        own = [c for c in kids if c not in items]
    else:  # subtrees, auto: a child closes when it fits (auto: and is no dearer closed)
        items = [c for c in kids if np.isfinite(closed[c]) and (packing == "subtrees" or closed[c] <= best[c])]
        own = [c for c in kids if c not in items]
    prefix = end_u
    bins: list[list[int]] = []
    btok: list[int] = []
    for c in sorted(items, key=lambda c: -int(sub[c])):  # first-fit decreasing
        t, placed = int(sub[c]), False
        for k in range(len(bins) if branches else 0):  # two items in a bin: a branch
            if btok[k] + t > cap:
                continue
            if packing == "auto":
                apart = cost.of(btok[k], prefix, _chain(bins[k], chain)) + cost.of(t, prefix, bool(chain[c]))
                if cost.of(btok[k] + t, prefix, False) >= apart:
                    continue
            bins[k].append(c)
            btok[k] += t
            placed = True
            break
        if not placed:
            bins.append([c])
            btok.append(t)
    absorbed: list[int] = []
    head_tok, head_chain = seg_u, True
    if has_head and packing == "auto":
        for k in sorted(range(len(bins)), key=lambda k: -btok[k]):
            if head_tok + btok[k] > cap:
                continue
            if not branches and (absorbed or not _chain(bins[k], chain)):
                continue
            together_chain = head_chain and not absorbed and _chain(bins[k], chain)
            apart = cost.of(head_tok, start_u, head_chain) + cost.of(btok[k], prefix, _chain(bins[k], chain))
            if cost.of(head_tok + btok[k], start_u, together_chain) < apart:
                absorbed += bins[k]
                head_tok += btok[k]
                head_chain = together_chain
                bins[k] = []
        bins = [b for b in bins if b]
    merged: list[int] = []
    rest = 0.0  # the merged children's subtrees outside their head packs
    if has_head and packing == "auto":
        # a chain segment: u's pack takes a child's own head pack (saving a call) while it
        # fits the cap and lowers the cost; the child becomes an open node of u's pack
        for c in sorted(own, key=lambda c: int(head.tokens[c])):
            t = int(head.tokens[c])
            if head_tok + t > cap:
                continue
            together_chain = head_chain and not absorbed and not merged and bool(head.chain[c])
            if not branches and not together_chain:
                continue
            apart = cost.of(head_tok, start_u, head_chain) + head.cost[c]
            if cost.of(head_tok + t, start_u, together_chain) < apart:
                merged.append(c)
                rest += best[c] - head.cost[c]
                head_tok += t
                head_chain = together_chain
        own = [c for c in own if c not in merged]
    total = (cost.of(head_tok, start_u, head_chain) if has_head else 0.0)
    if has_head and head is not None:
        head.tokens[u], head.chain[u], head.cost[u] = head_tok, head_chain, total
    total += rest
    total += sum(cost.of(sum(int(sub[c]) for c in b), prefix, _chain(b, chain)) for b in bins)
    total += sum(best[c] for c in own)
    for b in bins:
        b.sort()
    return total, (sorted(absorbed), sorted(bins, key=lambda b: b[0]), sorted(own), sorted(merged))


def _chain(members, chain) -> bool:
    return len(members) == 1 and bool(chain[members[0]])

"""The depth-first walk over a prefix tree: exact gradients, one root-to-leaf path at a time.

The unit of the walk is a *pack* (``dta/planning/packs.py``): one node, sibling leaves, or a
small subtree, forwarded in one decoder call at its true tree positions, attending to the
cached K/V of its path and, inside the pack, to its own ancestors only.

    push(P)   forward P's tokens once, attending to the path's K/V (held as autograd leaves);
              queue P's loss terms for the LM head.
    leaf(P)   a pack with no packs below it: backpropagate its loss as soon as its head rows
              are evaluated (several leaf packs in one backward call).
    pop(P)    after the packs below it: backpropagate P's loss together with the K/V gradients
              its descendants left in P's K/V leaves, then free P.

Why it is exact: a descendant depends on P's parameters only through P's K/V, so
d(loss)/dθ = Σ_P [∂ own_loss_P/∂θ + (∂ K/V_P/∂θ)ᵀ · Σ_desc ∂ loss_desc/∂ K/V_P]; the second
sum is what accumulates in the leaves' ``.grad`` (descendants' backward passes add into it,
through the rows of P that lie on their path).

The LM head (``dta/model/head.py``) evaluates the queued rows of several packs in one call --
flushed before a pop needs them, or at ``head_rows`` -- and keeps only ∂L/∂hidden, so no
[tokens, vocab] graph ever waits on the path. Everything the walk assumes about the model
(embedding leaves, per-layer states, the logit transform) lives in ``dta/model/modeling.py``; a
pack's cache (the path's K/V pieces, joined once) and its mask are ``dta/model/attention.py`` and
``dta/model/packmask.py``. A model with recurrent layers (Gated DeltaNet) is packed the same way:
its recurrent layers follow the pack's local tree through the model interface
(``dta/model/gdn.py``: every row starts from its parent's final state).

Blocks (``dta/planning/blocks.py``): before packing, a node longer than ``block_tokens`` is
cut into a chain of pieces, each a node whose parent is the previous piece, and no pack is
longer than a block; the walk below runs on the cut tree unchanged (``plan.tree``), so no
call -- and under *recompute* no graph -- is longer than one block.

MoE (docs/moe.md): a record's replayed experts are forced in every router during a pack's
forward (``dta/model/routing.py``, a model-interface fact: ``routes``); the router's load-balancing
loss (``dta/model/router_aux.py``: ``aux``) reads each pack's routing at push, lets the sequences
ending in it carry their per-token coefficients up the path, and adds each pack's surrogate
to its backward at leaf() or pop(), like the K/V gradients.

Memory policies: *retain* keeps each pack's graph along the current path, plus the leaf packs
waiting for a head flush (at most ``head_rows`` tokens of them); *recompute* keeps only the
detached K/V (and ∂L/∂hidden) and re-forwards the pack with grad at pop (AReaL-DTA's choice):
one graph alive at a time (its leaf packs are flushed at once; the detached head rows of the
open packs are still batched). Where the attention over the path is split at the cache
boundary (CPU), the pack's first forward also keeps each layer's attention output on a tape
(``dta.model.split_attention.Tape``, about the size of its K/V), and the re-forward takes it back
instead of attending over the whole path again.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from dta.model.attention import native_gqa, taped
from dta.model.head import HeadQueue, LMHead
from dta.model.lora import check_peft_model
from dta.model.modeling import ModelInterface, NodeState, check_router_aux_loss
from dta.objective import NodeTerms, Objective, Recorder
from dta.model.packmask import mask_support, pack_mask
from dta.planning.blocks import DEFAULT_BLOCK_TOKENS, check_block_tokens, cut_blocks
from dta.planning.index import PlanningError
from dta.planning.packs import PackCost, PackLayout, PackPlan, default_cap, plan_packs
from dta.model.router_aux import router_aux
from dta.model.routing import NodeRouting, check_shared_routing
from dta.model.split_attention import Tape
from dta.tree import PrefixTree

POLICIES = ("retain", "recompute")


@dataclass
class Frame:
    pack: int
    layout: PackLayout
    state: NodeState  # the pack's own per-layer state (K/V): detached leaves its descendants read
    job: object  # its head rows (∂L/∂hidden once flushed)
    graph: tuple | None = None  # retain: (hidden, K/V) still attached to the pack's graph
    tape: Tape | None = None  # recompute: the attention results its re-forward takes back
    pieces: tuple | None = None  # (tree node, per-layer (k, v) rows on the path through it)


@dataclass
class WalkResult:
    loss: float = 0.0  # the router's aux loss included (``aux_loss``)
    aux_loss: float = 0.0  # the router's load-balancing loss, coef and weights applied
    nodes: int = 0  # nodes forwarded (first time)
    tokens: int = 0  # tokens forwarded (first time)
    recomputed_tokens: int = 0  # tokens forwarded again at pop (recompute policy)
    max_live_graphs: int = 0  # most pack graphs alive at once
    max_graph_tokens: int = 0  # most tokens whose graphs are alive at once
    max_call_tokens: int = 0  # longest decoder call (recompute: pops included)
    max_path: int = 0  # deepest stack of K/V frames
    packs: int = 0
    masked_packs: int = 0  # packs with branches (forwarded with a tree mask)
    forward_calls: int = 0  # decoder calls (recompute: pops included)
    backward_calls: int = 0  # autograd.backward calls
    head_calls: int = 0  # LM-head evaluations (flushes)
    plan: dict = field(default_factory=dict)
    logprobs: list | None = None  # per sequence [n] (index j predicts token j; 0 at j=0)
    entropy: list | None = None
    vocab_min: list | None = None
    vocab_max: list | None = None

    def calls(self) -> dict:
        return dict(packs=self.packs, masked_packs=self.masked_packs, nodes=self.nodes,
                    forward_calls=self.forward_calls, backward_calls=self.backward_calls,
                    head_calls=self.head_calls)


def _from_output(hidden, dhidden):
    """A pack's backward starts at its output: the head's gradient, or zeros when only the
    router aux loss reaches the pack (its surrogate enters the decoder at the routers; a
    backward that does not pass the decoder's output is invisible to a wrapper of the
    decoder, e.g. FSDP's lockstep, runtime/sharding/lockstep.py). Zeros add nothing."""
    return dhidden if dhidden is not None else torch.zeros_like(hidden)


class Walker:
    """Walks a PrefixTree with a Hugging Face causal LM whose forward takes a K/V cache.

    packing: a pack policy of :func:`dta.planning.packs.plan_packs` (``node`` walks node by
    node, ``tree`` forwards the whole tree in one masked call); pack_tokens: the cap of a pack
    (None: :func:`dta.planning.packs.default_cap`, by memory policy and the longest sequence);
    head_rows: queued head rows that force a flush (default ``logits_chunk``; 0: every pack's
    head at its push); pack_cost: the cost model of ``auto`` (default: the model's FLOPs);
    native_gqa: run ``sdpa`` models on ``dta_sdpa`` during the walk (``dta.model.attention``: SDPA's
        grouped-query path, and forwards over cached keys split at the cache boundary).
    block_tokens: the longest piece of a node forwarded in one call (``dta.planning.blocks``;
    default 2,048; None or 0: nodes are never cut); packs are capped at it too.
    router_aux_loss_coef: > 0 adds the router's load-balancing loss of every sequence, as
    per-sequence training does (``dta/model/router_aux.py``, docs/moe.md); 0 (default): off.
    router_aux_loss: with the coefficient 0, "refuse" (default) raises at ``train`` when a MoE
    config asks for the load-balancing loss; "exclude" trains the policy loss without it (see
    ``dta.model.modeling.check_router_aux_loss``). A record's ``routed_experts`` are replayed in
    every MoE layer (``dta/model/routing.py``). The walker does not probe the model: the
    trainer's entry points (``dta.train``) run ``dta.selfcheck`` before they build one.
    """

    def __init__(self, model, *, policy: str = "retain", logits_chunk: int = 1024,
                 temperature: float = 1.0, router_aux_loss: str = "refuse",
                 router_aux_loss_coef: float = 0.0,
                 packing: str = "auto", pack_tokens: int | None = None,
                 block_tokens: int | None = DEFAULT_BLOCK_TOKENS, head_rows: int | None = None,
                 pack_cost: PackCost | None = None, native_gqa: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"unknown memory policy {policy!r}; choose one of {POLICIES}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        check_router_aux_loss(model, "exclude")  # validates the option's value only
        if not router_aux_loss_coef >= 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {router_aux_loss_coef}")
        check_peft_model(model)  # LoRA only, no dropout (dta/model/lora.py)
        self.model, self.policy, self.router_aux_loss = model, policy, router_aux_loss
        self.io = ModelInterface(model)
        self.router_aux_loss_coef = float(router_aux_loss_coef)
        if self.router_aux_loss_coef > 0:
            self.io.moe.require(f"router_aux_loss_coef={router_aux_loss_coef}")
        self.head = LMHead(model, temperature=temperature, chunk=logits_chunk)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # a model whose attention cannot take a tree mask gets single-path packs only
        self.packing = packing
        self.mask_support = mask_support(model)
        self.branches = self.mask_support[0] is not None
        self.block_tokens = check_block_tokens(block_tokens)
        self.pack_tokens = None if pack_tokens is None else \
            min(int(pack_tokens), self.block_tokens or int(pack_tokens))
        self.head_rows = int(logits_chunk if head_rows is None else head_rows)
        self.pack_cost = pack_cost or PackCost.from_config(model.config)
        self.native_gqa = native_gqa

    def plan(self, tree: PrefixTree, active: np.ndarray | None = None) -> PackPlan:
        """The pack plan of ``tree`` cut into blocks: ``plan.tree`` is the tree walked."""
        cut, origin = cut_blocks(tree, self.block_tokens)
        cap = self.pack_tokens
        if cap is None:
            cap = default_cap(tree, self.policy)
            cap = min(cap, self.block_tokens or cap)
        plan = plan_packs(cut, self.packing, cap=cap, cost=self.pack_cost,
                          active=None if active is None else active[origin],
                          branches=self.branches)
        longest = max((p.tokens for p in plan.packs), default=0)
        if self.block_tokens and longest > self.block_tokens:  # the 'tree' policy: no cap
            raise PlanningError(f"pack policy {self.packing!r} forwards {longest} tokens in one "
                                f"call, more than block_tokens={self.block_tokens}; use "
                                "block_tokens=0 (no cut) or another pack policy")
        return plan

    # --------------------------------------------------------------------- the model --
    def _forward(self, tree: PrefixTree, layout: PackLayout, path: list[Frame], routes: NodeRouting,
                 capture: bool = False, tape: Tape | None = None):
        """The pack's last hidden states [T, H], its own new per-layer state, and its routing
        (``dta.model.routing.RouterCall``: the replayed experts forced, the routers read). ``tape``:
        the attention over the path kept (first forward) or taken back (re-forward)."""
        ids = np.concatenate([tree.tokens(int(u)) for u in layout.tree_nodes])
        ids = torch.as_tensor(ids, device=self.device)
        pos = torch.as_tensor(layout.positions, device=self.device).unsqueeze(0)
        cache = self.io.pack_cache(self._path_pieces(tree, layout, path), layout)
        mask = pack_mask(layout, self.model, self.device, self.dtype, self.mask_support)
        with self.io.moe.call(routes.rows(layout.tree_nodes), capture) as routed, taped(tape):
            out = self.io.decoder(position_ids=pos, attention_mask=mask, use_cache=True,
                                  **self.io.embed(ids.unsqueeze(0)), **{self.io.cache_kwarg: cache})
        P = layout.prefix
        return out.last_hidden_state[0], self.io.node_state(cache, P, P + layout.tokens), routed

    def _path_pieces(self, tree: PrefixTree, layout: PackLayout, path: list[Frame]):
        """Per layer, the path's K/V pieces covering positions 0..prefix-1: in each frame, the
        rows on the root path through the node the next frame (or this pack) hangs from."""
        if not path:
            if layout.prefix:
                raise RuntimeError("a pack below the root was pushed without its path")
            return None
        through = [int(tree.parent[f.layout.tree_nodes[0]]) for f in path[1:]]
        through.append(int(tree.parent[layout.tree_nodes[0]]))
        per_frame = []
        for f, node in zip(path, through):
            if f.pieces is None or f.pieces[0] != node:
                kv, reusable = self._rows_through(f, node)
                f.pieces = (node, kv) if reusable else None
                per_frame.append(kv)
            else:
                per_frame.append(f.pieces[1])
        covered = sum(self.io.covered(kv) for kv in per_frame)
        if covered != layout.prefix:
            raise RuntimeError(f"the path's K/V cover {covered} positions, the pack starts at "
                               f"{layout.prefix}")
        return [[kv[layer] for kv in per_frame] for layer in range(len(self.io.layer_kinds))]

    def _rows_through(self, f: Frame, node: int):
        """Frame ``f``'s per-layer state as a pack below tree node ``node`` reads it (K/V rows
        on the root path through it; a recurrent layer's final state at it), and whether
        later packs may reuse it (``ModelInterface.state_through``)."""
        local = int(np.flatnonzero(f.layout.tree_nodes == node)[0])
        with torch.enable_grad():  # kept for later forwards with grad (recompute)
            return self.io.state_through(f.state, f.layout, local)

    def _terms(self, tree, layout: PackLayout, objective: Objective, record: bool) -> NodeTerms:
        return NodeTerms.concat([
            (objective.terms(tree, int(u), self.device, self.dtype, record=record),
             int(layout.offsets[i])) for i, u in enumerate(layout.tree_nodes)])

    # ---------------------------------------------------------------------- the walk --
    def train(self, tree: PrefixTree, objective: Objective, *, record: bool = False,
              progress=None) -> WalkResult:
        """Accumulate into the parameters' ``.grad`` the gradient of the objective."""
        check_router_aux_loss(self.model, "exclude" if self.router_aux_loss_coef > 0
                              else self.router_aux_loss)
        check_shared_routing(objective.batch, tree)  # before anything is forwarded
        with self._walking():
            return self._train(tree, objective, record, progress)

    @contextlib.contextmanager
    def _walking(self):
        """A walk's scope: attention on SDPA's native grouped-query path, and the head's
        logits workspace released when the walk ends (also when it raises)."""
        try:
            with native_gqa(self.model, self.native_gqa), self.io.walking():
                yield
        finally:
            self.head.release()

    def _train(self, tree, objective, record, progress) -> WalkResult:
        res = WalkResult()
        plan = self.plan(tree, self._active(tree, objective, self.router_aux_loss_coef > 0))
        tree, res.plan = plan.tree, self._stats(plan, tree)
        rec = Recorder(tree, self.device, self.dtype) if record else None
        routes = NodeRouting(objective.batch, tree, self.device)
        aux = router_aux(self.router_aux_loss_coef, tree, objective, self.io.moe)
        need_ent = objective.loss.uses_entropy
        queue = HeadQueue()
        path: list[Frame] = []
        waiting: list[tuple] = []  # leaf packs: (hidden with graph, head job, tokens, aux pairs)

        def evaluate(hidden, terms):
            """One LM-head call over the queued rows: loss value and ∂L/∂hidden."""
            out = self.head.evaluate(hidden, terms, lambda *a: objective.node_loss(terms, *a),
                                     need_entropy=need_ent, entropy=record)
            res.head_calls += 1
            if rec is not None:
                rec.add(terms, out.logp, out.entropy)
            if out.loss is not None:
                res.loss += out.loss
            return out.dhidden

        def backward(outs, grads):
            # an output nothing trainable reached this time (a frozen base, an expert's
            # adapter no token was routed to) has no gradient to pass on
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward(*map(list, zip(*pairs)))
                res.backward_calls += 1
            self.io.collect_embedding_grads()

        def flush():
            """Evaluate the queued head rows, then leaf() every waiting leaf pack."""
            queue.flush(evaluate)
            if waiting:
                leaf([(h, job.dhidden, extra) for h, job, _, extra in waiting])
                waiting.clear()

        def leaf(done):
            """Backpropagate leaf packs (their own loss only) in one backward call."""
            pairs = [(h, _from_output(h, d)) for h, d, x in done if d is not None or x] + \
                [p for *_, x in done for p in x]
            backward([o for o, _ in pairs], [g for _, g in pairs])

        def push(i):
            pack, layout = plan.packs[i], plan.layout(i)
            is_leaf = not pack.children
            res.packs += 1
            res.masked_packs += not layout.chain
            res.nodes += len(pack.nodes)
            res.tokens += layout.tokens
            res.forward_calls += 1
            terms = self._terms(tree, layout, objective, record)
            # a leaf pack with nothing to backpropagate (no head row, no aux loss: e.g. only
            # the AReaL adapter's wrap label of a strict prefix) keeps no graph
            graph = not terms.empty or aux.capture if is_leaf else self.policy == "retain"
            tape = Tape() if self.policy == "recompute" and not is_leaf else None
            with torch.set_grad_enabled(graph or self.policy == "retain"):
                hidden, state, routed = self._forward(tree, layout, path, routes, aux.capture, tape)
            aux_pairs = aux.pushed(i, layout, path, routed, is_leaf)  # the router's aux loss
            job = queue.add(hidden, terms)
            kept = [f.layout.tokens for f in path] + [w[2] for w in waiting] \
                if self.policy == "retain" else []  # graphs alive besides this one
            res.max_live_graphs = max(res.max_live_graphs, len(kept) + 1)
            res.max_graph_tokens = max(res.max_graph_tokens, layout.tokens + sum(kept))
            res.max_call_tokens = max(res.max_call_tokens, layout.tokens)
            if is_leaf:
                waiting.append((hidden, job, layout.tokens, aux_pairs))
                # recompute keeps one graph alive: its leaf packs do not wait for a flush
                if self.policy == "recompute" or queue.rows >= self.head_rows \
                        or sum(w[2] for w in waiting) >= max(self.head_rows, 1):
                    flush()
                return
            leaves = self.io.state_leaves(state)  # leaves where a gradient can flow
            graph = (hidden, state) if self.policy == "retain" else None
            path.append(Frame(i, layout, leaves, job, graph, tape))
            res.max_path = max(res.max_path, len(path))
            if self.head_rows <= 0:
                flush()

        def pop(i):
            flush()  # the pack's own head rows, and its leaf packs' backward passes
            frame = path.pop()
            if self.policy == "recompute":  # re-forward with grad; the head is not re-run,
                # the attention over the path is taken back from the tape
                hidden, state, routed = self._forward(tree, frame.layout, path, routes,
                                                      aux.capture, frame.tape)
                res.recomputed_tokens += frame.layout.tokens
                res.forward_calls += 1
                res.max_live_graphs = max(res.max_live_graphs, 1)
                res.max_graph_tokens = max(res.max_graph_tokens, frame.layout.tokens)
            else:
                (hidden, state), routed = frame.graph, None
            aux_pairs = aux.popped(frame.pack, routed)  # the router's aux loss
            dhidden = frame.job.dhidden
            outs, grads = ([hidden], [_from_output(hidden, dhidden)]) \
                if dhidden is not None or aux_pairs else ([], [])
            for out, grad in aux_pairs:
                outs.append(out)
                grads.append(grad)
            # the K/V gradients its descendants left (context parallel: every rank's slice gathered)
            for out, grad in self.io.state_grads(state, frame.state):
                outs.append(out)
                grads.append(grad)
            backward(outs, grads)

        for kind, i in plan.walk():
            push(i) if kind == "push" else pop(i)
            if progress is not None and kind == "push":
                progress(plan.packs[i].tokens)
        flush()
        res.aux_loss = aux.value
        res.loss += aux.value
        if rec is not None:
            res.logprobs, res.entropy = rec.split()
        return res

    @torch.no_grad()
    def forward(self, tree: PrefixTree, batch, *, minmax: bool = False, progress=None) -> WalkResult:
        """Forward-only walk: per-sequence, per-token log-probs and entropy, K/V reused."""
        objective = Objective.record_only(batch)
        rec = Recorder(tree, self.device, self.dtype, minmax=minmax)
        res = WalkResult()
        plan = self.plan(tree)
        tree, res.plan = plan.tree, self._stats(plan, tree)
        path: list[Frame] = []
        check_shared_routing(batch, tree)
        routes = NodeRouting(batch, tree, self.device)
        with self._walking():
            for kind, i in plan.walk():
                if kind == "pop":
                    path.pop()
                    continue
                layout = plan.layout(i)
                hidden, state, _ = self._forward(tree, layout, path, routes)
                terms = self._terms(tree, layout, objective, True)
                if not terms.empty:
                    out = self.head.evaluate(hidden, terms, entropy=True, minmax=minmax)
                    res.head_calls += 1
                    rec.add(terms, out.logp, out.entropy,
                            *((out.vocab_min, out.vocab_max) if minmax else ()))
                res.packs += 1
                res.forward_calls += 1
                res.max_call_tokens = max(res.max_call_tokens, layout.tokens)
                res.nodes += len(plan.packs[i].nodes)
                res.tokens += layout.tokens
                if plan.packs[i].children:
                    path.append(Frame(i, layout, self.io.detached(state), None))
                    res.max_path = max(res.max_path, len(path))
                if progress is not None:
                    progress(layout.tokens)
        res.logprobs, res.entropy, *mm = rec.split()
        if minmax:
            res.vocab_min, res.vocab_max = mm
        return res

    def _stats(self, plan: PackPlan, tree: PrefixTree) -> dict:
        return {**plan.stats(), "block_tokens": self.block_tokens,
                "blocks_cut": len(plan.tree) - len(tree)}  # pieces added by the cut

    @staticmethod
    def _active(tree: PrefixTree, objective: Objective, aux: bool = False) -> np.ndarray:
        """Nodes whose subtree holds a loss term (or, with the router aux loss, a weighted
        sequence); the rest cannot affect the gradient."""
        active = np.zeros(len(tree), bool)
        leaf_of = tree.leaf_of()
        for i in range(len(tree.sequences)):
            if objective.has_loss(i) or (aux and objective.sequence_weights[i] != 0):
                active[leaf_of[i]] = True
        for u in range(len(tree) - 1, 0, -1):  # children before parents
            if active[u]:
                active[tree.parent[u]] = True
        active[0] = False
        return active


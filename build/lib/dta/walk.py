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

The LM head (``dta/model/head.py``) evaluates the queued rows of several packs in one call and
keeps only ∂L/∂hidden, so no [tokens, vocab] graph waits on the path. Everything the walk
assumes about the model (embedding leaves, per-layer states, the logit transform, where a
context-parallel rank's rows and heads are) lives in ``dta/model/modeling.py``; recurrent
(Gated DeltaNet) layers follow the pack's local tree through it (``dta/model/gdn.py``).

Blocks (``dta/planning/blocks.py``): before packing, a node longer than ``block_tokens`` is
cut into a chain of pieces, each a node whose parent is the previous piece, and no pack is
longer than a block; the walk below runs on the cut tree unchanged (``plan.tree``), so no
call -- and under *recompute* no graph -- is longer than one block.

MoE (docs/moe.md): replayed experts are forced in every router during a pack's forward
(``dta/model/routing.py``: ``routes``); the router's load-balancing loss
(``dta/model/router_aux.py``: ``aux``) reads each pack's routing at push and adds each pack's
surrogate to its backward at leaf() or pop(), like the K/V gradients.

Memory policies: *retain* keeps each pack's graph along the current path (plus the leaf packs
waiting for a head flush); *recompute* keeps only the detached K/V (and ∂L/∂hidden) and
re-forwards the pack with grad at pop (AReaL-DTA's choice): one graph alive at a time. Where
the attention over the path is split at the cache boundary, the first forward keeps each
layer's attention output on a tape (``dta.model.split_attention.Tape``) for the re-forward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from dta.model.attention import native_gqa, taped
from dta.model.head import HeadQueue, LMHead
from dta.model.lora import check_peft_model
from dta.model.modeling import ModelInterface, NodeState, check_router_aux_loss
from dta.model.packmask import mask_support
from dta.model.router_aux import router_aux
from dta.model.routing import NodeRouting, check_shared_routing
from dta.model.split_attention import Tape
from dta.objective import NodeTerms, Objective, Recorder, WalkResult
from dta.options import POLICIES, WalkOptions
from dta.planning.blocks import cut_blocks
from dta.planning.index import PlanningError
from dta.planning.packs import PackCost, PackLayout, PackPlan, default_cap, plan_packs
from dta.tree import PrefixTree

__all__ = ["Walker", "WalkResult", "WalkOptions", "POLICIES", "Retain", "Recompute"]


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
class Waiting:
    """A leaf pack pushed, waiting for the head flush that gives its ∂L/∂hidden."""
    hidden: torch.Tensor  # with its graph
    job: object  # its head rows
    tokens: int
    aux: list  # the router aux loss's (output, gradient) pairs


def _from_output(hidden, dhidden):
    """A pack's backward starts at its output: the head's gradient, or zeros when only the
    router aux loss reaches the pack (its surrogate enters the decoder at the routers; a
    backward that does not pass the decoder's output is invisible to a wrapper of the
    decoder, e.g. FSDP's lockstep, runtime/engine/lockstep.py). Zeros add nothing."""
    return dhidden if dhidden is not None else torch.zeros_like(hidden)


# ----------------------------------------------------------------- memory policies --
class Retain:
    """*retain*: each pack keeps its graph while it is on the path (a leaf pack until its
    head flush); pop backpropagates the graph it kept."""
    keeps_graph = True
    flush_each_leaf = False

    def tape_for(self, is_leaf: bool):
        return None

    def kept(self, hidden, state):
        return hidden, state

    def alive(self, path: list[Frame], waiting: list[Waiting]) -> list[int]:
        """Tokens of the graphs alive besides a pack being pushed."""
        return [f.layout.tokens for f in path] + [w.tokens for w in waiting]

    def graph_at_pop(self, frame: Frame, reforward):
        """(hidden, state, routing read at this forward or None): the pack's graph."""
        return (*frame.graph, None)


class Recompute:
    """*recompute*: a pack keeps only its detached K/V (and, where the attention over the
    path is split, a tape of it); pop re-forwards it with grad. One graph is alive at a time,
    so a leaf pack is backpropagated at once."""
    keeps_graph = False
    flush_each_leaf = True

    def tape_for(self, is_leaf: bool):
        return None if is_leaf else Tape()

    def kept(self, hidden, state):
        return None

    def alive(self, path: list[Frame], waiting: list[Waiting]) -> list[int]:
        return []

    def graph_at_pop(self, frame: Frame, reforward):
        return reforward(frame.layout, frame.tape)


MEMORY = {"retain": Retain, "recompute": Recompute}


class Walker:
    """Walks a PrefixTree with a Hugging Face causal LM whose forward takes a K/V cache.

    ``options``: the walk's settings (:class:`dta.options.WalkOptions`: memory policy,
    packing, pack and block tokens, head rows, logits chunk, temperature, router aux loss,
    attention backend); or give them as keywords (``Walker(model, policy="recompute")``),
    which builds the WalkOptions (keywords beside ``options`` replace its fields). A record's
    ``routed_experts`` are replayed in every MoE layer (``dta/model/routing.py``). The walker
    does not probe the model: the trainer's entry points (``dta.train``) run ``dta.selfcheck``
    once they have built one.
    """

    def __init__(self, model, options: WalkOptions | None = None, **settings):
        options = WalkOptions.given(options, settings)
        check_peft_model(model)  # LoRA only, no dropout (dta/model/lora.py)
        self.model, self.options = model, options
        self.memory = MEMORY[options.policy]()
        self.io = ModelInterface(model)
        if options.router_aux_coef > 0:
            self.io.moe.require(f"router_aux_loss={options.router_aux_coef:g}")
        self.head = LMHead(model, temperature=options.temperature, chunk=options.logits_chunk)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # per-token loss fields (old log-probs, advantages, weights) in the log-probs' dtype, as
        # per-sequence training keeps them: float32 for a half-precision model (dta/fidelity.py)
        self.terms_dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
        # a model whose attention cannot take a tree mask gets single-path packs only
        self.mask_support = mask_support(model)
        self.branches = self.mask_support[0] is not None
        self.pack_cost = options.pack_cost or PackCost.from_config(model.config)
        self._routing_checked = None  # (batch, tree) whose shared routing was checked

    def plan(self, tree: PrefixTree, active: np.ndarray | None = None) -> PackPlan:
        """The pack plan of ``tree`` cut into blocks: ``plan.tree`` is the tree walked."""
        o = self.options
        cut, origin = cut_blocks(tree, o.block_tokens)
        cap = o.pack_cap
        if cap is None:
            cap = default_cap(tree, o.policy)
            cap = min(cap, o.block_tokens or cap)
        plan = plan_packs(cut, o.packing, cap=cap, cost=self.pack_cost,
                          active=None if active is None else active[origin],
                          branches=self.branches)
        longest = max((p.tokens for p in plan.packs), default=0)
        if o.block_tokens and longest > o.block_tokens:  # the 'tree' policy: no cap
            raise PlanningError(f"pack policy {o.packing!r} forwards {longest} tokens in one "
                                f"call, more than block_tokens={o.block_tokens}; use "
                                "block_tokens=0 (no cut) or another pack policy")
        return plan

    # --------------------------------------------------------------------- the model --
    def _forward(self, tree: PrefixTree, layout: PackLayout, path: list[Frame], routes: NodeRouting,
                 capture: bool = False, tape: Tape | None = None):
        """The last hidden states of the pack's rows this process forwards [rows, H] (all,
        or a context-parallel rank's: ``ModelInterface.part``), its own new per-layer state,
        and its routing (``dta.model.routing.RouterCall``: replayed experts forced, routers
        read). ``tape``: the attention over the path kept or (re-forward) taken back."""
        rows = self.io.part(layout).rows
        ids = np.concatenate([tree.tokens(int(u)) for u in layout.tree_nodes])[rows]
        ids = torch.as_tensor(ids, device=self.device)
        pos = torch.as_tensor(layout.positions[rows], device=self.device).unsqueeze(0)
        cache = self.io.pack_cache(self._path_pieces(tree, layout, path), layout)
        mask = self.io.pack_mask(layout, self.device, self.dtype, self.mask_support)
        forced = routes.rows(layout.tree_nodes)
        forced = None if forced is None else forced[rows]
        with self.io.moe.call(forced, capture) as routed, taped(tape):
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
        """The loss terms of the pack's rows this process forwards (``empty``: none anywhere)."""
        return NodeTerms.concat([
            (objective.terms(tree, int(u), self.device, self.terms_dtype, record=record),
             int(layout.offsets[i])) for i, u in enumerate(layout.tree_nodes)]
        ).within(self.io.part(layout))

    def _check_routing(self, batch, tree: PrefixTree) -> None:
        """One routing per shared token, before anything is forwarded: once per batch and
        tree (a sequence loss walks them twice: forward, then train)."""
        if self._routing_checked is None or self._routing_checked[0] is not batch \
                or self._routing_checked[1] is not tree:
            check_shared_routing(batch, tree)
            self._routing_checked = (batch, tree)

    # ---------------------------------------------------------------------- the walk --
    def train(self, tree: PrefixTree, objective: Objective, *, record: bool = False,
              progress=None) -> WalkResult:
        """Accumulate into the parameters' ``.grad`` the gradient of the objective."""
        o = self.options
        check_router_aux_loss(self.model, o.router_aux_loss)
        self._check_routing(objective.batch, tree)
        with self._walking():
            plan = self.plan(tree, self._active(tree, objective, o.router_aux_coef > 0))
            walk = TrainingWalk(self, plan, objective, record, self._stats(plan, tree))
            for kind, i in plan.walk():
                walk.push(i) if kind == "push" else walk.pop(i)
                if progress is not None and kind == "push":
                    progress(plan.packs[i].tokens)
            return walk.finish()

    @contextlib.contextmanager
    def _walking(self):
        """A walk's scope: attention on SDPA's native grouped-query path, and the head's
        logits workspace released when the walk ends (also when it raises)."""
        try:
            with native_gqa(self.model, self.options.native_gqa,
                            self.options.attention_backend), self.io.walking():
                yield
        finally:
            self.head.release()

    @torch.no_grad()
    def forward(self, tree: PrefixTree, batch, *, minmax: bool = False, progress=None) -> WalkResult:
        """Forward-only walk: per-sequence, per-token log-probs and entropy, K/V reused."""
        objective = Objective.record_only(batch)
        self._check_routing(batch, tree)
        plan = self.plan(tree)
        res = WalkResult(plan=self._stats(plan, tree))
        tree = plan.tree
        rec = Recorder(tree, self.device, self.dtype, minmax=minmax)
        path: list[Frame] = []
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
                res.pushed(len(plan.packs[i].nodes), layout)
                if plan.packs[i].children:
                    path.append(Frame(i, layout, self.io.detached(state), None))
                    res.depth(len(path))
                if progress is not None:
                    progress(layout.tokens)
        res.logprobs, res.entropy, *mm = rec.split(self.io.placement.combine)
        if minmax:
            res.vocab_min, res.vocab_max = mm
        return res

    def _stats(self, plan: PackPlan, tree: PrefixTree) -> dict:
        return {**plan.stats(), "block_tokens": self.options.block_tokens,
                "blocks_cut": len(plan.tree) - len(tree),  # pieces added by the cut
                "max_prefix": max((p.prefix for p in plan.packs), default=0)}  # longest path

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


class TrainingWalk:
    """One training walk (:meth:`Walker.train`): the path of frames, the leaf packs waiting
    for the LM head, the head's queue; what differs between the memory policies is behind
    ``memory`` (:class:`Retain`, :class:`Recompute`), the router's aux loss behind ``aux``
    (``dta/model/router_aux.py``), the counters in ``res`` (:class:`WalkResult`)."""

    def __init__(self, walker: Walker, plan: PackPlan, objective: Objective, record: bool,
                 stats: dict):
        self.w, self.plan, self.tree, self.objective = walker, plan, plan.tree, objective
        self.memory, self.record = walker.memory, record
        self.res = WalkResult(plan=stats)
        self.rec = Recorder(self.tree, walker.device, walker.dtype) if record else None
        self.routes = NodeRouting(objective.batch, self.tree, walker.device)
        self.aux = router_aux(walker.options.router_aux_coef, self.tree, objective,
                              walker.io)
        self.queue, self.path, self.waiting = HeadQueue(), [], []
        self.flush_rows = walker.options.flush_rows

    # ---------------------------------------------------------------- push, leaf, pop --
    def push(self, i: int) -> None:
        """Forward pack ``i`` once over its path's K/V; queue its head rows."""
        pack, layout = self.plan.packs[i], self.plan.layout(i)
        is_leaf = not pack.children
        terms = self.w._terms(self.tree, layout, self.objective, self.record)
        # a leaf pack with nothing to backpropagate (no head row, no aux loss: e.g. only
        # the AReaL adapter's wrap label of a strict prefix) keeps no graph
        needs_graph = is_leaf and (not terms.empty or self.aux.capture)
        tape = self.memory.tape_for(is_leaf)
        with torch.set_grad_enabled(self.memory.keeps_graph or needs_graph):
            hidden, state, routed = self.forward(layout, tape)
        aux = self.aux.pushed(i, layout, self.path, routed, is_leaf)
        job = self.queue.add(hidden, terms)
        self.res.pushed(len(pack.nodes), layout, self.memory.alive(self.path, self.waiting))
        if is_leaf:
            self.waiting.append(Waiting(hidden, job, layout.tokens, aux))
            if self.memory.flush_each_leaf or self.queue.rows >= self.flush_rows or \
                    sum(w.tokens for w in self.waiting) >= max(self.flush_rows, 1):
                self.leaf()
            return
        leaves = self.w.io.state_leaves(state)  # where its descendants' K/V gradients land
        self.path.append(Frame(i, layout, leaves, job, self.memory.kept(hidden, state), tape))
        self.res.depth(len(self.path))
        if self.flush_rows <= 0:
            self.leaf()

    def leaf(self) -> None:
        """Evaluate the queued head rows, then backpropagate the waiting leaf packs (their
        own loss only) in one backward call."""
        self.queue.flush(self.evaluate)
        done, self.waiting = self.waiting, []
        if done:
            pairs = [(w.hidden, _from_output(w.hidden, w.job.dhidden)) for w in done
                     if w.job.dhidden is not None or w.aux]
            self.backward(pairs + [p for w in done for p in w.aux])

    def pop(self, i: int) -> None:
        """After the packs below it: backpropagate the pack's own loss together with the K/V
        gradients its descendants left in its leaves, then free it."""
        self.leaf()  # the pack's own head rows, and its leaf packs' backward passes
        frame = self.path.pop()
        hidden, state, routed = self.memory.graph_at_pop(frame, self.reforward)
        aux = self.aux.popped(frame.pack, routed)
        dhidden = frame.job.dhidden
        pairs = [(hidden, _from_output(hidden, dhidden))] if dhidden is not None or aux else []
        pairs += aux
        # the K/V gradients its descendants left (context parallel: every rank's slice gathered)
        pairs += self.w.io.state_grads(state, frame.state)
        self.backward(pairs)

    def finish(self) -> WalkResult:
        self.leaf()
        placement = self.w.io.placement  # each process evaluated its rows' loss terms
        self.res.aux_loss = self.aux.value
        self.res.loss = placement.total(self.res.loss) + self.aux.value
        if self.rec is not None:
            self.res.logprobs, self.res.entropy = self.rec.split(placement.combine)
        return self.res

    # ------------------------------------------------------------- model, head, autograd --
    def forward(self, layout: PackLayout, tape: Tape | None):
        return self.w._forward(self.tree, layout, self.path, self.routes, self.aux.capture, tape)

    def reforward(self, layout: PackLayout, tape: Tape | None):
        """recompute: the pack forwarded again with grad at its pop; the head is not re-run,
        the attention over the path is taken back from the tape."""
        out = self.forward(layout, tape)
        self.res.reforwarded(layout.tokens)
        return out

    def evaluate(self, hidden, terms):
        """One LM-head call over the queued rows: loss value and ∂L/∂hidden."""
        out = self.w.head.evaluate(hidden, terms,
                                   lambda *a: self.objective.node_loss(terms, *a),
                                   need_entropy=self.objective.loss.uses_entropy,
                                   entropy=self.record)
        self.res.head_calls += 1
        if self.rec is not None:
            self.rec.add(terms, out.logp, out.entropy)
        if out.loss is not None:
            self.res.loss += out.loss
        return out.dhidden

    def backward(self, pairs) -> None:
        # an output nothing trainable reached this time (a frozen base, an expert's
        # adapter no token was routed to) has no gradient to pass on
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            self.res.backward_calls += 1
        self.w.io.collect_embedding_grads()

"""The depth-first walk over a prefix tree: exact gradients, one root-to-leaf path at a time.

    push(u)   forward u's tokens once, attending to its ancestors' K/V (held as autograd
              leaves), at tree positions start..end-1; compute u's own loss terms.
    leaf(u)   a node with no children to visit: backpropagate its loss at once.
    pop(u)    after all children: backpropagate u's loss together with the K/V gradients its
              descendants left in u's K/V leaves, then free u.

Why it is exact: a descendant depends on u's parameters only through u's K/V, so
d(loss)/dθ = Σ_u [∂ own_loss_u/∂θ + (∂ K/V_u/∂θ)ᵀ · Σ_desc ∂ loss_desc/∂ K/V_u]; the second
sum is what accumulates in the leaves' ``.grad`` (children's backward passes add into it).

The LM head runs once per node at push (``dta/head.py``): it evaluates the node's own loss
terms and keeps only ∂L/∂hidden, so no [tokens, vocab] graph ever waits on the path.
Everything the walk assumes about the model (embedding leaves, the per-node cache built from
the path's per-layer states, the logit transform) lives in ``dta/modeling.py``.

Memory policies: *retain* keeps each node's graph along the current path; *recompute* keeps
only the detached K/V (and ∂L/∂hidden) and re-forwards the node with grad at pop
(AReaL-DTA's choice). Either way at most one graph per node of the current path is alive.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dta.head import LMHead
from dta.modeling import ModelInterface, NodeState, check_router_aux_loss
from dta.objective import NodeTerms, Objective
from dta.tree import PrefixTree

POLICIES = ("retain", "recompute")


@dataclass
class Frame:
    node: int
    state: NodeState  # the node's own per-layer state (K/V): detached leaves its descendants read
    dhidden: torch.Tensor | None = None  # ∂(own loss terms)/∂(hidden states), from the head
    graph: tuple | None = None  # retain: (hidden, state) still attached to the node's graph


@dataclass
class WalkResult:
    loss: float = 0.0
    nodes: int = 0  # nodes forwarded (first time)
    tokens: int = 0  # tokens forwarded (first time)
    recomputed_tokens: int = 0  # tokens forwarded again at pop (recompute policy)
    max_live_graphs: int = 0  # most node graphs alive at once
    max_path: int = 0  # deepest stack of K/V frames
    logprobs: list | None = None  # per sequence [n] (index j predicts token j; 0 at j=0)
    entropy: list | None = None
    vocab_min: list | None = None
    vocab_max: list | None = None


class Walker:
    """Walks a PrefixTree with a Hugging Face causal LM whose forward takes a K/V cache."""

    def __init__(self, model, *, policy: str = "retain", logits_chunk: int = 1024,
                 temperature: float = 1.0, router_aux_loss: str = "refuse",
                 self_check: bool = True):
        """router_aux_loss: "refuse" (default) raises at ``train`` when a MoE config asks for
        the router's load-balancing loss; "exclude" trains the policy loss without it
        (see ``dta.modeling.check_router_aux_loss``).
        self_check: compare the walker's path with the model's own forward and backward on
        a small probe, once per model object, and refuse a model that differs
        (``dta.selfcheck``); False skips it."""
        if policy not in POLICIES:
            raise ValueError(f"unknown memory policy {policy!r}; choose one of {POLICIES}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        check_router_aux_loss(model, "exclude")  # validates the option's value only
        self.model, self.policy, self.router_aux_loss = model, policy, router_aux_loss
        self.io = ModelInterface(model)
        self.head = LMHead(model, temperature=temperature, chunk=logits_chunk)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self_check:
            from dta.selfcheck import ensure_self_check

            ensure_self_check(model)

    # --------------------------------------------------------------------- the model --
    def _forward(self, tree: PrefixTree, u: int, path: list[Frame]):
        """u's last hidden states [L, H] and its own new per-layer state."""
        ids = torch.as_tensor(tree.tokens(u), device=self.device)
        return self.io.forward(ids, int(tree.start[u]), [f.state for f in path])

    # ---------------------------------------------------------------------- the walk --
    def train(self, tree: PrefixTree, objective: Objective, *, record: bool = False,
              progress=None) -> WalkResult:
        """Accumulate into the parameters' ``.grad`` the gradient of the objective."""
        check_router_aux_loss(self.model, self.router_aux_loss)
        res = WalkResult()
        active = self._active(tree, objective)
        rec = _Recorder(tree, self.device, self.dtype) if record else None
        need_ent = objective.loss.uses_entropy
        path: list[Frame] = []

        def head(terms, hidden):
            """u's own loss terms through the LM head: (loss value, ∂L/∂hidden)."""
            if terms.empty:
                return None, None
            out = self.head.evaluate(hidden, terms, lambda *a: objective.node_loss(terms, *a),
                                     need_entropy=need_ent)
            if rec is not None:
                rec.add(terms, out.logp, out.entropy)
            if out.loss is not None:
                res.loss += out.loss
            return out.loss, out.dhidden

        def backward(hidden, dhidden, state, leaves):
            """Backpropagate a node: its own terms (∂L/∂hidden) and its descendants' (the
            gradients they left in its state leaves)."""
            outs, grads = ([hidden], [dhidden]) if dhidden is not None else ([], [])
            for layer, layer_leaves in zip(state, leaves or []):
                for out, leaf in zip(layer, layer_leaves):
                    if leaf.grad is not None:
                        outs.append(out)
                        grads.append(leaf.grad)
            if outs:
                torch.autograd.backward(outs, grads)
            self.io.collect_embedding_grads()

        def push(u):
            terms = objective.terms(tree, u, self.device, self.dtype, record=record)
            is_leaf = not any(active[c] for c in tree.children[u])
            res.nodes += 1
            res.tokens += tree.length(u)
            if is_leaf or self.policy == "retain":
                hidden, state = self._forward(tree, u, path)
                res.max_live_graphs = max(res.max_live_graphs, len(path) + 1
                                          if self.policy == "retain" else 1)
            else:
                with torch.no_grad():
                    hidden, state = self._forward(tree, u, path)
            _, dhidden = head(terms, hidden)
            if is_leaf:  # backpropagate at once
                backward(hidden, dhidden, [], None)
                return False
            leaves = [tuple(x.detach().requires_grad_() for x in layer) for layer in state]
            graph = (hidden, state) if self.policy == "retain" else None
            path.append(Frame(u, leaves, dhidden, graph))
            res.max_path = max(res.max_path, len(path))
            return True

        def pop(u):
            frame = path.pop()
            if self.policy == "recompute":  # re-forward with grad; the head is not re-run
                hidden, state = self._forward(tree, u, path)
                res.recomputed_tokens += tree.length(u)
                res.max_live_graphs = max(res.max_live_graphs, 1)
            else:
                hidden, state = frame.graph
            backward(hidden, frame.dhidden, state, frame.state)

        self._dfs(tree, active, push, pop, progress)
        if rec is not None:
            res.logprobs, res.entropy = rec.split()
        return res

    @torch.no_grad()
    def forward(self, tree: PrefixTree, batch, *, minmax: bool = False, progress=None) -> WalkResult:
        """Forward-only walk: per-sequence, per-token log-probs and entropy, K/V reused."""
        objective = Objective.record_only(batch)
        rec = _Recorder(tree, self.device, self.dtype, minmax=minmax)
        res = WalkResult()
        path: list[Frame] = []

        def push(u):
            hidden, state = self._forward(tree, u, path)
            terms = objective.terms(tree, u, self.device, self.dtype, record=True)
            if not terms.empty:
                out = self.head.evaluate(hidden, terms, minmax=minmax)
                rec.add(terms, out.logp, out.entropy, *((out.vocab_min, out.vocab_max) if minmax else ()))
            res.nodes += 1
            res.tokens += tree.length(u)
            if tree.children[u]:
                path.append(Frame(u, state))
                res.max_path = max(res.max_path, len(path))
                return True
            return False

        self._dfs(tree, np.ones(len(tree), bool), push, lambda u: path.pop(), progress)
        res.logprobs, res.entropy, *mm = rec.split()
        if minmax:
            res.vocab_min, res.vocab_max = mm
        return res

    @staticmethod
    def _dfs(tree, active, push, pop, progress):
        """Pre-order push / post-order pop over the active nodes; push returns whether the
        node stays on the path (has children to visit)."""
        stack = [(c, False) for c in reversed(tree.children[0]) if active[c]]
        while stack:
            u, popping = stack.pop()
            if popping:
                pop(u)
                continue
            if push(u):
                stack.append((u, True))
                stack.extend((c, False) for c in reversed(tree.children[u]) if active[c])
            if progress is not None:
                progress(tree.length(u))

    @staticmethod
    def _active(tree: PrefixTree, objective: Objective) -> np.ndarray:
        """Nodes whose subtree holds a loss term; the rest cannot affect the gradient."""
        active = np.zeros(len(tree), bool)
        leaf_of = tree.leaf_of()
        for i in range(len(tree.sequences)):
            if objective.has_loss(i):
                active[leaf_of[i]] = True
        for u in range(len(tree) - 1, 0, -1):  # children before parents
            if active[u]:
                active[tree.parent[u]] = True
        return active


class _Recorder:
    """Scatters per-pair results into per-sequence, per-token arrays."""

    def __init__(self, tree: PrefixTree, device, dtype, minmax: bool = False):
        self.lengths = tree.lengths
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        n = int(self.lengths.sum())
        self.buffers = [torch.zeros(n, device=device, dtype=torch.float64 if dtype == torch.float64
                                    else torch.float32) for _ in range(4 if minmax else 2)]

    def add(self, terms: NodeTerms, *per_pair):
        idx = torch.as_tensor(self.offsets[terms.rec_seq] + terms.rec_pos, device=self.buffers[0].device)
        pair = torch.as_tensor(terms.rec_pair, device=self.buffers[0].device)
        for buf, values in zip(self.buffers, per_pair):
            buf[idx] = values.detach()[pair].to(buf.dtype)

    def split(self):
        sizes = [int(n) for n in self.lengths]
        return [list(torch.split(buf, sizes)) for buf in self.buffers]

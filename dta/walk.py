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

Memory policies: *retain* keeps each node's graph along the current path; *recompute* keeps
only the detached K/V (and ∂L/∂hidden) and re-forwards the node with grad at pop
(AReaL-DTA's choice). Either way at most one graph per node of the current path is alive.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from dta.head import LMHead
from dta.objective import NodeTerms, Objective
from dta.tree import PrefixTree

POLICIES = ("retain", "recompute")


@dataclass
class Frame:
    node: int
    kv: list  # the node's own (k, v) per layer, detached leaves its descendants attend to
    dhidden: torch.Tensor | None = None  # ∂(own loss terms)/∂(hidden states), from the head
    graph: tuple | None = None  # retain: (hidden, K/V) still attached to the node's graph


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
                 temperature: float = 1.0):
        if policy not in POLICIES:
            raise ValueError(f"unknown memory policy {policy!r}; choose one of {POLICIES}")
        if getattr(model.config, "final_logit_softcapping", None):
            raise ValueError("models with logit soft-capping are not supported by the walker")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model, self.policy = model, policy
        self.decoder = model.get_decoder()
        self.head = LMHead(model, temperature=temperature, chunk=logits_chunk)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # transformers >= 5.4 names the kwarg `cache` (and warns on `past_key_values`).
        params = inspect.signature(self.decoder.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    # --------------------------------------------------------------------- the model --
    def _forward(self, tree: PrefixTree, u: int, path: list[Frame]):
        """u's last hidden states [L, H] and its own new K/V per layer."""
        from transformers import DynamicCache

        s, e = int(tree.start[u]), int(tree.end[u])
        ids = torch.as_tensor(tree.tokens(u), device=self.device).unsqueeze(0)
        pos = torch.arange(s, e, device=self.device).unsqueeze(0)
        past = None
        if path:  # a fresh cache per node: a forward mutates its cache in place
            past = [tuple(_cat([f.kv[layer][j] for f in path]) for j in (0, 1))
                    for layer in range(len(path[0].kv))]
            assert past[0][0].shape[2] == s, "ancestors' K/V must cover positions 0..start-1"
        cache = DynamicCache(ddp_cache_data=past, config=self.model.config)
        out = self.decoder(position_ids=pos, use_cache=True, **self.head.embed(ids),
                           **{self.cache_kwarg: cache})
        cache = getattr(out, "cache", None) or out.past_key_values
        kv = [(layer.keys[:, :, s:], layer.values[:, :, s:]) for layer in cache.layers]
        return out.last_hidden_state[0], kv

    # ---------------------------------------------------------------------- the walk --
    def train(self, tree: PrefixTree, objective: Objective, *, record: bool = False,
              progress=None) -> WalkResult:
        """Accumulate into the parameters' ``.grad`` the gradient of the objective."""
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

        def backward(hidden, dhidden, kv, frame_kv):
            """Backpropagate a node: its own terms (∂L/∂hidden) and its descendants' (the
            gradients they left in its K/V leaves)."""
            outs, grads = ([hidden], [dhidden]) if dhidden is not None else ([], [])
            for (k, v), (k_leaf, v_leaf) in zip(kv, frame_kv or []):
                for out, leaf in ((k, k_leaf), (v, v_leaf)):
                    if leaf.grad is not None:
                        outs.append(out)
                        grads.append(leaf.grad)
            if outs:
                torch.autograd.backward(outs, grads)
            self.head.collect_embedding_grads()

        def push(u):
            terms = objective.terms(tree, u, self.device, self.dtype, record=record)
            is_leaf = not any(active[c] for c in tree.children[u])
            res.nodes += 1
            res.tokens += tree.length(u)
            if is_leaf or self.policy == "retain":
                hidden, kv = self._forward(tree, u, path)
                res.max_live_graphs = max(res.max_live_graphs, len(path) + 1
                                          if self.policy == "retain" else 1)
            else:
                with torch.no_grad():
                    hidden, kv = self._forward(tree, u, path)
            _, dhidden = head(terms, hidden)
            if is_leaf:  # backpropagate at once
                backward(hidden, dhidden, [], None)
                return False
            leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kv]
            graph = (hidden, kv) if self.policy == "retain" else None
            path.append(Frame(u, leaves, dhidden, graph))
            res.max_path = max(res.max_path, len(path))
            return True

        def pop(u):
            frame = path.pop()
            if self.policy == "recompute":  # re-forward with grad; the head is not re-run
                hidden, kv = self._forward(tree, u, path)
                res.recomputed_tokens += tree.length(u)
                res.max_live_graphs = max(res.max_live_graphs, 1)
            else:
                hidden, kv = frame.graph
            backward(hidden, frame.dhidden, kv, frame.kv)

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
            hidden, kv = self._forward(tree, u, path)
            terms = objective.terms(tree, u, self.device, self.dtype, record=True)
            if not terms.empty:
                out = self.head.evaluate(hidden, terms, minmax=minmax)
                rec.add(terms, out.logp, out.entropy, *((out.vocab_min, out.vocab_max) if minmax else ()))
            res.nodes += 1
            res.tokens += tree.length(u)
            if tree.children[u]:
                path.append(Frame(u, kv))
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


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=2)


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

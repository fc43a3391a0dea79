"""The depth-first walk over a prefix tree: exact gradients, one root-to-leaf path at a time.

    push(u)   forward u's tokens once, attending to its ancestors' K/V (held as autograd
              leaves), at tree positions start..end-1; compute u's own loss terms.
    leaf(u)   a node with no children to visit: backpropagate its loss at once.
    pop(u)    after all children: backpropagate u's loss together with the K/V gradients its
              descendants left in u's K/V leaves, then free u.

Why it is exact: a descendant depends on u's parameters only through u's K/V, so
d(loss)/dθ = Σ_u [∂ own_loss_u/∂θ + (∂ K/V_u/∂θ)ᵀ · Σ_desc ∂ loss_desc/∂ K/V_u]; the second
sum is what accumulates in the leaves' ``.grad`` (children's backward passes add into it).

Memory policies: *retain* keeps each node's graph along the current path; *recompute* keeps
only the detached K/V and re-forwards the node with grad at pop (AReaL-DTA's choice). Either
way at most one graph per node of the current path is alive.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dta.objective import NodeTerms, Objective
from dta.tree import PrefixTree

POLICIES = ("retain", "recompute")


@dataclass
class Frame:
    node: int
    kv: list  # the node's own (k, v) per layer, detached leaves its descendants attend to
    graph_kv: list | None = None  # retain: the same K/V still attached to the node's graph
    loss: torch.Tensor | None = None  # retain: the node's own loss terms, with graph
    terms: NodeTerms | None = None  # recompute: the node's loss terms, to re-evaluate at pop


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
    extra: dict = field(default_factory=dict)


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
        self.head = model.get_output_embeddings()
        self.chunk, self.temperature = int(logits_chunk), float(temperature)
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
        out = self.decoder(input_ids=ids, position_ids=pos, use_cache=True, **{self.cache_kwarg: cache})
        cache = getattr(out, "cache", None) or out.past_key_values
        kv = [(layer.keys[:, :, s:], layer.values[:, :, s:]) for layer in cache.layers]
        return out.last_hidden_state[0], kv

    def _head(self, hidden: torch.Tensor, terms: NodeTerms, need_entropy: bool, minmax: bool):
        """Log-prob of every (row, target) pair and the entropy of its row, computing the
        ``[rows, vocab]`` logits at most `logits_chunk` rows at a time. With grad, each chunk
        is checkpointed: backward recomputes its logits instead of keeping them."""
        rows = terms.rows
        bounds = list(range(0, len(rows), self.chunk)) + [len(rows)]
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            r, t = rows[a:b], terms.targets[a:b]

            def chunk(h, t=t):
                z = self.head(h)
                if z.dtype in (torch.float16, torch.bfloat16):
                    z = z.float()
                z = z / self.temperature
                lse = torch.logsumexp(z, dim=-1)
                logp = z.gather(-1, t[:, None])[:, 0] - lse
                ent = lse - (F.softmax(z, dim=-1) * z).sum(-1)
                if not need_entropy:
                    ent = ent.detach()
                mm = (z.min(-1).values.detach(), z.max(-1).values.detach()) if minmax else ()
                return (logp, ent) + mm

            h = hidden[r]  # a pair per row, except fork rows with several targets
            use_ckpt = torch.is_grad_enabled() and h.requires_grad
            outs.append(checkpoint(chunk, h, use_reentrant=False) if use_ckpt else chunk(h))
        return [torch.cat(parts) for parts in zip(*outs)]

    # ---------------------------------------------------------------------- the walk --
    def train(self, tree: PrefixTree, objective: Objective, *, record: bool = False,
              progress=None) -> WalkResult:
        """Accumulate into the parameters' ``.grad`` the gradient of the objective."""
        res = WalkResult()
        active = self._active(tree, objective)
        rec = _Recorder(tree, self.device, self.dtype) if record else None
        need_ent = objective.loss.uses_entropy
        path: list[Frame] = []

        def evaluate(u, terms, hidden):
            if terms.empty:
                return None
            logp, ent, *_ = self._head(hidden, terms, need_ent, False)
            if rec is not None:
                rec.add(terms, logp, ent)
            if len(terms.occ_pair) == 0:
                return None
            return objective.node_loss(terms, logp, ent)

        def backward(loss, graph_kv, frame_kv):
            outs, grads = ([loss], [None]) if loss is not None else ([], [])
            for (k, v), (k_leaf, v_leaf) in zip(graph_kv, frame_kv or []):
                for out, leaf in ((k, k_leaf), (v, v_leaf)):
                    if leaf.grad is not None:
                        outs.append(out)
                        grads.append(leaf.grad)
            if outs:
                torch.autograd.backward(outs, grads)
            if loss is not None:
                res.loss += float(loss.detach())

        def push(u):
            terms = objective.terms(tree, u, self.device, self.dtype, record=record)
            is_leaf = not any(active[c] for c in tree.children[u])
            res.nodes += 1
            res.tokens += tree.length(u)
            if is_leaf or self.policy == "retain":
                hidden, kv = self._forward(tree, u, path)
                loss = evaluate(u, terms, hidden)
                res.max_live_graphs = max(res.max_live_graphs, len(path) + 1
                                          if self.policy == "retain" else 1)
                if is_leaf:
                    backward(loss, [], None)
                    return False
                frame = Frame(u, [(k.detach().requires_grad_(), v.detach().requires_grad_())
                                  for k, v in kv], graph_kv=kv, loss=loss)
            else:
                with torch.no_grad():
                    hidden, kv = self._forward(tree, u, path)
                    loss = evaluate(u, terms, hidden)
                frame = Frame(u, [(k.requires_grad_(), v.requires_grad_()) for k, v in kv],
                              terms=terms)
            path.append(frame)
            res.max_path = max(res.max_path, len(path))
            return True

        def pop(u):
            frame = path.pop()
            if self.policy == "recompute":
                hidden, kv = self._forward(tree, u, path)
                res.recomputed_tokens += tree.length(u)
                res.max_live_graphs = max(res.max_live_graphs, 1)
                terms = frame.terms
                loss = None if len(terms.occ_pair) == 0 else objective.node_loss(
                    terms, *self._head(hidden, terms, need_ent, False)[:2])
                backward(loss, kv, frame.kv)
            else:
                backward(frame.loss, frame.graph_kv, frame.kv)

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
                rec.add(terms, *self._head(hidden, terms, False, minmax))
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

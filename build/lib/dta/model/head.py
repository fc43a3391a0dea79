"""The LM head of a node, and the two vocabulary-sized weights, without a [tokens, vocab] graph.

For a node's hidden states ``h`` the head computes, ``chunk`` rows at a time, the log-prob of
each (row, target) pair and the entropy of its row, evaluates the node's loss terms on them,
and immediately turns the loss into three gradients by hand (no autograd graph over logits):

    z = t(h Wᵀ + b),  logp_p = z[r_p, t_p] − lse_r,   H_r = lse_r − Σ_v softmax(z_r)_v z_rv
    a_p = ∂L/∂logp_p,  b_r = Σ_{p in row r} ∂L/∂H_p,  A_r = Σ_{p in row r} a_p       (tiny autograd)
    ∂L/∂z_r = −softmax(z_r) ⊙ (A_r + b_r (z_r − lse_r + H_r)) + Σ_{p in row r} a_p e_{t_p}
    ∂L/∂z_raw = ∂L/∂z · t'(z_raw),   ∂L/∂h = ∂L/∂z_raw W,   ∂L/∂W += ∂L/∂z_rawᵀ h

where t is the model's logit transform and the temperature (``dta.model.modeling.LogitTransform``:
t(x) = softcap(scale · x) / T, t' = scale (1 − tanh²(scale · x / cap)) / T; Granite's
``logits_scaling``, Cohere's ``logit_scale``, Gemma 2/3's ``final_logit_softcapping``)

so only ∂L/∂h ([rows, hidden]) is kept for the node's backward: the logits are computed once
(never re-computed at backward), and at most one chunk of them exists at a time.

Vocabulary-sized weight gradients are accumulated directly instead of through autograd, which
would allocate and add a dense [vocab, hidden] tensor per node: ∂L/∂W is buffered up to a
chunk of rows and added with one in-place GEMM (the input embedding's gradient rows are
index-added by ``dta.model.modeling.EmbeddingInput``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dta.model.modeling import LogitTransform
from dta.planning.chunks import LOGITS_BYTES, MIN_ROWS, logits_rows  # noqa: F401 (the head's chunk rule)


@dataclass
class HeadOutput:
    loss: float | None  # the node's loss value (None: no loss terms)
    dhidden: torch.Tensor | None  # ∂L/∂h, [rows, hidden]
    logp: torch.Tensor  # per pair, detached
    entropy: torch.Tensor | None  # None: not computed (no entropy pass)
    vocab_min: torch.Tensor | None = None
    vocab_max: torch.Tensor | None = None


class LMHead:
    def __init__(self, model, *, temperature: float, chunk: int):
        from dta.model.lora import head_adapters

        head, self.adapters = head_adapters(model.get_output_embeddings())  # LoRA: (A, B, s)
        if not isinstance(head, torch.nn.Linear):
            raise TypeError(f"the walker needs a linear LM head, got {type(head).__name__}")
        self.weight, self.bias = head.weight, head.bias
        self.transform = LogitTransform.from_model(model, temperature)
        self.temperature = float(temperature)
        # rows per chunk: at most `chunk`, and at most what keeps one chunk's float32 logits
        # within LOGITS_BYTES (at least MIN_ROWS rows): the [rows, vocab] logits are the
        # biggest single tensor of a walk step (1,024 rows x 32K vocabulary = 125 MB, more than
        # a 19.6M-parameter model's whole decoder graph for a 512-token pack)
        self.chunk = logits_rows(chunk, int(self.weight.shape[0]), self.weight.element_size())
        self._pending_head: list = []  # (h, ∂L/∂z_raw) waiting to be added into W.grad
        self._pending_rows = 0
        # CPU: the logits of every chunk of one evaluation are written into one reused buffer
        # (a fresh [rows, vocab] tensor is page-faulted in at each chunk: ~35 ms per 1,024 x
        # 32K rows on the 2-core CPU), dropped when the evaluation returns; CUDA's caching
        # allocator already reuses the block
        self._reuse = self.weight.device.type == "cpu"
        self._workspace: torch.Tensor | None = None

    # ------------------------------------------------------------------------ head --
    def evaluate(self, hidden: torch.Tensor, terms, loss_fn=None, *, need_entropy: bool = False,
                 entropy: bool | None = None, minmax: bool = False) -> HeadOutput:
        """Log-probs (and, with ``entropy``, entropies) of `terms`' pairs; with
        `loss_fn(occ_slice, first_pair, logp, entropy)` (the loss restricted to the occurrences
        of a chunk's pairs) also the loss value and ∂L/∂hidden, adding ∂L/∂W (and ∂L/∂bias)
        into the head's ``.grad``. ``need_entropy``: the loss reads the entropy (and is
        differentiated through it); ``entropy`` (default: ``need_entropy``) asks for the
        entropies too. Without either, no entropy pass is made over the logits, and the
        softmax is formed in place of the logits."""
        rows, targets = terms.rows, terms.targets
        train = loss_fn is not None
        with_ent = need_entropy if entropy is None else (entropy or need_entropy)
        h_all = hidden.detach()
        dhidden = torch.zeros_like(h_all) if train else None
        outs, total = [], None
        bounds = list(range(0, len(rows), self.chunk)) + [len(rows)]
        occ_bounds = np.searchsorted(terms.occ_pair_np, bounds) if train else None
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            r, t = rows[a:b], targets[a:b]
            first, u_of = _unique_sorted(r)  # fork rows hold one pair per target
            r_u = r[first]
            h = h_all[r_u]
            with torch.no_grad():
                z_raw, in_ws = self._logits(h)
                z = z_raw.float() if z_raw.dtype in (torch.float16, torch.bfloat16) else z_raw
                z, cap_tanh = self.transform.apply(z)  # no copy without scale, cap, temperature
                mm = (z.min(-1).values[u_of], z.max(-1).values[u_of]) if minmax else (None, None)
                ent = ent_row = None
                if with_ent:
                    lse = torch.logsumexp(z, dim=-1)
                    logp = z[u_of, t] - lse[u_of]
                    p = torch.exp(z - lse[:, None])
                    ent_row = lse - (p * z).sum(-1)
                    ent = ent_row[u_of]
                else:  # one exp pass, in place: z becomes exp(z − max); p = that / its row sum
                    z_t, top = z[u_of, t], z.amax(-1)
                    s = z.sub_(top[:, None]).exp_().sum(-1)
                    lse = top + s.log()
                    logp = z_t - lse[u_of]
            outs.append((logp, ent) + mm)
            if not train:
                continue
            oa, ob = int(occ_bounds[i]), int(occ_bounds[i + 1])
            if oa == ob:
                continue
            with torch.enable_grad():  # the only autograd: scalars per pair
                lp = logp.detach().requires_grad_()
                en = ent.detach().requires_grad_() if need_entropy else None
                value = loss_fn(slice(oa, ob), a, lp, en)
                total = value.detach() if total is None else total + value.detach()
                if not value.requires_grad:
                    continue
                grads = torch.autograd.grad(value, [lp, en] if need_entropy else [lp],
                                            allow_unused=True)
                ga, gb = grads[0], grads[1] if need_entropy else None
            with torch.no_grad():
                n_u = len(r_u)
                ga = torch.zeros_like(lp) if ga is None else ga
                A = torch.zeros(n_u, dtype=z.dtype, device=z.device).index_add_(0, u_of, ga)
                if not with_ent:  # −p A = exp(z − max) · (−A / row sum), in place
                    g = z.mul_((-A / s)[:, None])
                else:
                    if gb is not None:  # entropy: ∂H/∂z = −p (z − lse + H)
                        B = torch.zeros(n_u, dtype=z.dtype, device=z.device).index_add_(0, u_of, gb)
                        ent_term = z.sub_(lse[:, None]).add_(ent_row[:, None]).mul_(p).mul_(B[:, None])
                    g = p.mul_(-A[:, None])  # −p A, in place of p
                    if gb is not None:
                        g.sub_(ent_term)
                g.index_put_((u_of, t), ga, accumulate=True)
                g = self.transform.backward_(g, cap_tanh).to(h.dtype)
                dh = g @ self.weight
                for a, b, scale in self.adapters:  # LoRA head: z += scale (h Aᵀ) Bᵀ
                    ga, ha = g.to(a.dtype), h.to(a.dtype)  # peft: adapters in their own dtype
                    gb = ga @ b  # [rows, r]
                    dh.add_((gb @ a).mul_(scale).to(dh.dtype))
                    _add_grad(b, (ga.t() @ (ha @ a.t())).mul_(scale))
                    _add_grad(a, (gb.t() @ ha).mul_(scale))
                dhidden.index_add_(0, r_u, dh)
                self._add_head_grad(h, g)
                if in_ws:  # g lives in the workspace, which the next chunk overwrites
                    self._flush_head()
        self._flush_head()
        self._workspace = None  # idle between evaluations, it would sit on every later peak
        if outs:
            logp, ent, vmin, vmax = (torch.cat(x) if x[0] is not None else None for x in zip(*outs))
        else:
            logp, ent, vmin, vmax = hidden.new_zeros(0), hidden.new_zeros(0) if with_ent else None, None, None
        return HeadOutput(None if total is None else float(total), dhidden, logp, ent, vmin, vmax)

    def _add_head_grad(self, h: torch.Tensor, g: torch.Tensor) -> None:
        if not self.weight.requires_grad:
            return
        self._pending_head.append((h, g))
        self._pending_rows += len(h)
        if self._pending_rows >= self.chunk:
            self._flush_head()

    def _logits(self, h: torch.Tensor):
        """h Wᵀ + b (+ the LoRA terms), and whether it was written into the reused workspace."""
        z, in_ws = self._base_logits(h)
        for a, b, scale in self.adapters:  # in the adapters' dtype (as peft), added in z's
            z.add_(((h.to(a.dtype) @ a.t()) @ b.t()).mul_(scale).to(z.dtype))
        return z, in_ws

    def _base_logits(self, h: torch.Tensor):
        if not self._reuse:
            return torch.nn.functional.linear(h, self.weight, self.bias), False
        n, vocab = len(h), self.weight.shape[0]
        ws = self._workspace
        if ws is None or ws.shape[0] < n or ws.dtype != h.dtype:
            ws = self._workspace = torch.empty(max(n, min(self.chunk, 2 * n)), vocab,
                                               dtype=h.dtype, device=h.device)
        out = ws[:n]
        if self.bias is None:
            torch.mm(h, self.weight.t(), out=out)
        else:
            torch.addmm(self.bias, h, self.weight.t(), out=out)
        return out, True

    def release(self) -> None:
        """Drop the logits workspace (the walker calls this when a walk ends)."""
        self._flush_head()
        self._workspace = None

    def _flush_head(self) -> None:
        if not self._pending_head:
            return
        pending, self._pending_head, self._pending_rows = self._pending_head, [], 0
        # one piece (a flush of one chunk) is used as it is: no copy of [rows, vocab]
        h, g = pending[0] if len(pending) == 1 else (torch.cat(x) for x in zip(*pending))
        w = self.weight
        if w.grad is None:  # ∂L/∂W = gᵀ h, written once (no zero fill of [vocab, hidden])
            w.grad = (g.t() @ h).contiguous()
        else:
            w.grad.addmm_(g.t(), h)  # ∂L/∂W += gᵀ h, in place: no [vocab, hidden] temporary
        if self.bias is not None and self.bias.requires_grad:
            if self.bias.grad is None:
                self.bias.grad = torch.zeros_like(self.bias)
            self.bias.grad.add_(g.sum(0))


def _add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """p.grad += g for a trainable p (a frozen one gets no gradient)."""
    if not p.requires_grad:
        return
    if p.grad is None:
        p.grad = g.contiguous()
    else:
        p.grad.add_(g)


def _unique_sorted(r: torch.Tensor):
    """For a sorted index vector: positions of each value's first occurrence, and for every
    entry the rank of its value among the distinct ones."""
    keep = torch.ones(len(r), dtype=torch.bool, device=r.device)
    keep[1:] = r[1:] != r[:-1]
    return torch.nonzero(keep)[:, 0], torch.cumsum(keep, 0) - 1
class HeadJob:
    """One pack's head rows in a :class:`HeadQueue`; ``dhidden`` is set when flushed."""

    __slots__ = ("hidden", "terms", "dhidden", "done")

    def __init__(self, hidden, terms):
        self.hidden, self.terms, self.dhidden, self.done = hidden, terms, None, terms.empty


class HeadQueue:
    """Head rows of several packs evaluated in one call: the vocabulary-sized weight is
    streamed (and its gradient read-modify-written) once per flush instead of once per node.
    The walker flushes before a pop needs a ∂L/∂hidden, and when ``rows`` reaches its cap."""

    def __init__(self):
        self.jobs: list[HeadJob] = []
        self.rows = 0  # queued (row, target) pairs (of the whole packs)

    def add(self, hidden: torch.Tensor, terms) -> HeadJob:
        job = HeadJob(hidden.detach(), terms)
        if not job.done:  # a pack with pairs (a context-parallel rank may hold none of them)
            self.jobs.append(job)
            self.rows += terms.pairs  # the whole pack's: every rank flushes at the same push
        return job

    def flush(self, evaluate) -> bool:
        """``evaluate(hidden, terms) -> ∂L/∂hidden`` over all queued packs at once; each job
        gets its slice. Returns whether anything was evaluated."""
        if not self.jobs:
            return False
        jobs, self.jobs, self.rows = self.jobs, [], 0
        offsets = np.cumsum([0] + [len(j.hidden) for j in jobs])
        hidden = jobs[0].hidden if len(jobs) == 1 else torch.cat([j.hidden for j in jobs])
        terms = type(jobs[0].terms).concat([(j.terms, int(o)) for j, o in zip(jobs, offsets[:-1])])  # NodeTerms
        dhidden = evaluate(hidden, terms)
        for j, a, b in zip(jobs, offsets[:-1], offsets[1:]):
            # each job owns its rows: a slice would keep every queued pack's rows alive
            # until the last of them is popped (the root's, at the end of the walk)
            j.dhidden = None if dhidden is None else \
                dhidden if len(jobs) == 1 else dhidden[a:b].clone()
            j.done, j.hidden = True, None
        return True

"""The training modes the benchmark compares, behind one registry.

Every mode is ``fn(model, batch, loss, **opts) -> (float, dict)``: it adds the gradient of the same
objective (the batch's token loss under ``opts["reduction"]``, default the global token mean)
into the parameters' ``.grad`` and returns the loss value. Options a mode does not use are
ignored, so the harness passes one option dict to all of them.

All modes share the loss side: the per-occurrence weights and fields come from
:class:`dta.objective.Objective` (computed from the whole batch before any forward), and the
LM head runs only on the rows that carry a loss term, ``logits_chunk`` rows at a time
(checkpointed when there are several chunks), with a one-pass log-prob backward, so that
the baselines are at least as lean as the walker on the head and the comparison measures
packing and sharing alone.

Modes:
    padded         right-padded [B, S_max] batches of ``pad_batch`` sequences (0: all at once)
    microbatch     sequences sorted by length, packed into micro-batches of at most
                   ``microbatch_tokens`` padded tokens (default: the longest sequence, i.e.
                   one sequence at a time), gradient accumulation
    treemask       one packed row per prefix tree (trees split into packs of at most
                   ``tree_tokens`` unique tokens): DFS-ordered unique tokens, tree position ids,
                   an ancestor-only [1, 1, T, T] boolean mask, SDPA; each original occurrence
                   gathers its log-prob from the shared row (seed 000's loss mapping)
    treemask-flex  the same with a FlexAttention block mask (needs a GPU for the backward)
    dfs-node       dta.train.accumulate_gradients(packing="node", head_rows=0): the walk node
                   by node, one decoder / backward / LM-head call per node (graphs retained)
    dfs-retain     dta.train.accumulate_gradients(policy="retain", packing=opts["packing"]):
                   packs (default: the cost model's choice under ``pack_tokens``), LM head
                   batched over packs (flushed before a pop needs it, or at ``head_rows``)
    dfs-recompute  the same with policy="recompute"

Every mode returns ``(loss, calls)``: decoder forward and backward calls (and, for the tree
modes, packs; for DFS, head calls and the pack plan's statistics).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from dta.batch import Batch
from dta.objective import Objective
from dta.tree import PrefixTree

DEFAULT_TREE_TOKENS = 32768


@dataclass(frozen=True)
class Mode:
    name: str
    fn: Callable[..., float]
    help: str
    unpacked: bool = False  # trains every sequence on its own (a baseline of the speed-up)


MODES: dict[str, Mode] = {}


def register(name: str, help: str, *, unpacked: bool = False):
    def deco(fn):
        MODES[name] = Mode(name, fn, help, unpacked)
        return fn
    return deco


def run_mode(name: str, model, batch: Batch, loss, **opts) -> tuple[float, dict]:
    """(loss value, call statistics: decoder forward / backward calls, packs, head calls)."""
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    from dta.model.gdn import STATS

    STATS.reset()
    _HF_CHUNK_STEPS[0] = 0
    out = MODES[name].fn(model, batch, loss, **opts)
    value, calls = out if isinstance(out, tuple) else (float(out), {})
    if _gdn_layers(model):  # a hybrid: the GDN layers' sequential chunk iterations
        steps = STATS.steps + _HF_CHUNK_STEPS[0]
        calls = dict(calls, gdn_chunk_steps=steps, gdn_pack_calls=STATS.calls)
    return value, calls


_HF_CHUNK_STEPS = [0]  # chunk iterations of HF's own GDN kernel in the unpacked baselines


def _gdn_layers(model) -> int:
    from dta.model.recurrent import GDN, layer_types

    return layer_types(model.config).count(GDN)


def _count_hf_chunks(model, length: int) -> None:
    """HF's chunked delta rule loops over ceil(S / 64) chunks per GDN layer of a padded
    [B, S] forward (a single-token forward: its recurrent kernel, one step)."""
    from dta.planning.cost import GDN_CHUNK

    _HF_CHUNK_STEPS[0] += _gdn_layers(model) * -(-int(length) // GDN_CHUNK)


# ------------------------------------------------------------------ the loss side --
def _objective(batch: Batch, loss, opts) -> Objective:
    """Per-occurrence weights and fields, from the whole batch, before any forward."""
    return Objective(batch, loss, opts.get("reduction", "token_mean"), opts.get("totals"))


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(z)[t] with a one-pass backward: dz = g * (onehot(t) - softmax(z)). As lean
    as the walker's head (dta.model.head): one exp pass and one [rows, vocab] temporary, e = exp(z −
    max), kept for the backward, which forms −g·softmax(z) = e · (−g / Σe) in place."""

    @staticmethod
    def forward(ctx, z, t):
        top = z.amax(-1)
        e = torch.sub(z, top[:, None]).exp_()
        s = e.sum(-1)
        ctx.save_for_backward(e, t, s)
        return z.gather(-1, t[:, None])[:, 0] - (top + s.log())

    @staticmethod
    def backward(ctx, g):
        e, t, s = ctx.saved_tensors
        grad = e.mul_((-g / s)[:, None])  # e is not needed again (one backward per forward)
        return grad.scatter_add_(1, t[:, None], g[:, None]), None


def _head(model, hidden, rows, targets, need_entropy: bool, chunk: int, temperature: float):
    """Log-prob (and entropy) of each (row, target) pair, ``chunk`` rows of logits at a time,
    each chunk checkpointed when there are several (backward recomputes its logits instead of
    keeping them all)."""
    head = model.get_output_embeddings()
    outs = []
    for a in range(0, len(rows), chunk):
        t = targets[a:a + chunk]

        def fn(h, t=t):
            z = head(h)
            if z.dtype in (torch.float16, torch.bfloat16):
                z = z.float()
            if temperature != 1.0:
                z = z / temperature
            if not need_entropy:
                logp = _TargetLogprob.apply(z, t)
                return logp, logp.detach().new_zeros(0)
            lse = torch.logsumexp(z, dim=-1)
            logp = z.gather(-1, t[:, None])[:, 0] - lse
            return logp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)

        h = hidden[rows[a:a + chunk]]
        # one chunk: backward follows at once, so checkpointing would only add a head matmul
        ckpt = h.requires_grad and len(rows) > chunk
        outs.append(checkpoint(fn, h, use_reentrant=False) if ckpt else fn(h))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def rows_loss(model, hidden: torch.Tensor, batch: Batch, rowmaps: dict[int, np.ndarray],
              objective: Objective, opts) -> torch.Tensor | None:
    """Loss of the sequences in ``rowmaps`` (sequence id -> the hidden row of each of its
    tokens) from ``hidden`` [N, H]: one term per original occurrence, log-probs gathered from
    unique (row, target) pairs so shared rows sum their occurrences' gradients."""
    rows, tgts, ws = [], [], []
    fields = {k: [] for k in objective.fields}
    for i, rowmap in rowmaps.items():
        j = np.flatnonzero(objective.weights[i])  # target positions with a loss term (j >= 1)
        rows.append(rowmap[j - 1])
        tgts.append(batch.input_ids[i][j])
        ws.append(objective.weights[i][j])
        for k in fields:
            fields[k].append(objective.fields[k][i][j])
    rows, tgts = np.concatenate(rows), np.concatenate(tgts)
    if len(rows) == 0:
        return None
    width = int(tgts.max()) + 1
    uniq, inverse = np.unique(rows * width + tgts, return_inverse=True)
    dev, dt = hidden.device, hidden.dtype
    ldt = torch.float64 if dt == torch.float64 else torch.float32
    lp, ent = _head(model, hidden, torch.as_tensor(uniq // width, device=dev),
                    torch.as_tensor(uniq % width, device=dev), objective.loss.uses_entropy,
                    int(opts.get("logits_chunk", 1024)), float(opts.get("temperature", 1.0)))
    inv = torch.as_tensor(inverse.reshape(-1), device=dev)
    f = {k: torch.as_tensor(np.concatenate(v), device=dev, dtype=ldt) for k, v in fields.items()}
    w = torch.as_tensor(np.concatenate(ws), device=dev, dtype=ldt)
    values = objective.loss.values(lp[inv], ent[inv] if objective.loss.uses_entropy else None, f)
    return (w * values).sum()


def _backward(value: torch.Tensor | None) -> float:
    if value is None:
        return 0.0
    value.backward()
    return float(value.detach())


# ------------------------------------------------------------- unpacked baselines --
def _padded_step(model, batch: Batch, seq_ids, objective, opts) -> float:
    """One right-padded [B, S_max] forward/backward of sequences ``seq_ids``."""
    seq_ids = [i for i in seq_ids if objective.has_loss(i)]
    if not seq_ids:
        return None
    dev = next(model.parameters()).device
    lens = [len(batch.input_ids[i]) for i in seq_ids]
    S = max(lens)
    x = np.zeros((len(seq_ids), S), np.int64)
    am = np.zeros((len(seq_ids), S), np.int64)
    for b, i in enumerate(seq_ids):
        x[b, :lens[b]] = batch.input_ids[i]
        am[b, :lens[b]] = 1
    mask = None if am.all() else torch.as_tensor(am, device=dev)
    _count_hf_chunks(model, S)
    out = model.get_decoder()(input_ids=torch.as_tensor(x, device=dev), attention_mask=mask,
                              use_cache=False)
    hidden = out.last_hidden_state.reshape(len(seq_ids) * S, -1)
    rowmaps = {i: b * S + np.arange(lens[b]) for b, i in enumerate(seq_ids)}
    return _backward(rows_loss(model, hidden, batch, rowmaps, objective, opts))


@register("padded", "all sequences right-padded into [B, S_max] batches of pad_batch "
                    "sequences (0: one batch)", unpacked=True)
def padded(model, batch: Batch, loss, **opts) -> float:
    objective = _objective(batch, loss, opts)
    n = len(batch)
    size = int(opts.get("pad_batch") or n)
    return _steps([_padded_step(model, batch, range(a, min(a + size, n)), objective, opts)
                   for a in range(0, n, size)])


def _steps(values) -> tuple[float, dict]:
    done = [v for v in values if v is not None]
    return sum(done), dict(forward_calls=len(done), backward_calls=len(done))


def microbatches(lengths, budget: int | None) -> list[list[int]]:
    """Sequences sorted by length (longest first), packed greedily into micro-batches whose
    padded size (count x longest) stays within ``budget`` (default: the longest sequence)."""
    lengths = np.asarray(lengths)
    budget = int(budget or lengths.max())
    out, cur = [], []
    for i in np.argsort(-lengths, kind="stable"):
        if cur and (len(cur) + 1) * int(lengths[cur[0]]) > budget:
            out.append(cur)
            cur = []
        cur.append(int(i))
    return out + [cur] if cur else out


@register("microbatch", "unpacked micro-batches of at most microbatch_tokens padded tokens "
                        "(default: one sequence at a time), gradient accumulation", unpacked=True)
def microbatch(model, batch: Batch, loss, **opts) -> float:
    objective = _objective(batch, loss, opts)
    groups = microbatches(batch.lengths, opts.get("microbatch_tokens"))
    return _steps([_padded_step(model, batch, g, objective, opts) for g in groups])


# ------------------------------------------------------------- dense tree mask --
def tree_packs(sequences, budget: int = DEFAULT_TREE_TOKENS) -> list[list[int]]:
    """Sequence ids grouped into packs of at most ``budget`` unique tokens each: the
    sequences in the prefix tree's (lexicographic) order, cut greedily; a tree that does not
    fit is split (its shared prefix then appears once per pack), small trees share a pack."""
    tree = PrefixTree(sequences)
    packs, cur, used, prev = [], [], 0, None
    for i in tree.order:
        s = sequences[i]
        lcp = 0
        if prev is not None and cur:
            m = min(len(s), len(prev))
            diff = np.flatnonzero(s[:m] != prev[:m])
            lcp = int(diff[0]) if len(diff) else m
        add = len(s) - lcp  # new trie tokens (sorted order: the predecessor has the max LCP)
        if cur and used + add > budget:
            packs.append(cur)
            cur, used, add = [], 0, len(s)
        cur.append(int(i))
        used += add
        prev = s
    return packs + [cur] if cur else packs


@dataclass
class PackedTree:
    ids: np.ndarray  # [T] unique tokens, nodes in depth-first pre-order
    pos: np.ndarray  # [T] tree position ids
    node: np.ndarray  # [T] node (0-based, pre-order) of each token
    ancestor: np.ndarray  # [M, M] bool: ancestor[u, v] = v is an ancestor of u or u itself
    rowmaps: dict  # sequence id -> packed row of each of its tokens

    def dense_mask(self, device) -> torch.Tensor:
        """[1, 1, T, T] bool, True = visible: ancestors' tokens and the node's own up to q."""
        node = torch.as_tensor(self.node, device=device)
        pos = torch.as_tensor(self.pos, device=device)
        anc = torch.as_tensor(self.ancestor, device=device)
        return (anc[node][:, node] & (pos[None, :] <= pos[:, None]))[None, None]

    def block_mask(self, device):
        from torch.nn.attention.flex_attention import create_block_mask

        node = torch.as_tensor(self.node, device=device)
        pos = torch.as_tensor(self.pos, device=device)
        anc = torch.as_tensor(self.ancestor, device=device)

        def mask_mod(b, h, q, kv):
            return anc[node[q], node[kv]] & (pos[kv] <= pos[q])

        T = len(self.ids)
        return create_block_mask(mask_mod, None, None, T, T, device=device)


def pack_tree(batch: Batch, seq_ids: list[int]) -> PackedTree:
    tree = PrefixTree([batch.input_ids[i] for i in seq_ids])
    m = len(tree) - 1  # nodes without the virtual root; node u -> index u - 1
    lengths = (tree.end - tree.start)[1:]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.concatenate([tree.tokens(u) for u in range(1, m + 1)])
    pos = np.concatenate([np.arange(tree.start[u], tree.end[u]) for u in range(1, m + 1)])
    node = np.repeat(np.arange(m), lengths)
    size = np.ones(m + 1, np.int64)  # subtree sizes in nodes (pre-order: children after parent)
    for u in range(m, 0, -1):
        size[tree.parent[u]] += size[u]
    u_, v_ = np.arange(1, m + 1)[:, None], np.arange(1, m + 1)[None, :]
    ancestor = (v_ <= u_) & (u_ < v_ + size[1:][None, :])
    leaf = tree.leaf_of()
    rowmaps = {}
    for local, i in enumerate(seq_ids):
        rowmaps[i] = np.concatenate([np.arange(offsets[u - 1], offsets[u])
                                     for u in tree.path(int(leaf[local]))])
    return PackedTree(ids, pos, node, ancestor, rowmaps)


@contextlib.contextmanager
def attention(model, impl: str):
    """Run with attention implementation ``impl`` and restore the model's afterwards."""
    old = model.config._attn_implementation
    if old != impl:
        model.set_attn_implementation(impl)
    try:
        yield
    finally:
        if old != impl:
            model.set_attn_implementation(old)


def refuse_recurrent(model_or_config, mode: str) -> None:
    """A tree mask only restricts which keys a query sees; a recurrent (Gated DeltaNet) layer
    has no keys: packed siblings would run through one another's state. Refuse, clearly."""
    from dta.model.recurrent import is_hybrid

    if is_hybrid(model_or_config):
        raise ValueError(f"mode {mode!r} cannot train a model with recurrent (Gated DeltaNet) "
                         "layers: a tree mask cannot fork a recurrent state; use padded, microbatch "
                         "or a dfs-* mode")


def _treemask(model, batch: Batch, loss, flex: bool, opts) -> float:
    refuse_recurrent(model, "treemask-flex" if flex else "treemask")
    objective = _objective(batch, loss, opts)
    dev = next(model.parameters()).device
    active = [i for i in range(len(batch)) if objective.has_loss(i)]
    total, calls = 0.0, 0
    with attention(model, "flex_attention" if flex else "sdpa"):
        for pack in tree_packs([batch.input_ids[i] for i in active],
                               int(opts.get("tree_tokens") or DEFAULT_TREE_TOKENS)):
            packed = pack_tree(batch, [active[k] for k in pack])
            mask = packed.block_mask(dev) if flex else packed.dense_mask(dev)
            out = model.get_decoder()(
                input_ids=torch.as_tensor(packed.ids, device=dev)[None],
                position_ids=torch.as_tensor(packed.pos, device=dev)[None],
                attention_mask=mask, use_cache=False)
            del mask
            total += _backward(rows_loss(model, out.last_hidden_state[0], batch,
                                         packed.rowmaps, objective, opts))
            calls += 1
    return total, dict(forward_calls=calls, backward_calls=calls, packs=calls)


@register("treemask", "dense tree-mask packing: one row per tree (split at tree_tokens), "
                      "ancestor-only [1,1,T,T] bool mask, SDPA")
def treemask(model, batch: Batch, loss, **opts) -> float:
    return _treemask(model, batch, loss, False, opts)


@register("treemask-flex", "tree-mask packing with a FlexAttention block mask (GPU only: no "
                           "FlexAttention backward on CPU)")
def treemask_flex(model, batch: Batch, loss, **opts) -> float:
    return _treemask(model, batch, loss, True, opts)


# ------------------------------------------------------------------------- DFS --
def _dfs(policy: str, node_by_node: bool = False):
    def fn(model, batch: Batch, loss, **opts):
        from dta.train import accumulate_gradients

        if node_by_node:  # the unpacked walk: one decoder call and one head call per node
            kw = dict(packing="node", head_rows=0)
        else:
            kw = dict(packing=opts.get("packing") or "auto",
                      pack_tokens=opts.get("pack_tokens") or None,  # None: the walker's default
                      head_rows=opts.get("head_rows"))
        res = accumulate_gradients(model, batch, loss, reduction=opts.get("reduction", "token_mean"),
                                   totals=opts.get("totals"), policy=policy,
                                   temperature=float(opts.get("temperature", 1.0)),
                                   logits_chunk=int(opts.get("logits_chunk", 1024)), **kw)
        return float(res.loss), dict(res.walk.calls(), recomputed_tokens=res.walk.recomputed_tokens,
                                     plan=res.walk.plan)
    return fn


register("dfs-node", "DFS walk node by node (one decoder, backward and LM-head call per node), "
                     "graphs retained along the path")(_dfs("retain", node_by_node=True))
register("dfs-retain", "DFS walk over packs (--packing, --pack-tokens), batched LM head, each "
                       "pack's graph retained along the path")(_dfs("retain"))
register("dfs-recompute", "DFS walk over packs, batched LM head, packs re-forwarded at pop (only "
                          "K/V kept)")(_dfs("recompute"))

DEFAULT_MODES = ("padded", "microbatch", "treemask", "dfs-node", "dfs-retain", "dfs-recompute")

"""Gated DeltaNet inside a pack: one layer call over a pack's local tree, states forked exactly.

A pack (``dta/planning/packs.py``) forwards several tree nodes in one decoder call. Its
full-attention layers take the pack's tree mask; a GDN layer has no mask but two running
states (``dta/model/recurrent.py``), which here follow the pack's local tree:

* the causal conv is a gather: row r's window is the ``kernel`` inputs ending at r *on its
  root path* (its own node's earlier rows, then its ancestors' last rows in the pack, then the
  pack's initial conv state: the final state of the node the pack hangs from, or zeros for a
  root) — every row at once, no loop (on CUDA: flash-linear-attention's varlen conv kernel,
  one sequence per segment, ``dta.model.gdn_kernels``);
* the chunked delta rule runs over *segments* (maximal runs of local nodes that continue a
  recurrence without a fork: a node's only in-pack child continues it, unless the node hands
  its final state to a pack below). Each segment is cut into chunks from its own start (the
  last one zero-padded: a padded token has k = v = 0, β = 0, g = 0 and changes nothing, as in
  HF's kernel). The intra-chunk work of every chunk of the pack is batched; the sequential
  scan runs as a wavefront: at step s every chunk whose state is ready goes, as a row of one
  batched call, each row starting from its own segment's previous chunk or, for a segment's
  first chunk, from its parent segment's final state (which the step before produced) or the
  pack's initial state (ART's depth-by-depth plan, seed 002, with each branch chunked from its
  own start instead of replaying the parent's ragged tail). A chain pack is one segment.

The scan takes as many steps as the pack's deepest root-to-leaf chain of chunks, not as
many as it has chunks, so the per-chunk Python overhead of a node-by-node walk (one call and
one chunk loop per node) is paid once per step for all rows. The plan is integers
(:func:`plan_recurrence`, numpy), shared by every GDN layer of the forward.

The math mirrors ``transformers``' ``torch_chunk_gated_delta_rule`` and the GDN forward of
Qwen3.5 / Qwen3.5-MoE / Qwen3-Next line by line (projections, l2-normalized q and k, the
float32 kernel, the gated RMSNorm); ``tests/test_hybrid_packs.py`` holds it to 1e-10 in float64
against per-sequence training through HF's own forward, and the walker's self-check compares it
with the model's own forward before training.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# The delta rule's chunk: the largest a pack uses. A pack whose segments are all short uses
# the smallest power of two >= its longest segment (at least MIN_CHUNK): a chunk's padded rows
# cost the batched intra-chunk work (C x C products and solves). experiments/bench_gdn_chunk.py
# measures the choice (fixed 16 / 32 / 64 / 128 against this adaptive rule).
CHUNK = 64
MIN_CHUNK = 16
ADAPTIVE = True


@dataclass
class RecurrencePlan:
    """Integers of one pack's GDN layers (see the module doc); torch index tensors on demand."""

    tokens: int
    kernel: int
    chunk: int
    conv_index: np.ndarray  # [T, K] into [initial conv state (K columns) | pack rows (T)]
    state_index: np.ndarray  # [n_open, K]: the conv windows ending at each handed-on node
    chunk_rows: np.ndarray  # [N, C] rows of each chunk (T = the zero pad row), chunks by step
    row_slot: np.ndarray  # [T] slot of each row in the flattened [N * C] chunk rows
    steps: list  # per step: (lo, hi) range of its chunks
    sources: list  # per step s >= 1: index into step s-1's chunks, or None (the same order)
    finals: list  # per step: positions of its chunks that end a handed-on node (or None)
    final_order: np.ndarray  # [n_open]: handed-on node i's final state in the gathered order
    segments: np.ndarray | None = None  # [n_seg, 3]: row start, row end, parent segment (-1)
    open_segment: np.ndarray | None = None  # [n_open]: the segment handed-on node i ends
    segment_window: np.ndarray | None = None  # [n_seg, K]: the conv window before each segment
    _torch: dict | None = None

    @property
    def chunks(self) -> int:
        return len(self.chunk_rows)

    def tensors(self, device) -> dict:
        if self._torch is None or self._torch["device"] != device:
            t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.long, device=device)
            self._torch = dict(device=device, conv=[t(self.conv_index[:, j]) for j in range(self.kernel)],
                               state=t(self.state_index.reshape(-1)), rows=t(self.chunk_rows.reshape(-1)),
                               slot=t(self.row_slot),
                               sources=[None if s is None else t(s) for s in self.sources],
                               finals=[None if f is None else t(f) for f in self.finals],
                               order=t(self.final_order),
                               window=None if self.segment_window is None
                               else t(self.segment_window.reshape(-1)),
                               segment_bounds=None if self.segments is None  # cu_seqlens
                               else t(np.r_[self.segments[:, 0], self.tokens]))
        return self._torch


def _local_parents(layout) -> np.ndarray:
    """Per local node, its parent's local index (-1: it hangs from the pack's parent)."""
    m = len(layout.tree_nodes)
    par = np.full(m, -1, dtype=np.int64)
    stack: list[int] = []
    for i in range(m):  # local nodes are in pre-order
        while stack and not (layout.enter[i] < layout.exit[stack[-1]]):
            stack.pop()
        par[i] = stack[-1] if stack else -1
        stack.append(i)
    return par


def open_nodes(layout) -> np.ndarray:
    """Local nodes whose final state a pack below reads (all of them when the layout does not say)."""
    hands_on = getattr(layout, "open", None)
    return np.arange(len(layout.tree_nodes)) if hands_on is None else np.asarray(hands_on, dtype=np.int64)


def plan_recurrence(layout, kernel: int, chunk: int = CHUNK) -> RecurrencePlan:
    """The GDN plan of a pack (integers; see the module doc)."""
    T, m = layout.tokens, len(layout.tree_nodes)
    off = np.asarray(layout.offsets, dtype=np.int64)
    par = _local_parents(layout)
    hands_on = open_nodes(layout)
    is_open = np.zeros(m, bool)
    is_open[hands_on] = True
    # the causal conv: each row's previous row on its root path (-1: before the pack)
    prev = np.arange(-1, T - 1, dtype=np.int64)
    first = off[:-1]
    prev[first] = np.where(par >= 0, off[np.maximum(par, 0) + 1] - 1, -1)
    conv = np.empty((T, kernel), dtype=np.int64)
    src = kernel + np.arange(T)  # index into [init (K) | rows (T)]
    conv[:, kernel - 1] = src
    for j in range(kernel - 2, -1, -1):
        row = src - kernel
        back = np.where(src >= kernel, np.where(prev[np.maximum(row, 0)] >= 0,
                                                kernel + prev[np.maximum(row, 0)], kernel - 1), src - 1)
        src = back
        conv[:, j] = src
    state_index = conv[off[hands_on + 1] - 1] if len(hands_on) else np.zeros((0, kernel), np.int64)
    # segments: a node continues its parent's recurrence when it is the parent's only in-pack
    # child and the parent hands no state on
    kids = np.bincount(par[par >= 0], minlength=m)
    cont = (par >= 0) & (kids[np.maximum(par, 0)] == 1) & ~is_open[np.maximum(par, 0)]
    seg_of = np.empty(m, dtype=np.int64)
    segs: list[list[int]] = []  # [row start, row end, parent segment]
    for i in range(m):
        if cont[i]:
            seg_of[i] = seg_of[par[i]]
            segs[seg_of[i]][1] = int(off[i + 1])
        else:
            seg_of[i] = len(segs)
            segs.append([int(off[i]), int(off[i + 1]), int(seg_of[par[i]]) if par[i] >= 0 else -1])
    lengths = np.array([b - a for a, b, _ in segs], dtype=np.int64)
    # the conv window just before each segment (a conv kernel's initial state): the window
    # ending at the segment's previous row on its root path, or the pack's initial state
    before = prev[[a for a, _, _ in segs]]
    segment_window = np.where(before[:, None] >= 0, conv[np.maximum(before, 0)],
                              np.arange(kernel)[None, :])
    C = int(min(chunk, max(MIN_CHUNK, 1 << int(max(lengths.max(), 1) - 1).bit_length()))) \
        if ADAPTIVE else int(chunk)
    nch = -(-lengths // C)
    begin = np.zeros(len(segs), dtype=np.int64)  # the step of each segment's first chunk
    for s, (_, _, p) in enumerate(segs):  # parents come first (pre-order)
        if p >= 0:
            begin[s] = begin[p] + nch[p]
    seg_id = np.repeat(np.arange(len(segs)), nch)
    idx_in = np.concatenate([np.arange(n) for n in nch]) if len(nch) else np.zeros(0, np.int64)
    step = begin[seg_id] + idx_in
    order = np.lexsort((seg_id, step))  # chunks by step (then segment)
    seg_id, idx_in, step = seg_id[order], idx_in[order], step[order]
    pos = np.empty(len(order), dtype=np.int64)
    pos[:] = np.arange(len(order))
    where = {(int(s), int(c)): int(p) for s, c, p in zip(seg_id, idx_in, pos)}
    starts = np.array([segs[s][0] for s in seg_id], dtype=np.int64) + idx_in * C
    ends = np.array([segs[s][1] for s in seg_id], dtype=np.int64)
    rows = starts[:, None] + np.arange(C)[None, :]
    chunk_rows = np.where(rows < ends[:, None], rows, T)
    row_slot = np.empty(T, dtype=np.int64)
    valid = chunk_rows < T
    row_slot[chunk_rows[valid]] = np.flatnonzero(valid.reshape(-1))
    n_steps = int(step.max()) + 1 if len(step) else 0
    bounds = np.searchsorted(step, np.arange(n_steps + 1))
    steps = [(int(bounds[s]), int(bounds[s + 1])) for s in range(n_steps)]
    sources: list = [None]
    for s in range(1, n_steps):
        lo, hi = steps[s]
        plo = steps[s - 1][0]
        srcs = np.array([where[(int(seg_id[p]), int(idx_in[p]) - 1)] if idx_in[p] > 0
                         else where[(segs[int(seg_id[p])][2], int(nch[segs[int(seg_id[p])][2]]) - 1)]
                         for p in range(lo, hi)], dtype=np.int64) - plo
        sources.append(None if np.array_equal(srcs, np.arange(steps[s - 1][1] - plo)) else srcs)
    # handed-on nodes end their segments: their final state is their segment's last chunk's
    last = {int(s): where[(int(s), int(nch[s]) - 1)] for s in seg_of[hands_on]}
    finals, gathered = [], []
    for s, (lo, hi) in enumerate(steps):
        here = sorted({last[int(seg_of[u])] for u in hands_on if lo <= last[int(seg_of[u])] < hi})
        finals.append(np.array(here, dtype=np.int64) - lo if here else None)
        gathered += here
    rank = {p: i for i, p in enumerate(gathered)}
    final_order = np.array([rank[last[int(seg_of[u])]] for u in hands_on], dtype=np.int64)
    return RecurrencePlan(T, kernel, C, conv, state_index, chunk_rows, row_slot, steps, sources,
                          finals, final_order, np.asarray(segs, dtype=np.int64).reshape(-1, 3),
                          seg_of[hands_on].astype(np.int64), segment_window)


# ------------------------------------------------------------------------ kernels --
def conv_source(x: torch.Tensor, init: torch.Tensor | None, K: int) -> torch.Tensor:
    """[initial conv state (K rows) | the pack's rows x [T, D]]: what every conv window indexes
    (init [1, D, K], HF's conv-state layout, or None: zeros)."""
    first = init[0].transpose(0, 1) if init is not None else x.new_zeros(K, x.shape[1])
    return torch.cat([first.to(x.dtype), x], dim=0)


def tree_conv(src: torch.Tensor, weight: torch.Tensor, bias, plan, ix: dict) -> torch.Tensor:
    """The causal conv of every pack row at once, before the activation [T, D]: a gather of
    each row's window on its root path from ``src`` (:func:`conv_source`); weight [D, K]."""
    K = plan.kernel
    # half precision accumulates in float32 and is rounded once, as a conv kernel does
    # (torch's conv1d, causal-conv1d, flash-linear-attention): per-sequence training's rounding
    acc = torch.promote_types(src.dtype, torch.float32)
    w = weight.to(acc)

    def taps(src, w):
        out = None
        for j in range(K):
            term = src.index_select(0, ix["conv"][j]).to(acc) * w[:, j]
            out = term if out is None else out + term
        return out

    # the K gathered windows [T, D] would each be saved for w's gradient (K x the layer's
    # widest activation, the largest GDN item at a retain walk's peak: experiments/
    # hybrid_memory.py); backward re-gathers them from src instead (same ops: exact)
    if torch.is_grad_enabled() and (src.requires_grad or w.requires_grad):
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(taps, src, w, use_reentrant=False)
    else:
        out = taps(src, w)
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(src.dtype)


def handed_on_conv_states(src: torch.Tensor, plan, ix: dict) -> torch.Tensor:
    """The conv windows ending at each handed-on node [n, D, K] (HF's conv-state layout)."""
    n, K = len(plan.state_index), plan.kernel
    return src.index_select(0, ix["state"]).view(n, K, src.shape[1]).transpose(1, 2)


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)  # HF's / FLA's l2norm


def tree_delta_rule(query, key, value, g, beta, init: torch.Tensor | None, plan, ix: dict):
    """The chunked gated delta rule over a pack's segments (module doc). query, key [T, Hk, dk];
    value [T, Hv, dv]; g, beta [T, Hv]; init [1, Hv, dk, dv] or None (zeros). Returns the
    output [T, Hv, dv] and the handed-on nodes' final states [n, Hv, dk, dv]."""
    initial_dtype = query.dtype
    T, Hk, dk = key.shape
    Hv, dv = value.shape[-2:]
    C = plan.chunk
    if Hk != Hv:
        query = query.repeat_interleave(Hv // Hk, dim=1)
        key = key.repeat_interleave(Hv // Hk, dim=1)
    query, key, value, beta, g = [x.to(torch.float32) for x in (query, key, value, beta, g)]
    query = _l2norm(query)
    key = _l2norm(key)
    query = query * dk ** -0.5
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)

    def chunked(x):  # [T, ...] -> [N, H, C, ...] (pad rows zero), contiguous: each batched
        # product would otherwise copy (and save for backward) its own contiguous operand
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, ix["rows"])
        x = x.view(plan.chunks, C, *x.shape[1:])
        return x.transpose(1, 2).contiguous()

    query, key, k_beta, v_beta = (chunked(x) for x in (query, key, k_beta, v_beta))
    decay = chunked(g)  # [N, H, C]
    upper = torch.ones(C, C, dtype=torch.bool, device=query.device).triu(1)
    cum = decay.cumsum(dim=-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    query = query * cum.exp().unsqueeze(-1)
    key_t = (key * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    lo0, hi0 = plan.steps[0]
    if init is None:
        state = new_values.new_zeros(hi0 - lo0, Hv, dk, dv)
    else:
        state = init.to(new_values).expand(hi0 - lo0, -1, -1, -1)
    outs, finals = [], []
    for s, (lo, hi) in enumerate(plan.steps):
        if s and ix["sources"][s] is not None:
            state = state.index_select(0, ix["sources"][s])
        v_new = new_values[lo:hi] - k_cumdecay[lo:hi] @ state
        outs.append(query[lo:hi] @ state + intra[lo:hi] @ v_new)
        state = state * chunk_decay[lo:hi] + key_t[lo:hi] @ v_new
        if ix["finals"][s] is not None:
            finals.append(state.index_select(0, ix["finals"][s]))
    STATS.steps += len(plan.steps)
    STATS.chunks += plan.chunks
    out = torch.cat(outs).transpose(1, 2).reshape(plan.chunks * C, Hv, dv).index_select(0, ix["slot"])
    if finals:
        final = torch.cat(finals).index_select(0, ix["order"])
    else:
        final = new_values.new_zeros(0, Hv, dk, dv)
    return out.to(initial_dtype), final


@dataclass
class Stats:
    """Counters of the pack path (all GDN layers, forward calls): the benchmark reads them."""

    calls: int = 0  # GDN layer calls over a pack
    steps: int = 0  # sequential chunk steps (the scan's Python iterations)
    chunks: int = 0  # chunks computed (padded)

    def reset(self) -> None:
        self.calls = self.steps = self.chunks = 0

    def as_dict(self) -> dict:
        return dict(gdn_calls=self.calls, gdn_chunk_steps=self.steps, gdn_chunks=self.chunks)


STATS = Stats()


# ------------------------------------------------------------------- the layer --
def _projections(module, hidden: torch.Tensor):
    """(mixed q|k|v [1, T, conv_dim], z [1, T, Hv, dv], b [1, T, Hv], a [1, T, Hv]): the GDN
    layer's input projections, as its own forward computes them (Qwen3.5 and Qwen3.5-MoE:
    separate qkv / z / b / a projections; Qwen3-Next: fused qkvz / ba, reordered by the
    module's own ``fix_query_key_value_ordering``)."""
    batch, T, _ = hidden.shape
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden),
                                                               module.in_proj_ba(hidden))
        q, k, v = (x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v))
        return torch.cat((q, k, v), dim=-1), z, b, a
    z = module.in_proj_z(hidden).reshape(batch, T, -1, module.head_v_dim)
    return module.in_proj_qkv(hidden), z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def supports(module) -> str | None:
    """None when the pack path knows this GDN module's layout, else why not."""
    need = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "key_dim", "value_dim",
            "head_k_dim", "head_v_dim", "layer_idx", "activation")
    missing = [n for n in need if not hasattr(module, n)]
    if not (hasattr(module, "in_proj_qkvz") and hasattr(module, "fix_query_key_value_ordering")) \
            and not all(hasattr(module, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        missing.append("in_proj_qkv/z/b/a or in_proj_qkvz/ba")
    return f"{type(module).__name__} lacks {', '.join(missing)}" if missing else None


def pack_forward(module, hidden_states: torch.Tensor, layer) -> torch.Tensor:
    """The GDN layer's forward over a pack (``layer``: its ``dta.model.hf_cache.PackStateLayer``):
    the projections of the rows given (``hidden_states`` [1, rows, hidden]); the conv and the
    delta rule over every row of the pack for the heads the layer holds (:class:`AllHeads`,
    or context parallelism's split, ``dta.model.cp_gdn``)."""
    from transformers.activations import ACT2FN

    plan, ix = layer.plan, layer.plan.tensors(hidden_states.device)
    T, rows = plan.tokens, hidden_states.shape[1]
    heads = AllHeads(module) if layer.heads is None else layer.heads(module)
    mixed_qkv, z, b, a = _projections(module, hidden_states)
    mixed_qkv, z, b, a = heads.to_heads(mixed_qkv[0], z[0], b[0], a[0])
    from dta.model.gdn_kernels import kernel_conv, kernel_delta_rule, segment_kernel

    kernel = segment_kernel(hidden_states) if layer.kernels else None
    src = conv_source(mixed_qkv, layer.initial[0], plan.kernel)
    conv_args = (src, heads.channels(module.conv1d.weight.squeeze(1)),
                 heads.channels(module.conv1d.bias), plan, ix)
    conv = tree_conv(*conv_args) if kernel is None else kernel_conv(kernel, *conv_args)
    conv_state = handed_on_conv_states(src, plan, ix)
    mixed_qkv = ACT2FN[module.activation](conv).to(mixed_qkv.dtype)
    query, key, value = torch.split(mixed_qkv, [heads.key_dim, heads.key_dim, heads.value_dim], dim=-1)
    query = query.reshape(T, -1, module.head_k_dim)
    key = key.reshape(T, -1, module.head_k_dim)
    value = value.reshape(T, -1, module.head_v_dim)
    query, key = heads.queries(query, key)
    beta = b.sigmoid()
    g = -heads.heads(module.A_log).float().exp() * F.softplus(a.float() + heads.heads(module.dt_bias))
    if kernel is None:
        core, state = tree_delta_rule(query, key, value, g, beta, layer.initial[1], plan, ix)
    else:
        core, state = kernel_delta_rule(kernel, query, key, value, g, beta, layer.initial[1], plan)
    STATS.calls += 1
    layer.final = (conv_state, state)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(heads.to_rows(core.reshape(T, -1)).reshape(1, rows, -1))


class AllHeads:
    """Every head and channel of a GDN layer, every row: what ``pack_forward`` reads from a
    layer that holds them all (nothing exchanged, nothing sliced)."""

    def __init__(self, module):
        self.key_dim, self.value_dim = module.key_dim, module.value_dim

    @staticmethod
    def to_heads(mixed, z, b, a):
        return mixed, z, b, a

    @staticmethod
    def channels(w):
        return w

    @staticmethod
    def heads(p):
        return p

    @staticmethod
    def queries(query, key):
        return query, key

    @staticmethod
    def to_rows(core):
        return core


def _dispatching_forward(self, hidden_states, *args, **kwargs):
    """The GDN module's forward during a walk: over a pack, :func:`pack_forward`; any other
    call (a plain forward, HF's cache) runs the module's own forward unchanged."""
    from dta.model.hf_cache import PackStateLayer, cache_in

    cache = cache_in(kwargs)
    layer = None
    if cache is not None and self.layer_idx < len(getattr(cache, "layers", ())):
        layer = cache.layers[self.layer_idx]
    if isinstance(layer, PackStateLayer):
        return pack_forward(self, hidden_states, layer)
    return type(self).forward(self, hidden_states, *args, **kwargs)


@contextlib.contextmanager
def packed_gdn(modules: list):
    """For the duration of a walk, the GDN ``modules`` take a pack's tree (instance-level
    forwards, removed afterwards: the model is left as it was)."""
    import types

    patched = []
    try:
        for m in modules:
            if "forward" not in vars(m):
                m.forward = types.MethodType(_dispatching_forward, m)
                patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward

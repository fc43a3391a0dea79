"""Verification: train one batch by DFS and unpacked (one sequence at a time), compare.

Reported relative errors (max over everything compared):
  logprobs  max_j |dfs_j - ref_j| / max(|ref_j|, 1) over every position of every sequence
  loss      |dfs - ref| / |ref|
  grad      max over parameters of ||g_dfs - g_ref|| / max(||g_ref||, 1e-8 ||G_ref||)
            (relative L2 per tensor; G_ref = the whole gradient, all tensors together)
  params    max over parameters of ||p_dfs - p_ref|| / ||p_ref|| after one AdamW step
  update    max over parameters of ||Δ_dfs - Δ_ref|| / ||Δ_ref|| for the same step
            (Δ = parameter after the step minus before). Much stricter than
            `params`, and ill-conditioned in float32: Adam's first step is about lr·sign(g),
            so a gradient entry at float32 noise level can flip a whole lr-sized update entry.
The 1e-8 floor is for gradients that are zero in exact arithmetic (OPT's ``k_proj.bias``:
softmax is invariant to a shift of all scores of a query, and a key bias shifts them all):
both sides then hold rounding noise ~1e-20 whose per-tensor relative difference is O(1).
Such a tensor is compared against the whole gradient's norm instead (and its update, which
Adam's g/(|g|+eps) makes ~lr·noise/eps, against the whole update's norm; and, as a zero-
initialized bias is then only that noisy update, its value after the step against the
whole parameter norm); any tensor whose gradient is at least 1e-8 of the whole keeps its
own norms as the denominators.
The AdamW step's eps defaults to 1e-8 in float64 and to 1e-5 (AReaL's default) otherwise:
Adam's update g/(|g|+eps) amplifies an absolute gradient error by about 1/eps where |g| is
near eps, so with eps 1e-8 a float32 rounding error of 1e-10 in a 5e-9 gradient entry (seen
in a zero-initialized Qwen2 key bias) moves that parameter's update by 2 %. That is the
optimizer's conditioning, not a difference between DFS and unpacked training.
Honesty rules: a NaN or inf anywhere in a comparison makes that error NaN/inf and the check a
failure (never dropped by ``max``). The training walk computes log-probs only where a loss
term needs them (sequences with no trained token are not walked, or only along a prefix they
share), so it is compared on the sequences it walks whole; a forward-only walk of every
sequence is compared at every position as well.
A float64 check runs a *truly* float64 model (norms patched to stay in float64; see
``dta.model.models.make_truly_float64``); otherwise HF's float32 RMSNorm caps agreement near 1e-7.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import asdict, dataclass

import torch

from dta.batch import Batch
from dta.losses import SequenceLoss, TokenLoss, token_weights
from dta.model.context_parallel import context_parallel_of, parallelize_context
from dta.model.expert_parallel import expert_parallel_of, parallelize_experts
from dta.model.models import make_truly_float64
from dta.options import WalkOptions
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients, forward_logprobs, validate_for_model


@dataclass
class VerifyReport:
    dtype: str
    policy: str
    reduction: str
    sequences: int
    total_tokens: int
    unique_tokens: int
    sharing_ratio: float
    parameters: int
    logprobs_rel_err: float
    loss_rel_err: float
    grad_rel_err: float
    params_rel_err: float
    update_rel_err: float
    loss_dfs: float
    loss_ref: float
    max_live_graphs: int
    tree_depth: int
    truly_float64: bool
    adam_eps: float
    logprobs_sequences: int = 0  # sequences whose training-walk log-probs were compared
    packing: str = WalkOptions.default("packing")  # the DFS side's pack policy and cap
    pack_tokens: int = 0
    packs: int = 0  # packs (decoder calls) of the training walk
    nodes: int = 0  # tree nodes walked
    block_tokens: int | None = None  # the DFS side's block (None: no cut)
    blocks_cut: int = 0  # pieces the cut added to the tree
    trainable_parameters: int = 0  # LoRA: the adapters' (every parameter without)
    frozen_with_grad: int = 0  # frozen tensors that got a gradient on either side (must be 0)
    context_parallel: int = 1  # ranks of the group the DFS side's walks were divided over
    context_parallel_sent_bytes: int = 0  # what this rank sent in the DFS side's walks
    context_parallel_path_kv_bytes: int = 0  # the most path K/V (+ gradients) it stored at once
    path_tokens: int = 0  # the longest path a pack attended to (cached tokens)
    # per rank of the group (``dta verify --context-parallel``): sent_bytes, path_kv_bytes,
    # path_kv_alone_bytes (one process walking the same batch alone), path_kv_share
    context_parallel_ranks: dict | None = None
    expert_parallel: int = 1  # ranks of the group the DFS side's experts were divided over
    expert_parallel_sent_bytes: int = 0  # what this rank's expert exchanges sent
    expert_weight_share: float = 1.0  # this rank's expert weights / the model's

    def max_rel_err(self) -> float:
        """The figure held to the tolerance: everything in float64; outside float64 the
        update itself is left out (ill-conditioned, see the module docstring), the
        parameters after the step are not. NaN if any error is NaN, inf if any is inf."""
        errs = [self.logprobs_rel_err, self.loss_rel_err, self.grad_rel_err, self.params_rel_err]
        return worst(errs + [self.update_rel_err] if self.dtype == "float64" else errs)

    def passed(self, tolerance: float) -> bool:
        """Every error finite and within ``tolerance`` (and a context-parallel walk's ranks
        exchanged data: one that sent nothing checked nothing of it)."""
        err = self.max_rel_err()
        return math.isfinite(err) and err <= tolerance and self.frozen_with_grad == 0 \
            and not self.vacuous

    @property
    def vacuous(self) -> bool:
        """A context- or expert-parallel check whose rank sent nothing."""
        return (self.context_parallel > 1 and self.context_parallel_sent_bytes == 0) or \
            (self.expert_parallel > 1 and self.expert_parallel_sent_bytes == 0)

    def as_dict(self) -> dict:
        return {**asdict(self), "max_rel_err": self.max_rel_err()}


def worst(errors) -> float:
    """max that keeps NaN (Python's ``max`` may drop it) and inf."""
    errors = [float(e) for e in errors]
    if any(math.isnan(e) for e in errors):
        return math.nan
    return max(errors, default=0.0)


@contextlib.contextmanager
def _bar(enabled: bool, desc: str):
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(desc=desc, unit="tok", leave=False) as bar:
        yield bar.update


ZERO_FLOOR = 1e-8  # see the module docstring: gradients that are zero in exact arithmetic


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.nan
    denom = max(float(b.norm()), floor)
    diff = float((a - b).norm())
    return diff / denom if denom > 0 else diff


def _whole_norm(tensors) -> float:
    return float(sum(float(t.double().norm()) ** 2 for t in tensors)) ** 0.5


def _adamw_step(model, lr: float, eps: float) -> tuple[dict, dict]:
    """Parameters after one AdamW step, and the step itself."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=lr, eps=eps, weight_decay=0.01).step()
    after = {n: p.detach() for n, p in model.named_parameters()}
    return after, {n: after[n] - before[n] for n in after}


def verify(model, batch: Batch, loss: TokenLoss | SequenceLoss, *, reduction: str = "token_mean",
           lr: float = 1e-3, adam_eps: float | None = None,
           truly_float64: bool = True, progress: bool = False,
           options: WalkOptions | None = None, context_parallel_group=None,
           expert_parallel_group=None, **settings) -> VerifyReport:
    """Train `batch` both ways on two copies of `model`; the model itself is not changed.
    With `progress`, a bar per side counts the tokens trained. options / settings: the DFS
    side's walk settings (:class:`dta.options.WalkOptions`, or its fields as keywords: policy,
    packing, pack_tokens, block_tokens, ...), used by the training and the forward-only walks;
    the reference takes their ``temperature`` and router aux loss coefficient (both sides add
    each sequence's router load-balancing loss, docs/moe.md); a batch's ``routed_experts``
    are replayed on both sides. Frozen parameters (a LoRA model's
    base) must end without a gradient on both sides. context_parallel_group: the DFS side
    walks with its K/V spread over this group (``dta.model.context_parallel``; every rank of
    the group calls ``verify`` with the same model and batch); the reference runs alone.
    expert_parallel_group: the DFS side's MoE experts divided over this group
    (``dta.model.expert_parallel``), the context-parallel group itself (its ranks walk one
    tree, each routing its own rows): every expert slice's gradient is then whole on its
    rank, and the slices are gathered to whole tensors to be compared."""
    walk = WalkOptions.given(options, settings)
    validate_for_model(batch, model, loss)
    dfs_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    is_f64 = next(model.parameters()).dtype == torch.float64
    if is_f64 and truly_float64:
        make_truly_float64(dfs_model)
        make_truly_float64(ref_model)
    for m in (dfs_model, ref_model):
        m.zero_grad(set_to_none=True)
    if expert_parallel_group is not None:
        if expert_parallel_group is not context_parallel_group:
            raise ValueError("verify: the experts are divided over the context-parallel group "
                             "(expert_parallel_group must be context_parallel_group)")
        from dta.selfcheck import ensure_self_check

        ensure_self_check(dfs_model)  # alone, on the whole experts (as the engine core does)
    cp = context_parallel_of(parallelize_context(dfs_model, context_parallel_group))
    ep = expert_parallel_of(parallelize_experts(dfs_model, expert_parallel_group))
    sent = cp.sent_bytes if cp is not None else 0
    ep_sent = ep.sent_bytes if ep is not None else 0
    if cp is not None:
        cp.path_bytes_peak = cp.path_bytes

    with _bar(progress, "DFS (unique tokens)") as bar:
        dfs = accumulate_gradients(dfs_model, batch, loss, reduction=reduction, options=walk,
                                   record=True, progress=bar)
    if cp is not None and cp.partial_gradients:  # each rank holds its share: the group's sum
        cp.sum_gradients(dfs_model, exclude=ep.expert_parameters() if ep is not None else ())
    if ep is not None:
        ep.check()
    slices = {n for n, p in dfs_model.named_parameters() if ep is not None and ep.is_expert(p)}

    def whole(name, t):  # an expert slice gathered over its group (every rank, same order)
        return ep.full_tensor(t) if name in slices else t

    path_kv = cp.path_bytes_peak if cp is not None else 0
    with _bar(progress, "unpacked (tokens)") as bar:
        ref = unpacked_gradients(ref_model, batch, loss, reduction=reduction,
                                 temperature=walk.temperature, progress=bar,
                                 router_aux_loss_coef=walk.router_aux_coef)

    # the training walk: on the sequences it walks whole (those with a loss term)
    walked = [bool(w.any()) for w in token_weights(batch, reduction)]
    lp_errs = [_lp_err(a, b) for a, b, k in zip(dfs.walk.logprobs, ref.logprobs, walked) if k]
    # a forward-only walk: every sequence, every position
    fwd = forward_logprobs(dfs_model, batch, options=walk)
    lp_errs += [_lp_err(a, b) for a, b in zip(fwd.logprobs, ref.logprobs)]
    lp_err = worst(lp_errs)
    grad_errs = []
    ref_params = dict(ref_model.named_parameters())
    g_floor = ZERO_FLOOR * _whole_norm(p.grad for p in ref_params.values() if p.grad is not None)
    noise = {n for n, p in ref_params.items() if p.grad is None or float(p.grad.norm()) < g_floor}
    for name, p in dfs_model.named_parameters():
        g_ref = ref_params[name].grad
        g_dfs = p.grad
        if name in slices:  # a collective: gathered on every rank, with or without a grad
            g_dfs = whole(name, g_dfs if g_dfs is not None else torch.zeros_like(p))
        if g_ref is None and g_dfs is None:
            continue
        g_ref = torch.zeros_like(ref_params[name]) if g_ref is None else g_ref
        g_dfs = torch.zeros_like(g_ref) if g_dfs is None else g_dfs
        grad_errs.append(_rel(g_dfs, g_ref, g_floor))
    grad_err = worst(grad_errs)
    frozen_with_grad = sum(p.grad is not None for m in (dfs_model, ref_model)
                           for p in m.parameters() if not p.requires_grad)
    if adam_eps is None:
        adam_eps = 1e-8 if is_f64 else 1e-5
    (p_dfs, d_dfs), (p_ref, d_ref) = (_adamw_step(m, lr, adam_eps) for m in (dfs_model, ref_model))
    p_dfs = {n: whole(n, t) for n, t in p_dfs.items()}
    d_dfs = {n: whole(n, t) for n, t in d_dfs.items()}
    p_all = _whole_norm(p_ref.values())
    params_err = worst(_rel(p_dfs[n], p_ref[n], p_all if n in noise else 0.0) for n in p_ref)
    d_all = _whole_norm(d_ref.values())
    upd_err = worst(_rel(d_dfs[n], d_ref[n], d_all if n in noise else 0.0) for n in d_ref)
    loss_err = abs(dfs.loss - ref.loss) / max(abs(ref.loss), 1e-300)
    if not (math.isfinite(dfs.loss) and math.isfinite(ref.loss)):
        loss_err = math.nan
    stats = dfs.tree
    return VerifyReport(
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""), policy=walk.policy,
        reduction=reduction, sequences=stats.sequences, total_tokens=stats.total_tokens,
        unique_tokens=stats.unique_tokens, sharing_ratio=stats.sharing_ratio,
        parameters=sum(p.numel() for p in model.parameters()), logprobs_rel_err=lp_err,
        loss_rel_err=loss_err, grad_rel_err=grad_err, params_rel_err=params_err,
        update_rel_err=upd_err,
        loss_dfs=dfs.loss, loss_ref=ref.loss, max_live_graphs=dfs.walk.max_live_graphs,
        tree_depth=stats.depth, truly_float64=bool(is_f64 and truly_float64), adam_eps=adam_eps,
        logprobs_sequences=int(sum(walked)), packing=walk.packing, pack_tokens=dfs.walk.plan["cap"],
        packs=dfs.walk.packs, nodes=dfs.walk.nodes, block_tokens=dfs.walk.plan["block_tokens"],
        blocks_cut=dfs.walk.plan["blocks_cut"],
        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        frozen_with_grad=int(frozen_with_grad), context_parallel=cp.size if cp else 1,
        context_parallel_sent_bytes=cp.sent_bytes - sent if cp else 0,
        context_parallel_path_kv_bytes=path_kv, path_tokens=dfs.walk.plan.get("max_prefix", 0),
        expert_parallel=ep.size if ep else 1,
        expert_parallel_sent_bytes=ep.sent_bytes - ep_sent if ep else 0,
        expert_weight_share=_expert_share(ep))


def _expert_share(ep) -> float:
    """This rank's expert weights over all of them (1.0 without expert parallelism)."""
    if ep is None:
        return 1.0
    params = ep.expert_parameters()
    whole = sum(p.numel() * n // (b - a) for p in params for a, b, n in [ep.slice_of(p)])
    return sum(p.numel() for p in params) / whole


def _lp_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.to(b.dtype)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.nan
    return float(((a - b).abs() / b.abs().clamp_min(1.0)).max())

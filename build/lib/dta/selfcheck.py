"""The self-check a walker runs before it trains a model: DTA's path against the model's own.

The walker re-implements three things the model does (``dta/model/modeling.py``): the per-node
cache and positions, the embedding leaf and its gradient, and the LM head with its logit
transform and hand-derived gradient. On a small probe built from the model's vocabulary
(a shared prefix longer than the model's sliding window when that window is short, and two
branches), in the model's own dtype, the self-check compares each with the model's own
forward and backward, part by part:

  head         log-probs of the walker's logit transform on the model's hidden states vs
               ``model(input_ids).logits`` (catches a logit scale or cap the walker misses)
  cache        hidden states of a node forwarded after its path's cache vs the same rows of
               one full-sequence forward (catches position or cache conventions, windows)
  embedding    the embedding weight's gradient (leaf + index_add) vs autograd's
  head weight  the LM head's gradient (hand-derived) vs autograd's
  body         every other parameter's gradient
  GDN kernel   on a device with a Gated DeltaNet kernel (flash-linear-attention on CUDA,
               ``dta.model.gdn_kernels``): one GDN layer over a probe pack with branches, by
               that kernel and by the pure-torch pack path (output and handed-on states)

and raises ``SelfCheckError`` naming the model class and the first part that differs beyond
the dtype's tolerance. Nothing of the model is changed: parameters are only read, each
parameter's ``.grad`` is set aside and put back (the very same tensor object, or None), and
the train/eval mode is restored. The result is cached per model object, so a walker built
every step probes once. A model class outside the tested matrix
(``dta.model.families.TESTED_MODEL_CLASSES``) is probed and, when it passes, warned about: the
probe is evidence, not a proof (data-dependent behaviour, windows longer than the probe).
"""
from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from dta import versions
from dta.model.lora import base_model_class, is_peft_model
from dta.model.modeling import ModelInterface, ModelInterfaceError
from dta.model.placement import alone

# Relative error allowed per part, by dtype. Loose enough for rounding (float64 models whose
# norms upcast to float32 agree to ~1e-7; bf16 paths to ~1e-2), tight enough for any
# structural difference (a missed logit scale or embedding multiplier is O(1)).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.05}
GRAD_FLOOR = 1e-3  # a tensor's gradient error is relative to max(its norm, floor x whole norm)


class SelfCheckError(ModelInterfaceError):
    """The walker's path differs from the model's own: DTA would train it wrong."""


@dataclass
class SelfCheckReport:
    model_class: str
    dtype: str
    tolerance: float
    errors: dict = field(default_factory=dict)  # part -> relative error
    probe_tokens: int = 0
    tested_class: bool = True
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(e <= self.tolerance for e in self.errors.values())


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def ensure_self_check(model) -> SelfCheckReport:
    """Run the self-check once per model object (cached); raise if it fails."""
    report = _CACHE.get(model)
    if report is None:
        report = self_check(model)
        _CACHE[model] = report
    if not report.passed:
        raise SelfCheckError(_message(report))
    return report


def self_check(model, *, raise_on_failure: bool = False) -> SelfCheckReport:
    from dta.model.families import TESTED_MODEL_CLASSES

    t0 = time.perf_counter()
    p0 = next(model.parameters())
    tol = TOLERANCE.get(p0.dtype, 1e-3)
    name = base_model_class(model)  # a PEFT model: the wrapped model's class
    report = SelfCheckReport(name + (" (LoRA)" if is_peft_model(model) else ""),
                             str(p0.dtype).replace("torch.", ""), tol,
                             tested_class=name in TESTED_MODEL_CLASSES)
    seqs = _probe(model)
    report.probe_tokens = sum(len(s) for s in seqs)
    was_training = model.training
    params = [p for p in model.parameters()]
    saved = [p.grad for p in params]
    try:
        model.eval()
        for p in params:
            p.grad = None
        # the walker may be built inside no_grad (a forward-only step): the probe needs grad
        _compare_gdn_kernel(model, report)  # first: a wrong kernel is named, not its effects
        # the probe walks in this process alone (a context-parallel group's ranks each
        # check the model they share the walk of; dta.model.placement)
        with torch.inference_mode(False), torch.enable_grad(), alone(model):
            try:
                _compare(model, seqs, report)
            except (ModelInterfaceError, RuntimeError, TypeError, AttributeError) as e:
                # the walker could not even run the probe through this model (a cache or
                # forward convention it does not know): a refusal, naming the versions
                raise SelfCheckError(f"DTA self-check refused {report.model_class} "
                                     f"({report.dtype}): {e} ({versions.describe()}; "
                                     "docs/versions.md). Nothing was changed.") from e
    finally:
        for p, g in zip(params, saved):
            p.grad = g
        model.train(was_training)
    report.seconds = time.perf_counter() - t0
    if report.passed and not report.tested_class:
        warnings.warn(f"{report.model_class} is not in DTA's tested model matrix "
                      f"(dta.model.families); its self-check passed on a {report.probe_tokens}-token "
                      "probe, which cannot cover data-dependent behaviour or windows longer "
                      "than the probe", stacklevel=3)
    if raise_on_failure and not report.passed:
        raise SelfCheckError(_message(report))
    return report


def _compare_gdn_kernel(model, report: SelfCheckReport) -> None:
    """The device's GDN kernel, if it has one, against the pure-torch pack path."""
    from dta.model.gdn_check import compare
    from dta.model.gdn_kernels import segment_kernel
    from dta.model.recurrent import gdn_modules, is_hybrid

    if not is_hybrid(model):
        return
    kernel = segment_kernel(next(model.parameters()))
    if kernel is None:
        return
    report.errors[f"GDN kernel {kernel.name} (vs the pure-torch pack path)"] = compare(
        gdn_modules(model)[0], kernel)


def _message(report: SelfCheckReport) -> str:
    part, err = next((k, v) for k, v in report.errors.items() if v > report.tolerance)
    return (f"DTA self-check refused {report.model_class} ({report.dtype}): the walker's {part} "
            f"differs from the model's own forward/backward (relative error {err:.2e} > "
            f"tolerance {report.tolerance:g} for {report.dtype}); DTA cannot train this model "
            f"exactly with {versions.describe()} (docs/versions.md). Nothing was changed. "
            "(self_check=False skips this check.)")


def _probe(model) -> list[np.ndarray]:
    """Two sequences sharing a prefix, from the model's vocabulary (ids 3.. when it has
    them, away from the usual special tokens). The prefix is longer than a short sliding
    window, so the branches attend across it."""
    vocab = int(model.get_input_embeddings().weight.shape[0])
    lo = 3 if vocab > 8 else 0
    window = getattr(model.config, "sliding_window", None)
    prefix = 6 if not window or window > 48 else int(window) + 3
    rng = np.random.default_rng(0)
    base = rng.integers(lo, vocab, prefix + 5)
    return [base, np.concatenate([base[:prefix], rng.integers(lo, vocab, 3)])]


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    a, b = a.detach().double(), b.detach().double()
    d = max(float(b.norm()), floor)
    return float((a - b).norm()) / d if d > 0 else float((a - b).norm())


def _compare(model, seqs, report: SelfCheckReport) -> None:
    from dta.batch import Batch
    from dta.losses import TokenLoss
    from dta.model.head import LMHead
    from dta.objective import Objective
    from dta.reference import unpacked_gradients
    from dta.tree import PrefixTree
    from dta.walk import Walker

    io = ModelInterface(model)
    head = LMHead(model, temperature=1.0, chunk=len(seqs[0]))  # the walker's (LoRA: + adapters)
    device = next(model.parameters()).device
    full = torch.as_tensor(seqs[0], device=device)
    prefix = int(np.argmax(seqs[0][: len(seqs[1])] != seqs[1]))
    from dta.model.modeling import LogitTransform

    with torch.no_grad():
        # head: the walker's transform on the model's own hidden states vs the model's logits
        h_full = io.decoder(input_ids=full[None]).last_hidden_state[0]
        z_raw, _ = head._logits(h_full)
        z_raw = z_raw.float() if z_raw.dtype in (torch.float16, torch.bfloat16) else z_raw
        z, _ = LogitTransform.from_model(model).apply(z_raw)
        logits = model(input_ids=full[None]).logits[0]
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        report.errors["head (logit transform)"] = _rel(torch.log_softmax(z, -1),
                                                       torch.log_softmax(logits, -1))
        # cache: a node after its path vs the same rows of the full forward
        h_prefix, state = io.forward(full[:prefix], 0, [])
        h_node, _ = io.forward(full[prefix:], prefix, [state])
        report.errors["cache/positions (hidden states after the path)"] = _rel(
            torch.cat([h_prefix, h_node]), h_full)

    class _ProbeLoss(TokenLoss):  # log-probs and entropies both carry gradient
        fields, uses_entropy = ("advantages",), True

        def values(self, logp, entropy, fields):
            return -fields["advantages"] * logp - 0.1 * entropy

    rng = np.random.default_rng(1)
    batch = Batch.from_records([dict(input_ids=s, advantages=rng.normal(size=len(s)))
                                for s in seqs])
    named = list(model.named_parameters())
    # the walker's gradient (no aux loss: the reference has none either)
    Walker(model, logits_chunk=4, router_aux_loss="exclude").train(
        PrefixTree(batch.input_ids), Objective(batch, _ProbeLoss(), "token_mean"))
    walk = [None if p.grad is None else p.grad.detach().clone() for _, p in named]
    for _, p in named:
        p.grad = None
    unpacked_gradients(model, batch, _ProbeLoss())
    ref = [p.grad for _, p in named]
    whole = sum(float(g.double().norm()) ** 2 for g in ref if g is not None) ** 0.5
    emb, out = model.get_input_embeddings().weight, head.weight
    head_params = {id(t) for a, b, _ in head.adapters for t in (a, b)}  # a LoRA head
    parts = {"embedding gradient": [], "LM head gradient (hand-derived)": [], "body gradients": []}
    for (name, p), gw, gr in zip(named, walk, ref):
        if gw is None and gr is None:
            continue
        gw = torch.zeros_like(p) if gw is None else gw
        gr = torch.zeros_like(p) if gr is None else gr
        key = ("embedding gradient" if p is emb else "LM head gradient (hand-derived)"
               if p is out or p is head.bias or id(p) in head_params else "body gradients")
        parts[key].append(_rel(gw, gr, GRAD_FLOOR * whole))
    if emb is out:
        parts["tied embedding/LM head gradient"] = parts.pop("embedding gradient") + \
            parts.pop("LM head gradient (hand-derived)")
    for key, errs in parts.items():
        if errs:
            report.errors[key] = max(errs)

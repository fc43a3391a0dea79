"""Synthetic RL batches with realistic prefix sharing, and their registry.

``make_workload(name, scale, seed, **overrides)`` builds a :class:`Workload`: a list of
records shaped like :func:`dta.records.jsonl.read_jsonl`'s (numpy ``input_ids`` int64, ``loss_mask``
int8, per-token ``advantages`` and ``logprobs`` float64, ``group_id``, plus ``episode`` and
``call`` indices) with their generation parameters.

Names: ``tau2-airline``, ``tau2-retail``, ``tau2-telecom``, ``tau2-mock`` (see
:mod:`experiments.workloads.tau2`), each also with a ``-concat`` suffix (one sequence per
episode instead of one per agent call) and/or a ``-nothink`` suffix; and ``grpo-synthetic``
(single-turn GRPO: B prompts, G completions each). Overrides are keyword arguments of the
generator (``export``, ``thinking``, ``tasks``, ``group_size``, ``vocab_size``, ``logprobs``...).

Scales (:func:`resolve_scale`): ``"full"`` is the measured workload (τ² airline: B16×G8,
1,536 per-call sequences, ~11M tokens). A float ``s`` in (0, 1] multiplies message and
thinking lengths by ``s``, the shared domain prefix by ``s**0.75``, the number of tasks B by
``s**0.75``, the group size G by ``s**0.25`` (at least 2) and the calls per episode (mean and
cap) by ``s**0.5`` (cap at least 3); the prefix and the counts shrink more slowly than the
messages so that the sharing ratio stays in the same range. ``"small"`` is ``s = 1/16``: on
airline B2×G4, 31-43 per-call sequences of 650-1,000 tokens (prefix 613), 22-31K tokens in
all but only ~2.5-3.5K unique ones (sharing 7.9-10.2, mean 9.3; telecom 12.0; seeds 0-9):
a DFS step forwards a few thousand tokens, one-sequence-at-a-time training all of them (use
a small ``vocab_size``: the LM head dominates a hidden-256 model). ``"tiny"`` is for unit
tests: B1×G3, 2-3 calls per episode, prefix 49 tokens (airline), 6-9 sequences of 60-125
tokens, sharing ~2-3.5.

Token ids are a deterministic function of (segment identity, position): every segment (the
domain prefix, a task's first user message, one call's thinking, a tool result, a template)
draws its ids from a generator seeded by its identity, in ``[low, vocab_size)``
(``low = 1000`` when ``vocab_size >= 2000``, else ``vocab_size // 2``). Identical content
therefore has identical ids, and the prefix of a smaller scale is a prefix of the full one.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from experiments.workloads.base import (
    DEFAULT_VOCAB_SIZE,
    Scale,
    Tokens,
    Workload,
    code,
    content_low,
    grpo_advantages,
    resolve_scale,
    scaled_lengths,
    trie_size,
)
from experiments.workloads.tau2 import generate_tau2

__all__ = ["Workload", "Scale", "WORKLOADS", "make_workload", "resolve_scale",
           "trie_size", "grpo_synthetic", "DEFAULT_VOCAB_SIZE", "content_low"]


# ------------------------------------------------------------------ grpo-synthetic --
def grpo_synthetic(scale: str | float | Scale = "full", seed: int = 0, *, tasks: int | None = None,
                   group_size: int | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE,
                   logprobs: bool = True, system_prompt: int = 0, progress: bool = False
                   ) -> Workload:
    """Single-turn GRPO batch: B prompts, each with G sampled completions.

    Full size: B 16, G 8; prompt LogNormal(median 200, σ 0.5) in [16, 2048] (scaled like a
    shared prefix); completion LogNormal(median 400, σ 0.8) in [8, 4096] + 2 end tokens
    (trainable); one Bernoulli reward per completion, group-normalized. ``system_prompt``
    tokens (scaled like a prefix) are prepended to every prompt.
    """
    sc, tok = resolve_scale(scale), Tokens(vocab_size)
    B = tasks or max(1, round(16 * sc.tasks))
    G = group_size or max(2, round(8 * sc.group))
    ns = code("grpo-synthetic")
    sys_ids = tok.ids((ns, code("system")), round(system_prompt * sc.prefix))
    end = tok.ids((ns, code("end")), 2)
    records = []
    for b in range(B):
        rng = np.random.default_rng([ns, seed, b])
        plen = scaled_lengths(rng, 1, 200, 0.5, 16, 2048, sc.prefix)[0]
        prompt = np.concatenate([sys_ids, tok.ids((ns, seed, b, code("prompt")), plen)])
        clens = scaled_lengths(rng, G, 400, 0.8, 8, 4096, sc.length)
        success = rng.random(G) < rng.uniform(0.1, 0.9)  # the completions' rewards (0/1)
        adv = grpo_advantages(success)
        for g in range(G):
            ident = (ns, seed, b, g, code("completion"))
            out = np.concatenate([tok.ids(ident, clens[g]), end])
            ids = np.concatenate([prompt, out])
            n, k = len(ids), len(prompt)
            rec = {"input_ids": ids,
                   "loss_mask": np.concatenate([np.zeros(k, np.int8), np.ones(len(out), np.int8)]),
                   "advantages": np.full(n, adv[g]), "reward": float(success[g]), "group_id": b,
                   "episode": g, "call": 0}
            if logprobs:
                lp = np.concatenate([tok.logprobs(ident, clens[g]), tok.logprobs((ns, 1), 2, 0.01)])
                rec["logprobs"] = np.concatenate([np.zeros(k), lp])
            records.append(rec)
    params = dict(workload="grpo-synthetic", scale=sc.name, seed=seed, tasks=B, group_size=G,
                  vocab_size=vocab_size, system_prompt=len(sys_ids))
    return Workload("grpo-synthetic", records, params)


# ------------------------------------------------------------------------ registry --
def _tau2(domain: str, scale="full", seed=0, **overrides) -> Workload:
    return generate_tau2(domain, scale=scale, seed=seed, **overrides)


WORKLOADS: dict[str, Callable[..., Workload]] = {"grpo-synthetic": grpo_synthetic}
for _d in ("airline", "retail", "telecom", "mock"):
    WORKLOADS[f"tau2-{_d}"] = functools.partial(_tau2, _d)
    WORKLOADS[f"tau2-{_d}-concat"] = functools.partial(_tau2, _d, export="concat")

_SUFFIXES = {"-nothink": {"thinking": False}, "-concat": {"export": "concat"},
             "-per-call": {"export": "per-call"}}


def make_workload(name: str, scale: str | float = "full", seed: int = 0, **overrides) -> Workload:
    """Build the workload ``name`` (see module doc); ``overrides`` win over name suffixes."""
    base, implied = name, {}
    while base not in WORKLOADS:
        suffix = next((s for s in _SUFFIXES if base.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))} "
                             f"(tau2 names also take the suffixes -concat, -nothink)")
        implied = {**_SUFFIXES[suffix], **implied}
        base = base[: -len(suffix)]
    wl = WORKLOADS[base](scale=scale, seed=seed, **{**implied, **overrides})
    wl.name = name
    return wl

"""Synthetic RL batches with realistic prefix sharing, and their registry.

``make_workload(name, scale, seed, **overrides)`` builds a :class:`Workload`: a list of
records shaped like :func:`dta.jsonl.read_jsonl`'s (numpy ``input_ids`` int64, ``loss_mask``
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
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["Workload", "Scale", "WORKLOADS", "make_workload", "resolve_scale",
           "trie_size", "grpo_synthetic", "DEFAULT_VOCAB_SIZE"]

DEFAULT_VOCAB_SIZE = 151936  # Qwen3


# ------------------------------------------------------------------------------ scale --
@dataclass(frozen=True)
class Scale:
    """Multipliers applied to a workload's full-size parameters (see module doc)."""

    name: str
    length: float  # message / thinking / completion lengths (medians and clip bounds)
    prefix: float  # the shared domain (system) prefix
    tasks: float  # number of tasks (groups) B; at least 1
    group: float  # group size G; at least 2
    calls: float  # agent calls per episode beyond the first two (mean), and their cap


def resolve_scale(scale: str | float | Scale) -> Scale:
    if isinstance(scale, Scale):
        return scale
    if scale == "tiny":
        return Scale("tiny", length=1 / 64, prefix=0.01, tasks=1 / 16, group=3 / 8, calls=0.1)
    if scale in ("full", "small"):
        s = 1.0 if scale == "full" else 1 / 16
        name = scale
    else:
        try:
            s = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"scale must be 'full', 'small', 'tiny' or a number in (0, 1], "
                             f"got {scale!r}") from None
        if not 0 < s <= 1:
            raise ValueError(f"scale must be in (0, 1], got {s}")
        name = f"{s:g}"
    return Scale(name, length=s, prefix=s ** 0.75, tasks=s ** 0.75, group=s ** 0.25,
                 calls=s ** 0.5)


def scaled_lengths(rng: np.random.Generator, n: int, median: float, sigma: float,
                   lo: int, hi: int, factor: float, min_lo: int = 1) -> np.ndarray:
    """``n`` draws of round(LogNormal(median, sigma)) clipped to [lo, hi], all scaled by
    ``factor`` (the clip bounds too, with ``lo >= min_lo``)."""
    lo_s = max(min_lo, round(lo * factor))
    hi_s = max(lo_s, round(hi * factor))
    x = median * factor * np.exp(sigma * rng.standard_normal(n))
    return np.clip(np.rint(x), lo_s, hi_s).astype(np.int64)


# ------------------------------------------------------------------------ token ids --
def code(name: str) -> int:
    """A stable non-negative integer for a string (part of a segment identity)."""
    return zlib.crc32(name.encode())


def content_low(vocab_size: int) -> int:
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be at least 8, got {vocab_size}")
    return 1000 if vocab_size >= 2000 else vocab_size // 2


class Tokens:
    """Ids (and synthetic behaviour log-probs) of segments, by identity.

    ``ids(identity, n)`` are the first ``n`` draws of a generator seeded by ``identity``
    (a tuple of non-negative ints); ``logprobs(identity, n)`` come from a second, independent
    stream of the same identity: in [-20, -1e-4], mean about ``-lp_scale``.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self.low = content_low(self.vocab_size)

    def ids(self, identity: tuple[int, ...], n: int) -> np.ndarray:
        rng = np.random.default_rng(list(identity))
        return rng.integers(self.low, self.vocab_size, int(n), dtype=np.int64)

    def logprobs(self, identity: tuple[int, ...], n: int, lp_scale: float = 0.6) -> np.ndarray:
        rng = np.random.default_rng([*identity, code("logprobs")])
        # 4 decimals keep JSONL small; never 0, so trainable tokens are visibly < 0.
        return -np.round(np.clip(rng.exponential(lp_scale, int(n)), 1e-4, 20.0), 4)


def grpo_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """GRPO's group-normalized advantage (r - mean) / (std + eps), population std."""
    r = np.asarray(rewards, dtype=np.float64)
    return (r - r.mean()) / (r.std() + eps)


# --------------------------------------------------------------------------- trie ---
def trie_size(sequences: list[np.ndarray], masks: list[np.ndarray] | None = None
              ) -> tuple[int, int]:
    """(nodes of the token-level prefix trie of ``sequences``, nodes among them that are
    trainable in the sequence that adds them to the trie).

    Sorted lexicographically, each sequence adds its tokens beyond its longest common
    prefix with its predecessor: nodes = sum(len) - sum(adjacent LCP).
    """
    keys = [np.asarray(s, dtype=">u8").tobytes() for s in sequences]
    order = sorted(range(len(sequences)), key=keys.__getitem__)
    unique = trainable = 0
    prev = None
    for i in order:
        s = sequences[i]
        lcp = 0
        if prev is not None:
            m = min(len(s), len(prev))
            diff = np.flatnonzero(s[:m] != prev[:m])
            lcp = int(diff[0]) if len(diff) else m
        unique += len(s) - lcp
        if masks is not None:
            trainable += int(np.count_nonzero(masks[i][lcp:]))
        prev = s
    return unique, trainable


# ------------------------------------------------------------------------ workload --
def _pct(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {}
    p50, p90 = np.percentile(x, [50, 90])
    return {"p50": float(p50), "p90": float(p90), "max": int(x.max()), "mean": float(x.mean())}


@dataclass
class Workload:
    """A generated batch: ``records`` (dicts of numpy arrays, see module doc), the workload
    ``name`` and the ``params`` it was generated with."""

    name: str
    records: list[dict]
    params: dict = field(default_factory=dict)

    def sequences(self) -> list[np.ndarray]:
        return [r["input_ids"] for r in self.records]

    def total_tokens(self) -> int:
        return int(sum(len(r["input_ids"]) for r in self.records))

    def unique_tokens(self) -> int:
        """Tokens of the batch's prefix tree (one tree for the whole batch)."""
        try:
            from dta.tree import PrefixTree
            build = PrefixTree.from_sequences
        except (ImportError, AttributeError):
            return trie_size(self.sequences())[0]
        return int(build(self.sequences()).stats().unique_tokens)

    def sharing_ratio(self) -> float:
        return self.total_tokens() / self.unique_tokens()

    def to_jsonl(self, path) -> int:
        from dta.jsonl import write_jsonl
        return write_jsonl(path, self.records)

    def stats(self) -> dict:
        """Sizes for reports: counts, total/unique tokens, the sharing ratio, prompt
        (tokens before the first trainable one) and completion (trainable tokens) percentiles,
        and the trainable share of all tokens and of unique tree tokens."""
        masks = [r["loss_mask"] for r in self.records]
        unique, unique_trainable = trie_size(self.sequences(), masks)
        total = self.total_tokens()
        prompt = np.array([int(np.argmax(m)) if m.any() else len(m) for m in masks])
        completion = np.array([int(np.count_nonzero(m)) for m in masks])
        groups = {r.get("group_id") for r in self.records}
        return {
            "workload": self.name, "sequences": len(self.records), "groups": len(groups),
            "episodes": len({(r.get("group_id"), r.get("episode")) for r in self.records}),
            "total_tokens": total, "unique_tokens": unique,
            "sharing_ratio": total / unique if unique else float("nan"),
            "trainable_tokens": int(completion.sum()),
            "trainable_share_total": float(completion.sum() / total) if total else 0.0,
            "trainable_share_unique": unique_trainable / unique if unique else 0.0,
            "prompt_tokens": _pct(prompt), "completion_tokens": _pct(completion),
            "sequence_tokens": _pct(np.array([len(r["input_ids"]) for r in self.records])),
        }


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
    from experiments.workloads.tau2 import generate_tau2
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

"""What every workload generator shares: scales, token ids, GRPO advantages, the trie size
and the :class:`Workload` they return (the package docstring, :mod:`experiments.workloads`,
describes scales and token ids)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

DEFAULT_VOCAB_SIZE = 151936  # Qwen3


# ------------------------------------------------------------------------------ scale --
@dataclass(frozen=True)
class Scale:
    """Multipliers applied to a workload's full-size parameters (:mod:`experiments.workloads`)."""

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
    """A generated batch: ``records`` (dicts of numpy arrays, see
    :mod:`experiments.workloads`), the workload ``name`` and the ``params`` it was generated
    with."""

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
        from dta.records.jsonl import write_jsonl
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

"""Where a batch's prefix sharing comes from: per-call chains, groups, the whole batch.

Unique tokens (the tokens a prefix tree forwards once) are counted at four nestings:

* ``calls``: every sequence alone (no sharing): the batch's total tokens;
* ``chains``: one tree per episode (``episode`` field): a call re-reads the earlier calls of
  its conversation;
* ``groups``: one tree per group (``group_id``): runs of the same task share their start;
* ``batch``: one tree for all: what every sequence shares, above all the system prompt
  (with the tool schemas), reported as ``common_prefix_tokens``.

Each level's ``saved`` is the tokens it removes beyond the previous level, and ``ratio`` its
factor; the factors multiply to the batch's sharing ratio (total / unique). A record without
``episode`` is its own episode; one without ``group_id`` is its episode's group. Integers and
numpy only.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from dta.tree import PrefixTree

__all__ = ["sharing_breakdown", "format_breakdown"]

LEVELS = ("chains", "groups", "batch")
LABELS = {"chains": "per-call chains (a call re-reads its episode)",
          "groups": "groups (episodes of one task share their start)",
          "batch": "the whole batch (the shared system prompt + tools)"}


def _unique(seqs) -> int:
    return PrefixTree(seqs).stats().unique_tokens


def _common_prefix(seqs) -> int:
    n = min(len(s) for s in seqs)
    first = seqs[0][:n]
    same = np.ones(n, dtype=bool)
    for s in seqs[1:]:
        same &= s[:n] == first
    bad = np.flatnonzero(~same)
    return int(bad[0]) if len(bad) else n


def sharing_breakdown(records) -> dict:
    """The breakdown of ``records`` (dicts with ``input_ids``; optional ``episode``,
    ``group_id``, ``loss_mask``): see the module doc."""
    seqs = [np.asarray(r["input_ids"], dtype=np.int64) for r in records]
    if not seqs:
        raise ValueError("sharing breakdown: the batch has no sequences")
    episodes, groups = defaultdict(list), defaultdict(list)
    for i, r in enumerate(records):
        ep = ("episode", r["episode"]) if r.get("episode") is not None else ("sequence", i)
        g = ("group", r["group_id"]) if r.get("group_id") is not None else ep
        episodes[(g, ep)].append(seqs[i])
        groups[g].append(seqs[i])
    total = int(sum(len(s) for s in seqs))
    unique = {"calls": total,
              "chains": sum(_unique(v) for v in episodes.values()),
              "groups": sum(_unique(v) for v in groups.values()),
              "batch": _unique(seqs)}
    levels, before = {}, total
    for name in LEVELS:
        levels[name] = dict(unique_tokens=unique[name], saved_tokens=before - unique[name],
                            ratio=before / unique[name])
        before = unique[name]
    masks = [r.get("loss_mask") for r in records]
    trained = (int(sum(int(np.asarray(m)[1:].sum()) for m in masks))
               if all(m is not None for m in masks) else None)
    return dict(sequences=len(seqs), episodes=len(episodes), groups=len(groups),
                total_tokens=total, unique_tokens=unique["batch"],
                sharing_ratio=total / unique["batch"], saved_tokens=total - unique["batch"],
                common_prefix_tokens=_common_prefix(seqs), trained_tokens=trained,
                levels=levels)


def format_breakdown(b: dict) -> list[str]:
    """The breakdown as lines of text."""
    lines = [f"sharing: {b['total_tokens']:,} tokens in {b['sequences']:,} sequences "
             f"({b['episodes']:,} episodes, {b['groups']:,} groups) -> {b['unique_tokens']:,} "
             f"unique ({b['sharing_ratio']:.2f}x, {b['saved_tokens']:,} saved)"]
    for name in LEVELS:
        lv = b["levels"][name]
        share = lv["saved_tokens"] / b["saved_tokens"] if b["saved_tokens"] else 0.0
        lines.append(f"  {LABELS[name]:<52} saves {lv['saved_tokens']:>12,} tokens "
                     f"({share:6.1%} of saved, {lv['ratio']:.2f}x)")
    lines.append(f"  prefix common to every sequence: {b['common_prefix_tokens']:,} tokens")
    if b["trained_tokens"] is not None:
        lines.append(f"  trained tokens: {b['trained_tokens']:,} "
                     f"({b['trained_tokens'] / b['total_tokens']:.2%} of all)")
    return lines

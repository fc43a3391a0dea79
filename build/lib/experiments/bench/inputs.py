"""The benchmark on the user's own batch (``--input FILE.jsonl``) and model (``--model PATH``).

* :func:`model_config` is the Hugging Face config of the benchmarked model: a local model
  directory's, or a random-init family/size's (:mod:`dta.model.models`).
* :func:`cut` keeps a deterministic part of a large dump: groups (``group_id``) in the order
  they first appear, each whole while it fits ``max_sequences`` / ``max_tokens``; of the first
  group that does not fit, its whole episodes (``episode``) in order while they fit; then
  stop. No call chain is ever cut inside an episode. A record without ``episode`` is its own
  episode; one without ``group_id`` its episode's group.
* :func:`load_input` reads the file (every id inside the model's vocabulary: an error naming
  the line and the model otherwise), cuts it, and picks the loss: ``ppo`` needs
  ``advantages`` and ``logprobs`` on every record; without them (imported conversations carry
  only rewards) the token NLL, which runs the same passes.
"""
from __future__ import annotations

import os
from collections import defaultdict

from dta.paths import check_path

__all__ = ["model_config", "model_name", "cut", "load_input"]


def model_config(model_path: str | None, family: str, size: str, vocab_size: int | None = None):
    if model_path:
        if vocab_size is not None:
            raise ValueError("--vocab-size sizes a random-init model; --model PATH has its own")
        check_path(model_path, "dir", "--model",
                   hint="a local Hugging Face model folder: DTA never downloads one")
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"--model {model_path}: no model config: "
                             f"{' '.join(str(e).split())[:300]}") from None
    from dta.model.models import build_config

    return build_config(family, size, **({} if vocab_size is None else {"vocab_size": vocab_size}))


def model_name(model_path: str | None, family: str, size: str,
               vocab_size: int | None = None) -> str:
    if model_path:
        return os.path.basename(os.path.normpath(model_path))
    return f"{family}-{size}" + ("" if vocab_size is None else f"-v{vocab_size}")


def _units(records) -> dict:
    """group -> episode -> record indices, all in order of first appearance."""
    groups: dict = defaultdict(lambda: defaultdict(list))
    for i, r in enumerate(records):
        ep = ("episode", r["episode"]) if r.get("episode") is not None else ("sequence", i)
        g = ("group", r["group_id"]) if r.get("group_id") is not None else ep
        groups[g][ep].append(i)
    return groups


def cut(records, max_sequences: int | None = None, max_tokens: int | None = None):
    """(the kept records in file order, what was kept); see the module doc."""
    for name, v in (("--max-sequences", max_sequences), ("--max-tokens", max_tokens)):
        if v is not None and v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    lengths = [len(r["input_ids"]) for r in records]
    total = dict(sequences=len(records), tokens=int(sum(lengths)))
    if max_sequences is None and max_tokens is None:
        return list(records), dict(total, kept_sequences=len(records), kept_tokens=total["tokens"],
                                   groups=len(_units(records)), partial_group=False)

    def fits(idx):
        return ((max_sequences is None or n + len(idx) <= max_sequences)
                and (max_tokens is None or t + sum(lengths[i] for i in idx) <= max_tokens))

    keep, n, t, groups, partial = [], 0, 0, 0, False
    for episodes in _units(records).values():
        whole = [i for ep in episodes.values() for i in ep]
        if fits(whole):
            keep += whole
            n, t, groups = n + len(whole), t + sum(lengths[i] for i in whole), groups + 1
            continue
        for ep in episodes.values():
            if not fits(ep):
                break
            keep += ep
            n, t, partial = n + len(ep), t + sum(lengths[i] for i in ep), True
        groups += partial
        break
    if not keep:
        first = next(iter(next(iter(_units(records).values())).values()))
        raise ValueError(f"the first episode ({len(first)} sequences, "
                         f"{sum(lengths[i] for i in first):,} tokens) is larger than "
                         f"--max-sequences {max_sequences} / --max-tokens {max_tokens}: "
                         "nothing can be kept whole")
    keep.sort()
    return [records[i] for i in keep], dict(total, kept_sequences=n, kept_tokens=t,
                                            groups=groups, partial_group=partial)


def load_input(path: str, vocab_size: int, model: str, *, max_sequences=None, max_tokens=None,
               loss: str | None = None, max_positions: int | None = None):
    """(records, what was kept, the loss name); see the module doc. A kept sequence longer
    than ``max_positions`` (the model's ``max_position_embeddings``) is refused here, before
    any run, as the DFS walker would refuse it."""
    from dta.records.fields import RecordError
    from dta.records.jsonl import read_jsonl

    try:
        records = read_jsonl(path, vocab_size=vocab_size)
    except RecordError as e:
        hint = (f" ({model}'s vocabulary has {vocab_size:,} ids: give a model whose vocabulary "
                "covers the tokenizer's: --model PATH, --model-size, or --vocab-size V for a "
                "random-init one)"
                if "outside the model's vocabulary" in str(e) else "")
        raise ValueError(f"{e}{hint}") from None
    if not records:
        raise ValueError(f"{path}: no records")
    records, kept = cut(records, max_sequences, max_tokens)
    longest = max(range(len(records)), key=lambda i: len(records[i]["input_ids"]))
    n = len(records[longest]["input_ids"])
    if max_positions is not None and n > max_positions:
        raise ValueError(f"{path}: a kept sequence ({records[longest].get('episode', '')} call "
                         f"{records[longest].get('call', longest)}) has {n:,} tokens, beyond "
                         f"{model}'s {max_positions:,} positions (max_position_embeddings); "
                         "choose a model with more positions")
    has_ppo = all("advantages" in r and ("logprobs" in r or "old_logprobs" in r) for r in records)
    if loss is None:
        loss = "ppo" if has_ppo else "nll"
    elif loss == "ppo" and not has_ppo:
        raise ValueError(f"{path}: --loss ppo needs 'advantages' and 'logprobs' on every record; "
                         "use --loss nll (the same passes) or add them")
    return records, kept, loss

"""Import agent trajectories (τ²-bench results, OpenAI-chat JSONL) as training records.

``read_conversations(source, path)`` (:mod:`dta.importing.sources`) reads a file into
conversations; ``conversation_records(conv, tokenizer)`` (:mod:`dta.importing.render`) renders
one with a local Hugging Face tokenizer's chat template into one record per generated agent
message (the format of :mod:`dta.records.fields`). ``import_file`` does both for a whole file.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dta.importing.render import (
    REASONS,
    THINKING,
    Unrenderable,
    conversation_records,
    load_tokenizer,
)
from dta.importing.sources import SOURCES, Conversation, ImportError_, read_conversations

__all__ = ["SOURCES", "THINKING", "REASONS", "Conversation", "ImportError_", "Unrenderable",
           "Imported", "read_conversations", "conversation_records", "load_tokenizer",
           "import_file"]


@dataclass
class Imported:
    """What ``import_file`` made of a file: the records, the conversations read, and the ones
    left out -- ``skipped`` (:class:`Unrenderable` errors, under ``skip_invalid``) and
    ``without_calls`` (the ``where`` of conversations with no generated message)."""
    records: list
    conversations: list
    skipped: list = field(default_factory=list)
    without_calls: list = field(default_factory=list)

    def skipped_by_reason(self) -> dict:
        out: dict = {}
        for e in self.skipped:
            out[e.reason] = out.get(e.reason, 0) + 1
        return dict(sorted(out.items()))


def import_file(source: str, path, tokenizer, *, thinking: str = "keep",
                skip_invalid: bool = False, progress=None) -> Imported:
    """The records of ``path`` read as ``source``; ``tokenizer`` is a loaded tokenizer or a
    local directory. A conversation that cannot be rendered as a chain of prefixes raises
    :class:`Unrenderable` (naming it), or with ``skip_invalid`` is left out and kept in
    ``skipped``. ``progress`` wraps the conversation iterable (tqdm)."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, bytes)) or hasattr(
        tokenizer, "__fspath__") else tokenizer
    convs = read_conversations(source, path)
    out = Imported(records=[], conversations=convs)
    for conv in (progress(convs) if progress else convs):
        try:
            records = conversation_records(conv, tok, thinking=thinking)
        except Unrenderable as e:
            if not skip_invalid:
                raise
            out.skipped.append(e)
            continue
        if not records:
            out.without_calls.append(conv.where)
        out.records.extend(records)
    if not out.records:
        raise ImportError_(f"{path}: no generated assistant message in any "
                           + ("renderable conversation" if out.skipped else "conversation")
                           + ": nothing to train on"
                           + (f" ({len(out.skipped)} skipped, the first: {out.skipped[0]})"
                              if out.skipped else ""))
    return out

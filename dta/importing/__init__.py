"""Import agent trajectories (τ²-bench results, OpenAI-chat JSONL) as training records.

``read_conversations(source, path)`` (:mod:`dta.importing.sources`) reads a file into
conversations; ``conversation_records(conv, tokenizer)`` (:mod:`dta.importing.render`) renders
one with a local Hugging Face tokenizer's chat template into one record per generated agent
message (the format of :mod:`dta.records.fields`). ``import_file`` does both for a whole file.
"""
from __future__ import annotations

from dta.importing.render import THINKING, conversation_records, load_tokenizer
from dta.importing.sources import SOURCES, Conversation, ImportError_, read_conversations

__all__ = ["SOURCES", "THINKING", "Conversation", "ImportError_", "read_conversations",
           "conversation_records", "load_tokenizer", "import_file"]


def import_file(source: str, path, tokenizer, *, thinking: str = "keep", progress=None):
    """(records, conversations) of ``path`` read as ``source``; ``tokenizer`` is a loaded
    tokenizer or a local directory. ``progress`` wraps the conversation iterable (tqdm)."""
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, bytes)) or hasattr(
        tokenizer, "__fspath__") else tokenizer
    convs = read_conversations(source, path)
    records = []
    for conv in (progress(convs) if progress else convs):
        records.extend(conversation_records(conv, tok, thinking=thinking))
    if not records:
        raise ImportError_(f"{path}: no generated assistant message in any conversation: "
                           "nothing to train on")
    return records, convs

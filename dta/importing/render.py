"""Conversations -> training records, one per generated agent message, the way AReaL's τ²
example exports them (``export_style: individual``, one record per model call).

For the assistant message ``i`` a model generated, the record is what that call saw and said:
``input_ids`` = the chat template's rendering of the messages before ``i`` with the generation
prompt (system prompt and tool schemas included), then the message itself up to and including
the end-of-turn token; ``loss_mask`` is 1 on the message's tokens (text, tool calls, reasoning
when kept, the end-of-turn token) and 0 on the prompt. Every record carries the episode's
``reward``, ``group_id`` (the task), ``episode`` and ``call`` (its index in the episode).

Tokens are built incrementally, as an agent loop that feeds the model its own output does: the
next call's ids are this call's ids (its generated tokens as generated) followed by the
tokens of the newly rendered text. So inside an episode every call's ``input_ids`` are a prefix
of the next call's; a template whose rendering of the longer conversation does not start with
the text of the earlier call (one that rewrites history, e.g. drops earlier reasoning) is an
error naming the conversation and message; ``--thinking drop`` removes reasoning instead.
"""
from __future__ import annotations

import os

from dta.importing.sources import Conversation, ImportError_

__all__ = ["load_tokenizer", "conversation_records", "THINKING"]

THINKING = ("keep", "drop")


def load_tokenizer(path: str | os.PathLike):
    """A Hugging Face tokenizer from a local directory (never a hub) that has a chat template."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ImportError_(f"--tokenizer {path}: not a local directory (DTA never downloads a "
                           "tokenizer; give a Hugging Face tokenizer directory)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ImportError_(f"--tokenizer {path}: cannot load a tokenizer: "
                           f"{' '.join(str(e).split())[:300]}") from None
    if not getattr(tok, "chat_template", None):
        raise ImportError_(f"--tokenizer {path}: the tokenizer has no chat_template")
    return tok


def _end_token(tok, path_hint: str = "") -> str:
    eot = getattr(tok, "eos_token", None)
    if not eot:
        raise ImportError_(f"the tokenizer{path_hint} has no eos_token: the end-of-turn token "
                           "that ends each generated message is unknown")
    return eot


def _render(tok, messages, tools, generation_prompt: bool, where: str) -> str:
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise ImportError_(f"{where}: the chat template failed: "
                           f"{' '.join(str(e).split())[:300]}") from None
    if not isinstance(text, str):
        raise ImportError_(f"{where}: the chat template did not render text")
    return text


def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def _prepared(conv: Conversation, thinking: str) -> list[dict]:
    if thinking not in THINKING:
        raise ImportError_(f"thinking must be one of {', '.join(THINKING)}, got {thinking!r}")
    if thinking == "keep":
        return conv.messages
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in conv.messages]


def conversation_records(conv: Conversation, tok, *, thinking: str = "keep") -> list[dict]:
    """The training records of one conversation (see the module doc)."""
    msgs = _prepared(conv, thinking)
    eot = _end_token(tok)
    ids: list[int] = []
    done = ""  # the text whose tokens are ``ids``: a prefix of every later rendering
    out = []
    for call, i in enumerate(conv.generated()):
        where = f"{conv.where} message {_source_index(conv, i)}"
        prompt = _render(tok, msgs[:i], conv.tools, True, where)
        full = _render(tok, msgs[:i + 1], conv.tools, False, where)
        if not prompt.startswith(done):
            raise ImportError_(f"{where}: the template does not render a prefix of this call: "
                               "the prompt no longer starts with the previous call's text "
                               f"(it rewrites the history at character {_diverge(done, prompt)}"
                               + ("; try --thinking drop)" if thinking == "keep" else ")"))
        if not full.startswith(prompt):
            raise ImportError_(f"{where}: the template does not render a prefix of this call: "
                               "the conversation through this message does not start with its "
                               f"generation prompt (differs at character {_diverge(prompt, full)})")
        completion = full[len(prompt):]
        end = completion.rfind(eot)
        if end < 0:
            raise ImportError_(f"{where}: the template renders no end-of-turn token {eot!r} "
                               "after the message")
        completion = completion[:end + len(eot)]
        reasoning = msgs[i].get("reasoning_content")
        if reasoning and reasoning not in completion:
            raise ImportError_(f"{where}: the chat template does not render the message's "
                               "reasoning; use --thinking drop to leave it out")
        ids = ids + _encode(tok, prompt[len(done):])
        gen = _encode(tok, completion)
        record = {"input_ids": ids + gen, "loss_mask": [0] * len(ids) + [1] * len(gen),
                  "group_id": conv.episode if conv.group_id is None else conv.group_id,
                  "episode": conv.episode, "call": call}
        if conv.reward is not None:
            record["reward"] = conv.reward
        out.append(record)
        ids, done = ids + gen, prompt + completion
    return out


def _source_index(conv: Conversation, i: int) -> int:
    """Message ``i`` of the normalized conversation as numbered in the source file."""
    return conv.source_index[i] if conv.source_index else i


def _diverge(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)

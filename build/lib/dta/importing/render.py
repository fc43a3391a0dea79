"""Conversations -> training records, one per generated agent message, the way AReaL's τ²
example exports them (``export_style: individual``, one record per model call).

For the assistant message ``i`` a model generated, the record is what that call saw and said:
``input_ids`` = what the model was fed (the chat template's rendering of the messages before
``i`` with the generation prompt; system prompt and tool schemas included), then what it
produced through the end-of-turn token; ``loss_mask`` is 1 on what it produced (text, tool
calls, reasoning when kept, the end-of-turn token) and 0 on the prompt. Every record carries
the episode's ``reward``, ``group_id`` (the task), ``episode`` and ``call`` (its index in the
episode).

**What the model produced** is the template's rendering of the message after its generation
prompt (the rendering of the conversation through the message, minus the rendering of the
prompt), cut after the end-of-turn token (the tokenizer's ``eos_token``). The message's
content is kept verbatim: when the template does not render it there verbatim -- an empty
message a template drops, whitespace-only content it trims -- the template renders a stand-in
content in its place, which is then replaced by the real one. An empty message therefore
trains its end-of-turn token. Reasoning (``--thinking keep``) must appear in that rendering.

**What the model was fed** is built as an agent loop feeds a model its own output: call ``k``'s
ids are call ``k-1``'s ids, its generated tokens as generated, then the tokens of the text the
template renders after that message (tool results, the user's reply, the next generation
prompt). That text is found in the template's rendering of the conversation before call
``k``: everything after the end of the previous generated message. So within an episode each
call's ``input_ids`` are a prefix of the next call's, whatever the template does to earlier
messages in later prompts (drop their reasoning, drop or trim an empty turn): the model is fed
what it generated. A conversation whose rendering before call ``k`` does not start with its
rendering through the previous message (a template that rewrites earlier turns in any other
way), a template error, or a message rendered without an end-of-turn token cannot be a chain
of prefixes: :class:`Unrenderable`, naming the file, conversation, message and why.
"""
from __future__ import annotations

import os

from dta.importing.sources import Conversation, ImportError_

__all__ = ["load_tokenizer", "conversation_records", "THINKING", "Unrenderable", "REASONS"]

THINKING = ("keep", "drop")

# Why a conversation cannot be rendered as a chain of prefixes (the keys of the skip counts).
REASONS = {
    "template-error": "the chat template failed on it",
    "history-rewritten": "the template renders an earlier part of it differently later",
    "not-after-generation-prompt": "a message does not render after its generation prompt",
    "no-end-of-turn": "a message renders without the end-of-turn token",
    "reasoning-not-rendered": "the template does not render a message's reasoning",
}

# A stand-in content the template renders where the real one goes (letters only, so that no
# escaping -- JSON, HTML -- changes it).
PROBE = "DTAPROBEQXZJVW"


class Unrenderable(ImportError_):
    """One conversation that cannot be rendered as a chain of prefixes; ``reason`` is a key of
    :data:`REASONS`, ``where`` names the file, conversation and message."""

    def __init__(self, where: str, reason: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.reason = where, reason


def load_tokenizer(path: str | os.PathLike):
    """A Hugging Face tokenizer from a local directory (never a hub) that has a chat template."""
    from dta.paths import check_path

    path = check_path(path, "dir", "--tokenizer", error=ImportError_,
                      hint="a local Hugging Face tokenizer folder: DTA never downloads one")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ImportError_(f"--tokenizer {path}: cannot load a tokenizer: "
                           f"{' '.join(str(e).split())[:300]}") from None
    if not getattr(tok, "chat_template", None):
        raise ImportError_(f"--tokenizer {path}: the tokenizer has no chat_template")
    return tok


def _end_token(tok) -> str:
    eot = getattr(tok, "eos_token", None)
    if not eot:
        raise ImportError_("the tokenizer has no eos_token: the end-of-turn token that ends "
                           "each generated message is unknown")
    return eot


def _render(tok, messages, tools, generation_prompt: bool, where: str) -> str:
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise Unrenderable(where, "template-error", "the chat template failed (on the "
                           "conversation through this message): "
                           f"{' '.join(str(e).split())[:300]}") from None
    if not isinstance(text, str):
        raise Unrenderable(where, "template-error", "the chat template did not render text")
    return text


def _encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def _prepared(conv: Conversation, thinking: str) -> list[dict]:
    if thinking not in THINKING:
        raise ImportError_(f"thinking must be one of {', '.join(THINKING)}, got {thinking!r}")
    if thinking == "keep":
        return conv.messages
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in conv.messages]


def _context_view(msgs: list[dict]) -> list[dict]:
    """The messages without reasoning: what the prompts are rendered from. A generated
    message enters later calls as its generated tokens, so how a template shows (or drops)
    earlier reasoning never matters; without it, a template renders the history the same way
    whatever follows."""
    return [{k: v for k, v in m.items() if k != "reasoning_content"}
            if "reasoning_content" in m else m for m in msgs]


def _completion(tok, ctx, msg, prompt: str, tools, eot: str, where: str) -> str:
    """The text of ``msg`` as generated after ``prompt`` (see the module doc)."""
    full = _render(tok, ctx + [msg], tools, False, where)
    content = msg.get("content") or ""
    verbatim = not content or (content.strip() and content in full[len(prompt):])
    if full.startswith(prompt) and verbatim:
        return _generated_text(full[len(prompt):], msg, eot, where)
    # the template drops, trims or rewrites the content: render a stand-in there
    probe = _render(tok, ctx + [dict(msg, content=PROBE)], tools, False, where)
    if probe.startswith(prompt) and PROBE in probe[len(prompt):]:
        return _generated_text(probe[len(prompt):].replace(PROBE, content, 1), msg, eot, where)
    # the history renders differently with the message after it (e.g. a message before it
    # rendered as the last one in the prompt): the message is what follows the history's
    # last end-of-turn token and the generation prompt's own text after it
    at, end = probe.rfind(PROBE), prompt.rfind(eot)
    hist = probe.rfind(eot, 0, at) if at >= 0 and end >= 0 else -1
    tail = prompt[end + len(eot):]
    if hist >= 0 and probe.startswith(tail, hist + len(eot)):
        hist += len(eot)
        if verbatim and full[:hist] == probe[:hist] and full.startswith(tail, hist):
            return _generated_text(full[hist + len(tail):], msg, eot, where)
        return _generated_text(probe[hist + len(tail):].replace(PROBE, content, 1), msg, eot,
                               where)
    raise Unrenderable(where, "not-after-generation-prompt",
                       "the template does not render a prefix of this call: the conversation "
                       "through this message does not start with its generation prompt "
                       f"(differs at character {_diverge(prompt, full)})")


def _generated_text(text: str, msg, eot: str, where: str) -> str:
    """``text`` (the message's rendering after its generation prompt) through its end-of-turn
    token, checked to hold the message's reasoning."""
    end = text.rfind(eot)
    if end < 0:
        raise Unrenderable(where, "no-end-of-turn", "the template renders no end-of-turn token "
                           f"{eot!r} after the message")
    text = text[:end + len(eot)]
    reasoning = msg.get("reasoning_content")
    if reasoning and reasoning.strip() not in text:
        raise Unrenderable(where, "reasoning-not-rendered", "the chat template does not render "
                           "the message's reasoning; use --thinking drop to leave it out")
    return text


def _through(tok, ctx, i: int, j: int, generated: set, tools, eot: str, where: str,
             where_i: str) -> str:
    """The rendering of ``ctx`` up to the end of message ``i``'s turn (through its end-of-turn
    token) as the template renders it with the next message after it (the next call, message
    ``j``, when that follows at once): what the next call's prompt (at ``where``) must start
    with; the text after it is new to the model. The history before message ``i`` must
    render as it did without the later messages (the earlier calls were fed that); message
    ``i`` itself may render differently (its generated tokens stand in for it), and so may
    generated messages right before it."""
    if j == i + 1:  # the next call's prompt: message i, then the generation prompt
        nxt = None
        text = _render(tok, ctx[:j], tools, True, where)
        at = len(text)
    else:
        nxt = dict(ctx[i + 1], content=PROBE)
        text = _render(tok, ctx[:i + 1] + [nxt], tools, False, where)
        at = text.rfind(PROBE)  # the last message's content: after everything else
    if at < 0:
        raise Unrenderable(where, "template-error", "the template does not render the content "
                           "of the message after the previous call")
    start = i
    while start and start - 1 in generated:
        start -= 1
    before = _render(tok, ctx[:start], tools, False, where) if start else ""
    end = before.rfind(eot)
    before = before[:end + len(eot)] if end >= 0 else before
    if not text.startswith(before):
        raise Unrenderable(where, "history-rewritten",
                           "the template does not render a prefix of this call: with the "
                           "messages after the previous call, it renders the conversation "
                           "before that call differently (it rewrites the history at "
                           f"character {_diverge(before, text)})")
    cut = text.rfind(eot, 0, at)
    if cut < 0 or cut + len(eot) <= len(before):
        # no end-of-turn after message i: only right if the template renders nothing for it
        # (e.g. drops an empty turn), i.e. the rendering is the same without it
        if (_render(tok, ctx[:i], tools, True, where) if nxt is None else
                _render(tok, ctx[:i] + [nxt], tools, False, where)) != text:
            raise Unrenderable(where_i, "no-end-of-turn", "in context, the template renders "
                               f"the message without the end-of-turn token {eot!r}")
    return text[:cut + len(eot)] if cut >= 0 else ""


def conversation_records(conv: Conversation, tok, *, thinking: str = "keep") -> list[dict]:
    """The training records of one conversation (see the module doc); :class:`Unrenderable`
    when it cannot be rendered as a chain of prefixes."""
    msgs = _prepared(conv, thinking)
    ctx = _context_view(msgs)
    eot = _end_token(tok)
    ids: list[int] = []
    out = []
    prev = None  # (index, where) of the previous generated message
    generated = conv.generated()
    for call, i in enumerate(generated):
        where = f"{conv.where} message {_source_index(conv, i)}"
        prompt = _render(tok, ctx[:i], conv.tools, True, where)
        if prev is None:
            new = prompt
        else:
            head = _through(tok, ctx, prev[0], i, set(generated), conv.tools, eot, where,
                            prev[1])
            if not prompt.startswith(head):
                raise Unrenderable(where, "history-rewritten",
                                   "the template does not render a prefix of this call: its "
                                   "prompt does not start with the conversation through the "
                                   "previous call (it rewrites the history at character "
                                   f"{_diverge(head, prompt)})")
            new = prompt[len(head):]
        ids = ids + _encode(tok, new)
        gen = _encode(tok, _completion(tok, ctx[:i], msgs[i], prompt, conv.tools, eot, where))
        record = {"input_ids": ids + gen, "loss_mask": [0] * len(ids) + [1] * len(gen),
                  "group_id": conv.episode if conv.group_id is None else conv.group_id,
                  "episode": conv.episode, "call": call}
        if conv.reward is not None:
            record["reward"] = conv.reward
        out.append(record)
        ids = ids + gen
        prev = (i, where)
    return out


def _source_index(conv: Conversation, i: int) -> int:
    """Message ``i`` of the normalized conversation as numbered in the source file."""
    return conv.source_index[i] if conv.source_index else i


def _diverge(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)

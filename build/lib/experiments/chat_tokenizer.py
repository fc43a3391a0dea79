"""A local Hugging Face tokenizer directory with a ChatML chat template, made offline.

DTA never downloads a tokenizer. To import conversations (``dta import``) without one at
hand, train a small byte-level BPE on your own texts and save it with a Qwen-style ChatML
template (system prompt, ``# Tools`` block, ``<tool_call>`` JSON, ``<tool_response>``,
``<think>`` reasoning)::

    python -m experiments.chat_tokenizer --texts examples/tau2/*.json --vocab-size 8192 \
        --out /tmp/chatml-tok

``AutoTokenizer.from_pretrained(DIR).apply_chat_template(messages, tools=...)`` then works.
The tests use the same function with a few hundred tokens of vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Iterable

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<think>", "</think>")

# Qwen2.5-style ChatML. Written with explicit '\n' strings so that the template environment's
# trim_blocks / lstrip_blocks change nothing.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('a system message must come first') }}{%- endif %}"
    "{%- elif message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>"
    "<|im_end|>\\n' }}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_chat_tokenizer(texts: Iterable[str], out: str | os.PathLike, *, vocab_size: int = 8192,
                         template: str = CHAT_TEMPLATE) -> Path:
    """Train a byte-level BPE on ``texts`` and save it in ``out`` as a Hugging Face tokenizer
    directory (``tokenizer.json`` + ``tokenizer_config.json`` with ``template``); the
    end-of-turn token ``<|im_end|>`` is its ``eos_token``. Returns ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def _strings(obj) -> Iterable[str]:
    """Every string inside a JSON value (keys included): the training texts of a JSON file."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def texts_of(paths: Iterable[str]) -> list[str]:
    """The strings of JSON / JSONL files (every string value and key), or a text file's lines."""
    texts = []
    for path in paths:
        raw = Path(path).read_text(encoding="utf-8")
        try:
            texts.extend(_strings(json.loads(raw)))
            continue
        except json.JSONDecodeError:
            pass
        for line in raw.splitlines():
            try:
                texts.extend(_strings(json.loads(line)))
            except json.JSONDecodeError:
                texts.append(line)
    return texts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.chat_tokenizer",
                                description=__doc__.splitlines()[0])
    p.add_argument("--texts", nargs="+", required=True,
                   help="JSON / JSONL / text files to train on (every string in them)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--out", required=True, help="the tokenizer directory to write")
    args = p.parse_args(argv)
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        p.error(f"--out {args.out} exists and is not empty; choose a new directory")
    out = train_chat_tokenizer(texts_of(args.texts), args.out, vocab_size=args.vocab_size)
    print(f"tokenizer ({args.vocab_size} tokens, ChatML template) written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

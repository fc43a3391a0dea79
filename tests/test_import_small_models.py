"""`dta import --from tau2` on the turns small models write: empty and whitespace-only agent
messages, text plus a tool call, in a multi-trial results file (tests/data/tau2_small_models,
built in τ²'s layout from the committed real airline results; MIT, licence beside it).

Every generated agent message is a record that trains what the model produced (an empty one
its end-of-turn token), calls chain as prefixes within an episode, the trials of a task are
one group; a conversation that cannot be a chain of prefixes fails naming it, or with
--skip-invalid is left out and counted by reason; `dta bench --input` trains the import in
every mode within 1e-4 of one sequence at a time."""
import json
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from dta_cli.main import main as dta

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "tau2_small_models" / "airline_4trials_small_model_turns.json"
SCHEMAS = ROOT / "dta" / "data" / "tau2" / "tool_schemas_openai.json"
VOCAB = 2048


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from experiments.chat_tokenizer import texts_of, train_chat_tokenizer

    return str(train_chat_tokenizer(texts_of([str(FIXTURE), str(SCHEMAS)]),
                                    tmp_path_factory.mktemp("tok"), vocab_size=VOCAB))


@pytest.fixture(scope="module")
def tok(tok_dir):
    from dta.importing import load_tokenizer

    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def imported(tok_dir, tmp_path_factory):
    """The fixture imported with the plain ChatML template: (records, summary, out path)."""
    from dta.records.jsonl import read_jsonl

    out = tmp_path_factory.mktemp("calls") / "calls.jsonl"
    rc = dta(["import", "--from", "tau2", str(FIXTURE), "--tokenizer", tok_dir, "--out",
              str(out), "--json"])
    assert rc == 0
    return read_jsonl(str(out)), out


def _variant(tok_dir, out: Path, template: str) -> str:
    """A copy of the tokenizer directory with another chat template."""
    shutil.copytree(tok_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def _generated(sim) -> list[tuple[int, dict]]:
    """(index, message) of the agent messages the model wrote: all but τ²'s greeting."""
    return [(j, m) for j, m in enumerate(sim["messages"]) if m["role"] == "assistant" and j > 0]


def _trained(tok, r) -> str:
    return tok.decode(np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) == 1].tolist())


def _unique_tokens(seqs) -> int:
    """Nodes of the prefix trie of ``seqs``: the tokens a tree forwards once."""
    root, n = {}, 0
    for s in seqs:
        node = root
        for t in s:
            if t not in node:
                node[t] = {}
                n += 1
            node = node[t]
    return n


def _read_json_line(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_small_model_turns_import(tok, tok_dir, imported, capsys):
    """One record per generated agent message (τ²'s greeting is context), in file order; each
    trains what the model produced: an empty turn exactly its end-of-turn token, a
    whitespace-only turn its whitespace and end-of-turn token, text + tool call both; each
    call's input is a prefix of the next call's in its episode; one group per task with its
    four trials as episodes, and the sharing breakdown's chain / group / batch levels are the
    unique-token counts of those tries (`dta plan --input` reports the group level)."""
    records, out = imported
    raw = json.loads(FIXTURE.read_text())
    assert raw["info"]["num_trials"] == 4
    sims = raw["simulations"]
    expected = [(s["id"], k, s["task_id"], j, m) for s in sims
                for k, (j, m) in enumerate(_generated(s))]
    assert len(records) == len(expected) == 93
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    kinds = defaultdict(int)
    for r, (episode, call, task, j, m) in zip(records, expected):
        assert (r["episode"], r["call"], r["group_id"]) == (episode, call, task)
        mask = np.asarray(r["loss_mask"])
        assert mask.sum() > 0 and mask[-1] == 1 and mask[0] == 0
        text, content = _trained(tok, r), m["content"] or ""
        if not content.strip() and not m["tool_calls"]:
            kinds["whitespace" if content else "empty"] += 1
            assert np.asarray(r["input_ids"])[mask == 1].tolist() == (
                tok(content, add_special_tokens=False)["input_ids"] + [eot]), (episode, j)
            assert text == content + "<|im_end|>"
        elif content and m["tool_calls"]:
            kinds["text+tool"] += 1
            call0 = m["tool_calls"][0]
            assert text.startswith(content + "\n<tool_call>\n" + json.dumps(
                {"name": call0["name"], "arguments": call0["arguments"]}))
        else:
            kinds["plain"] += 1
            assert text.endswith("<|im_end|>") and (not content or text.startswith(content))
    assert kinds["empty"] == 6 and kinds["whitespace"] == 3 and kinds["text+tool"] == 9
    by_episode, by_group = defaultdict(list), defaultdict(set)
    for r in records:
        by_episode[r["episode"]].append(r)
        by_group[r["group_id"]].add(r["episode"])
    for calls in by_episode.values():
        for a, b in zip(calls, calls[1:]):
            assert b["input_ids"][:len(a["input_ids"])].tolist() == a["input_ids"].tolist()
    assert {g: len(e) for g, e in by_group.items()} == {"13": 4, "6": 4, "48": 4}
    seqs = [r["input_ids"].tolist() for r in records]
    chains = sum(_unique_tokens([r["input_ids"].tolist() for r in c]) for c in by_episode.values())
    groups = sum(_unique_tokens([r["input_ids"].tolist() for e in eps for r in by_episode[e]])
                 for eps in by_group.values())
    batch = _unique_tokens(seqs)
    total = sum(len(s) for s in seqs)
    rc = dta(["plan", "--input", str(out), "--json"])
    text = capsys.readouterr().out
    assert rc == 0
    b = _read_json_line(text)["sharing"]
    assert (b["sequences"], b["episodes"], b["groups"]) == (93, 12, 3)
    lv = b["levels"]
    assert lv["chains"]["saved_tokens"] == total - chains
    assert lv["groups"]["saved_tokens"] == chains - groups > 0  # trials share their start
    assert lv["batch"]["saved_tokens"] == groups - batch > 0  # tasks share the system prompt
    assert lv["groups"]["ratio"] == pytest.approx(chains / groups)
    assert "groups (episodes of one task share their start)" in text


def test_templates_that_render_empty_turns_differently(tok_dir, imported, tmp_path):
    """A template that drops an empty assistant message from the conversation (the old
    failure: 'the conversation through this message does not start with its generation
    prompt'), or trims whitespace-only content, imports the same records as the plain ChatML
    template: the model is fed and trained on what it produced."""
    from dta.importing import import_file
    from experiments.chat_tokenizer import CHAT_TEMPLATE

    records, _ = imported
    head = "{%- elif message.role == 'assistant' %}"
    assert head in CHAT_TEMPLATE and "{{- message.content }}" in CHAT_TEMPLATE
    drop_empty = CHAT_TEMPLATE.replace(
        head, "{%- elif message.role == 'assistant' and not (message.content or "
              "message.tool_calls) %}" + head)
    trim = CHAT_TEMPLATE.replace("{{- message.content }}", "{{- message.content | trim }}")
    for name, template in (("drop-empty", drop_empty), ("trim", trim)):
        got = import_file("tau2", FIXTURE, _variant(tok_dir, tmp_path / name, template))
        assert not got.skipped and len(got.records) == len(records), name
        for a, b in zip(got.records, records):
            assert a["input_ids"] == b["input_ids"].tolist(), (name, a["episode"], a["call"])
            assert a["loss_mask"] == b["loss_mask"].tolist(), (name, a["episode"], a["call"])


def test_template_that_writes_an_empty_think_block_on_the_last_message(tok, tok_dir, tmp_path):
    """A Qwen3-style template writes an empty think block on the last assistant message only
    (what a non-thinking generation starts with) and none in context: each call trains the
    block, an empty turn exactly the block and its end-of-turn token, later calls are fed it
    as generated, and calls still chain as prefixes."""
    from dta.importing import import_file
    from experiments.chat_tokenizer import CHAT_TEMPLATE

    old = ("{%- if message.reasoning_content %}"
           "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}")
    assert old in CHAT_TEMPLATE
    qwen3ish = CHAT_TEMPLATE.replace(old, (
        "{%- if message.reasoning_content or loop.last %}"
        "{{- '<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' }}"))
    got = import_file("tau2", FIXTURE, _variant(tok_dir, tmp_path / "q3", qwen3ish))
    assert not got.skipped and len(got.records) == 93
    block = "<think>\n\n</think>\n\n"
    raw = json.loads(FIXTURE.read_text())
    messages = [m for s in raw["simulations"] for _, m in _generated(s)]
    previous = None
    for r, m in zip(got.records, messages):
        text = _trained(tok, r)
        assert text.startswith(block), text[:40]
        if not m["content"] and not m["tool_calls"]:
            assert text == block + "<|im_end|>"
        if previous is not None and previous["episode"] == r["episode"]:
            assert r["input_ids"][:len(previous["input_ids"])] == previous["input_ids"]
            fed = tok.decode(r["input_ids"][:len(previous["input_ids"])])
            assert fed.count(block) == previous["call"] + 1  # every earlier call's block
        previous = r
    # consecutive generated messages: the first is last (think block) when the second's
    # prompt is rendered without it... and in context after it; both calls still chain
    conv = tmp_path / "two.jsonl"
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"},
                                             {"role": "assistant", "content": "sure"},
                                             {"role": "assistant", "content": "done"}]}) + "\n")
    a, b = import_file("openai", conv, str(tmp_path / "q3")).records
    assert b["input_ids"][:len(a["input_ids"])] == a["input_ids"]
    assert [_trained(tok, r) for r in (a, b)] == [block + "sure<|im_end|>", block + "done<|im_end|>"]


def test_unrenderable_conversation_fails_or_is_skipped(tok, tok_dir, imported, tmp_path, capsys):
    """A conversation the template cannot render (a system message in the middle: the ChatML
    template raises) fails the import in one line naming the file, simulation, task and
    message, with no --out written; --skip-invalid leaves it out and counts it by reason, in
    the summary and in --json, and imports every other record unchanged. With a template that
    rewrites the history once a tool result appears, two reasons are counted apart."""
    from dta.records.jsonl import read_jsonl
    from experiments.chat_tokenizer import CHAT_TEMPLATE

    records, _ = imported
    raw = json.loads(FIXTURE.read_text())
    sim, cut = raw["simulations"][4], raw["simulations"][7]
    sim["messages"].insert(5, {"role": "system", "content": "Note: the agent was restarted."})
    cut["messages"] = cut["messages"][:2]  # the greeting and the user: no generated message
    bad = tmp_path / "broken.json"
    bad.write_text(json.dumps(raw))
    out = tmp_path / "calls.jsonl"
    argv = ["import", "--from", "tau2", str(bad), "--tokenizer", tok_dir, "--out", str(out)]
    rc = dta(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    where = f"broken.json simulation 4 (task {sim['task_id']}) message "
    assert where in err[0] and "the chat template failed" in err[0]
    assert "a system message must come first" in err[0]
    assert not out.exists()
    rc = dta(argv + ["--skip-invalid", "--json"])
    text = capsys.readouterr().out
    assert rc == 0
    s = _read_json_line(text)
    assert s["skipped"]["total"] == 1 and s["skipped"]["by_reason"] == {"template-error": 1}
    assert where in s["skipped"]["conversations"][0]["where"]
    assert s["conversations"] == 12 and s["imported_conversations"] == 11
    assert "skipped (--skip-invalid): 1 of 12 conversations: 1 template-error" in text
    assert s["without_calls"] == [f"{bad} simulation 7 (task {cut['task_id']})"]
    assert "1 conversation has no generated agent message (no record)" in text
    kept = read_jsonl(str(out))
    want = [r for r in records if r["episode"] not in (sim["id"], cut["id"])]
    assert len(kept) == s["records"] == len(want)
    assert all(a["input_ids"].tolist() == b["input_ids"].tolist() for a, b in zip(kept, want))

    # two reasons: a template that prints a line in front once any tool result exists
    # rewrites the history of a conversation whose first tool result comes after a call
    rewrites = _variant(tok_dir, tmp_path / "rw", "{%- if messages | selectattr('role', "
                        "'equalto', 'tool') | list %}[tool results below]\n{%- endif %}"
                        + CHAT_TEMPLATE)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_user_details", "arguments": {"user_id": "u1"}}}
    hello, ok = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "sure"}
    convs = [{"id": "plain", "messages": [hello, ok]},
             {"id": "tools", "messages": [hello, {"role": "assistant", "content": "",
                                                  "tool_calls": [call]},
                                          {"role": "tool", "tool_call_id": "c1",
                                           "content": "{}"}, ok]},
             {"id": "system", "messages": [hello, ok, {"role": "system", "content": "x"},
                                           ok]}]
    jl = tmp_path / "conv.jsonl"
    jl.write_text("".join(json.dumps(c) + "\n" for c in convs))
    argv = ["import", "--from", "openai", str(jl), "--tokenizer", rewrites, "--out",
            str(tmp_path / "c2.jsonl")]
    assert dta(argv) == 2
    err = capsys.readouterr().err
    assert "conv.jsonl line 2 (conversation tools) message 3" in err
    assert "rewrites the history" in err
    assert dta(argv + ["--skip-invalid", "--json"]) == 0
    s = _read_json_line(capsys.readouterr().out)
    assert s["skipped"]["by_reason"] == {"history-rewritten": 1, "template-error": 1}
    assert s["records"] == 1 and s["imported_conversations"] == 1


def _tiny_model(path: Path) -> str:
    """A random-init tiny Qwen3 with the tokenizer's vocabulary and room for the calls'
    lengths (the built-in tiny size stops at 4,096 positions)."""
    from dta.model.models import build_model

    build_model("qwen3", "tiny", vocab_size=VOCAB, max_position_embeddings=8192).save_pretrained(
        str(path))
    return str(path)


def _bench(calls: Path, out: Path, capsys, *model) -> dict:
    modes = "padded,microbatch,treemask,dfs-node,dfs-retain,dfs-recompute"
    rc = dta(["bench", "--input", str(calls), *model, "--repeats", "1", "--in-process",
              "--warmup", "none", "--threads", "2", "--pad-batch", "1", "--modes", modes,
              "--out", str(out), "--json"])
    text, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    d = _read_json_line(text)
    assert set(d["modes"]) == set(modes.split(","))
    for m, v in d["modes"].items():
        assert v["status"] == "ok" and v["grad_rel_err"] <= 1e-4, (m, v)
    assert d["loss"] == "nll" and d["ideal_speedup"] > 1
    return d


def test_bench_on_imported_small_model_turns(tok, tok_dir, tmp_path, capsys):
    """`dta bench --input` on an import of the fixture, reduced for the default suite: task
    48's trial 1 through its second call (an empty turn first) and trial 2 through its fifth
    (text + tool call, then a whitespace-only turn), the policy cut to 600 characters and only the tool they call
    (``tool_defs``), so that a call is ~1K tokens instead of ~6K: every mode within 1e-4 of
    one sequence at a time. The full-length calls are the slow test below."""
    from dta.records.jsonl import read_jsonl

    raw = json.loads(FIXTURE.read_text())
    one, two = [s for s in raw["simulations"] if s["task_id"] == "48" and s["trial"] in (1, 2)]
    one["messages"] = one["messages"][:6]  # the greeting, the empty turn, one more call
    two["messages"] = two["messages"][:12]  # through the whitespace-only turn's reply
    raw["simulations"] = [one, two]
    env = raw["info"]["environment_info"]
    env["policy"] = env["policy"][:600]
    used = {c["name"] for s in raw["simulations"] for m in s["messages"]
            for c in m.get("tool_calls") or []}
    env["tool_defs"] = [t for t in json.loads(SCHEMAS.read_text())["airline"]["agent"]
                        if t["function"]["name"] in used]
    src, calls = tmp_path / "reduced.json", tmp_path / "calls.jsonl"
    src.write_text(json.dumps(raw))
    assert dta(["import", "--from", "tau2", str(src), "--tokenizer", tok_dir, "--out",
                str(calls)]) == 0
    records = read_jsonl(str(calls))
    assert len(records) == 7 and max(len(r["input_ids"]) for r in records) < 2000
    assert sum(_trained(tok, r) == "<|im_end|>" for r in records) == 1  # the empty turn
    capsys.readouterr()
    d = _bench(calls, tmp_path / "b", capsys, "--model-size", "tiny", "--vocab-size", str(VOCAB))
    assert d["sequences"] == 7


@pytest.mark.slow
def test_bench_on_full_length_import(imported, tmp_path, capsys):
    """The same on the full-length import (τ²'s whole policy and 14 airline tools: 5.6-7K
    tokens a call), as much as --max-tokens keeps of it: the first episode, 8 calls."""
    records, calls = imported
    first = [r for r in records if r["episode"] == records[0]["episode"]]
    d = _bench(calls, tmp_path / "b", capsys, "--model", _tiny_model(tmp_path / "model"),
               "--max-tokens", str(sum(len(r["input_ids"]) for r in first)))
    assert d["sequences"] == len(first) == 8

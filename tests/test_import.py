"""`dta import`: conversations -> one record per generated agent message.

A tokenizer is trained here (tiny byte-level BPE, ChatML template: experiments.chat_tokenizer)
and the conversation files are written by the tests."""
import json
import re

import numpy as np
import pytest

from dta_cli.main import main as dta

WORDS = ("flight reservation cancel change baggage passenger economy business refund "
         "airport delay booking seat upgrade ticket payment insurance member gold silver "
         "hello please thanks sure your user id number date return one way round trip").split()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from experiments.chat_tokenizer import train_chat_tokenizer

    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, 12)) for _ in range(300)]
    texts += ['{"name": "get_user_details", "arguments": {"user_id": "u1"}}',
              "system user assistant tool_response tools function"]
    return str(train_chat_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=400))


@pytest.fixture(scope="module")
def tok(tok_dir):
    from dta.importing import load_tokenizer

    return load_tokenizer(tok_dir)


def _variant(tok_dir, tmp_path, template: str) -> str:
    """A copy of the tokenizer directory with another chat template."""
    import shutil

    out = tmp_path / "tok-variant"
    shutil.copytree(tok_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def _word_ids(tok) -> list[int]:
    """Ids of ' word' tokens that encode back to themselves alone."""
    out = []
    for i in range(len(tok)):
        s = tok.decode([i])
        if re.fullmatch(r" [a-z]{3,}", s) and tok(s, add_special_tokens=False)["input_ids"] == [i]:
            out.append(i)
    return out


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(capsys, *argv):
    rc = dta(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_openai_round_trip(tok, tok_dir, tmp_path, capsys):
    """Conversations written from known token sequences import back to them: every record's
    ids are the ChatML frame around the known content ids, the mask is exactly the assistant
    message's ids and its end-of-turn token, and each call is a prefix of the next."""
    from dta.records.jsonl import read_jsonl

    words = _word_ids(tok)
    assert len(words) >= 20
    rng = np.random.default_rng(1)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    convs, expected = [], []
    for c in range(3):
        roles = ["system", "user", "assistant", "user", "assistant", "user",
                 "assistant"][:5 + c % 3]
        known = [list(rng.choice(words, int(rng.integers(2, 7)))) for _ in roles]
        msgs = [{"role": r, "content": tok.decode(ids)} for r, ids in zip(roles, known)]
        convs.append({"id": f"ep{c}", "group_id": c // 2, "reward": float(c), "messages": msgs})
        ids, mask, recs = [], [], []
        for r, k in zip(roles, known):
            head = [start] + enc(f"{r}\n")
            ids += head
            mask += [0] * len(head)
            if r == "assistant":
                recs.append((list(ids) + k + [end], list(mask) + [1] * (len(k) + 1)))
            ids += k + [end] + enc("\n")
            mask += [0] * (len(k) + 1) + [0] * len(enc("\n"))
        expected.append(recs)
    src = _write_jsonl(tmp_path / "conv.jsonl", convs)
    out = str(tmp_path / "calls.jsonl")
    rc, text, err = _run(capsys, "import", "--from", "openai", src, "--tokenizer", tok_dir,
                         "--out", out, "--json")
    assert rc == 0, err
    records = read_jsonl(out)
    flat = [(c, k, e) for c, recs in enumerate(expected) for k, e in enumerate(recs)]
    assert len(records) == len(flat)
    for rec, (c, k, (ids, mask)) in zip(records, flat):
        assert rec["input_ids"].tolist() == ids
        assert rec["loss_mask"].tolist() == mask
        assert (rec["episode"], rec["call"], rec["group_id"], rec["reward"]) == (
            f"ep{c}", k, c // 2, float(c))
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["records"] == len(flat) and summary["conversations"] == 3
    lv = summary["sharing"]["levels"]
    assert sum(v["saved_tokens"] for v in lv.values()) == summary["sharing"]["saved_tokens"]


TAU2_POLICY = "# Airline policy\nBe kind. Cancel only within 24 hours."


def _tau2_file(tmp_path, simulations, **info_over):
    env = {"domain_name": "airline", "policy": TAU2_POLICY, "tool_defs": None}
    env.update(info_over)
    data = {"timestamp": "t", "info": {"environment_info": env}, "tasks": [],
            "simulations": simulations}
    p = tmp_path / "results.json"
    p.write_text(json.dumps(data))
    return str(p)


def _sim(i, task, reward, msgs):
    return {"id": f"sim-{i}", "task_id": task, "reward_info": {"reward": reward}, "messages": msgs}


def _greet():
    return {"role": "assistant", "content": "Hi! How can I help you today?", "tool_calls": None}


def _tau2_msgs(user_id: str):
    return [
        _greet(),
        {"role": "user", "content": f"please change my flight, user id {user_id}"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "name": "get_user_details", "arguments": {"user_id": user_id},
             "requestor": "assistant"}]},
        {"role": "tool", "id": "c1", "content": '{"name": "sure"}', "requestor": "assistant"},
        {"role": "assistant", "content": "sure, which date?", "tool_calls": None},
        {"role": "user", "content": "thanks"},
    ]


def test_tau2_records(tok, tok_dir, tmp_path, capsys):
    """One record per generated agent message (the greeting is context): τ²'s system prompt
    with the policy and the airline tools, calls chained as prefixes, every record trained,
    the reward and task on every record; `dta plan --input` reports the sharing breakdown."""
    from dta.records.jsonl import read_jsonl

    sims = [_sim(0, "7", 1.0, _tau2_msgs("u1")), _sim(1, "7", 0.0, _tau2_msgs("u2")),
            _sim(2, "9", 1.0, _tau2_msgs("u3")[:2] + [{"role": "assistant", "content": "ok"}])]
    src = _tau2_file(tmp_path, sims)
    out = str(tmp_path / "calls.jsonl")
    rc, _, err = _run(capsys, "import", "--from", "tau2", src, "--tokenizer", tok_dir, "--out", out)
    assert rc == 0, err
    recs = read_jsonl(out)
    assert [(r["episode"], r["call"], r["group_id"], r["reward"]) for r in recs] == [
        ("sim-0", 0, "7", 1.0), ("sim-0", 1, "7", 1.0), ("sim-1", 0, "7", 0.0),
        ("sim-1", 1, "7", 0.0), ("sim-2", 0, "9", 1.0)]
    for a, b in zip(recs, recs[1:]):
        if a["episode"] == b["episode"]:
            assert b["input_ids"][:len(a["input_ids"])].tolist() == a["input_ids"].tolist()
    for r in recs:
        m = r["loss_mask"]
        assert m.sum() > 0 and m[-1] == 1 and m[0] == 0
        trained = tok.decode(r["input_ids"][m == 1].tolist())
        assert trained.endswith("<|im_end|>") and "How can I help" not in trained
    first = tok.decode(recs[0]["input_ids"].tolist())
    assert "<instructions>\nYou are a customer service agent" in first
    assert "<policy>\n" + TAU2_POLICY + "\n</policy>" in first
    assert '"name": "book_reservation"' in first  # the airline agent tools
    assert "Hi! How can I help you today?" in first  # context, not trained
    assert '"arguments": {"user_id": "u1"}' in tok.decode(
        recs[0]["input_ids"][recs[0]["loss_mask"] == 1].tolist())
    rc, text, err = _run(capsys, "plan", "--input", out, "--json")
    assert rc == 0, err
    b = json.loads(text.strip().splitlines()[-1])["sharing"]
    assert b["sequences"] == 5 and b["episodes"] == 3 and b["groups"] == 2
    assert b["levels"]["chains"]["saved_tokens"] == sum(
        len(recs[k]["input_ids"]) for k in (0, 2))  # call 1 re-reads call 0 in two episodes
    assert b["common_prefix_tokens"] > len(tok(TAU2_POLICY)["input_ids"])
    assert "per-call chains" in text


def _one_line_error(capsys, argv, *needles):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_bad_inputs(tok_dir, tmp_path, capsys):
    """Each bad input is one line naming the file, conversation and message; no --out."""
    out = tmp_path / "calls.jsonl"
    args = ["--tokenizer", tok_dir, "--out", str(out)]
    tau2 = _tau2_file(tmp_path, [_sim(0, "7", 1.0, _tau2_msgs("u1"))])
    good = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "sure"}]
    _one_line_error(capsys, ["import", "--from", "openai", tau2, *args],
                    "results.json line 1", "--from tau2")
    conv = _write_jsonl(tmp_path / "conv.jsonl", [{"id": "a", "messages": good}])
    _one_line_error(capsys, ["import", "--from", "tau2", conv, *args],
                    "conv.jsonl", "not a τ²-bench results file")
    bad = _write_jsonl(tmp_path / "role.jsonl", [{"id": "a", "messages": good},
                                                 {"id": "b", "messages": [good[0], {
                                                     "role": "robot", "content": "x"}]}])
    _one_line_error(capsys, ["import", "--from", "openai", bad, *args],
                    "role.jsonl line 2 (conversation b) message 1", "unknown role 'robot'")
    bad_tau2 = _tau2_file(tmp_path, [_sim(0, "7", 1.0, _tau2_msgs("u1") + [
        {"role": "narrator", "content": "x"}])])
    _one_line_error(capsys, ["import", "--from", "tau2", bad_tau2, *args],
                    "simulation 0 (task 7) message 6", "unknown role 'narrator'")
    field = _write_jsonl(tmp_path / "field.jsonl", [{"messages": good, "score": 1}])
    _one_line_error(capsys, ["import", "--from", "openai", field, *args], "line 1",
                    "unknown field 'score'")
    assert not out.exists()


def test_template_not_a_prefix(tok, tok_dir, tmp_path, capsys):
    """A template that rewrites history (the message count in front) is refused naming the
    conversation and message; one that drops earlier reasoning (shown only on the last
    message, as Qwen3's) imports: each call trains its reasoning and the next call is fed it
    as generated, so calls stay prefixes; --thinking drop leaves it out; a template that
    cannot show reasoning is refused under keep."""
    from dta.records.jsonl import read_jsonl
    from experiments.chat_tokenizer import CHAT_TEMPLATE

    out = tmp_path / "calls.jsonl"
    msgs = [{"role": "user", "content": "hello"},
            {"role": "assistant", "content": "sure", "reasoning_content": "think first"},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "bye", "reasoning_content": "done"}]
    conv = _write_jsonl(tmp_path / "conv.jsonl", [{"id": "e1", "messages": msgs}])
    counted = _variant(tok_dir, tmp_path / "a", "{{- messages | length }}" + CHAT_TEMPLATE)
    _one_line_error(capsys, ["import", "--from", "openai", conv, "--tokenizer", counted,
                             "--out", str(out)],
                    "conv.jsonl line 1 (conversation e1) message 3",
                    "does not render a prefix", "rewrites the history at character 0")
    assert not out.exists()
    last_only = _variant(tok_dir, tmp_path / "b", CHAT_TEMPLATE.replace(
        "{%- if message.reasoning_content %}", "{%- if message.reasoning_content and loop.last %}"))
    rc, _, err = _run(capsys, "import", "--from", "openai", conv, "--tokenizer", last_only,
                      "--out", str(out))
    assert rc == 0, err
    a, b = read_jsonl(out)
    assert b["input_ids"][:len(a["input_ids"])].tolist() == a["input_ids"].tolist()
    trained = [tok.decode(r["input_ids"][r["loss_mask"] == 1].tolist()) for r in (a, b)]
    assert trained == ["<think>\nthink first\n</think>\n\nsure<|im_end|>",
                       "<think>\ndone\n</think>\n\nbye<|im_end|>"]
    assert "think first" in tok.decode(b["input_ids"][b["loss_mask"] == 0].tolist())
    rc, _, err = _run(capsys, "import", "--from", "openai", conv, "--tokenizer", last_only,
                      "--out", str(out), "--thinking", "drop", "--overwrite")
    assert rc == 0, err
    assert all("think" not in tok.decode(r["input_ids"].tolist()) for r in read_jsonl(out))
    blind = _variant(tok_dir, tmp_path / "c", CHAT_TEMPLATE.replace(
        "{%- if message.reasoning_content %}", "{%- if false %}"))
    _one_line_error(capsys, ["import", "--from", "openai", conv, "--tokenizer", blind,
                             "--out", str(tmp_path / "x.jsonl")],
                    "message 1", "does not render the message's reasoning")
    rc, _, err = _run(capsys, "import", "--from", "openai", conv, "--tokenizer", tok_dir,
                      "--out", str(out))
    assert rc == 2 and "exists" in err  # never overwritten without --overwrite


TAU2_FILE = "examples/tau2/gpt-4.1_airline_default_gpt-4.1_1trials.json"


def test_real_tau2_results(tmp_path):
    """The committed τ²-bench airline results (20 simulations, 226 assistant messages, each
    simulation opening with τ²'s greeting): one record per generated agent message, each call
    a prefix of the next in its episode, every record trained, the greeting never trained,
    and the sharing is the chains' and the system prompt's."""
    from pathlib import Path

    from dta.importing import import_file
    from dta.planning.sharing import sharing_breakdown
    from experiments.chat_tokenizer import texts_of, train_chat_tokenizer

    root = Path(__file__).resolve().parents[1]
    src = str(root / TAU2_FILE)
    tok = train_chat_tokenizer(texts_of([src]), tmp_path / "tok", vocab_size=4096)
    raw = json.loads(Path(src).read_text())
    generated = sum(m["role"] == "assistant" for s in raw["simulations"]
                    for m in s["messages"][1:])
    assert all(s["messages"][0]["content"] == "Hi! How can I help you today?"
               for s in raw["simulations"])
    got = import_file("tau2", src, str(tok))
    records, convs = got.records, got.conversations
    assert not got.skipped and not got.without_calls
    assert len(convs) == 20 and len(records) == generated == 206
    by_episode = {}
    for r in records:
        by_episode.setdefault(r["episode"], []).append(r)
        assert sum(r["loss_mask"]) > 0 and r["loss_mask"][-1] == 1
    for calls in by_episode.values():
        assert [r["call"] for r in calls] == list(range(len(calls)))
        for a, b in zip(calls, calls[1:]):
            assert b["input_ids"][:len(a["input_ids"])] == a["input_ids"]
    b = sharing_breakdown(records)
    assert b["levels"]["chains"]["ratio"] > 5 and b["levels"]["batch"]["ratio"] > 2
    assert b["levels"]["groups"]["saved_tokens"] == 0  # one trial per task
    assert b["common_prefix_tokens"] > 4000  # τ²'s system prompt and the airline tools

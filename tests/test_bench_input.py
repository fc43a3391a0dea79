"""`dta bench --input`: the user's batch, cut by whole groups and episodes, every mode's
gradient checked; the vocabulary check; the bench modules import without a circle."""
import json
from pathlib import Path

import numpy as np
import pytest

from dta_cli.main import main as dta
from experiments.bench.inputs import cut

ROOT = Path(__file__).resolve().parents[1]


def _recs(spec):
    """spec: (group, episode, length) per record, in file order."""
    return [{"input_ids": np.arange(n), "group_id": g, "episode": e} for g, e, n in spec]


SPEC = [("a", 1, 10), ("a", 1, 12), ("b", 2, 5), ("a", 3, 8), ("b", 4, 7), ("c", 5, 4),
        ("b", 4, 9), ("c", 6, 3)]


def _kept(records):
    return [(r["group_id"], r["episode"], len(r["input_ids"])) for r in records]


def test_cut_by_whole_groups_then_episodes():
    recs = _recs(SPEC)
    # group a (episodes 1, 3: 30 tokens), group b (episodes 2, 4: 21), group c (5, 6: 7)
    kept, info = cut(recs, max_tokens=45)  # a whole (30), b does not fit; of b, episode 2 (5)
    assert _kept(kept) == [("a", 1, 10), ("a", 1, 12), ("b", 2, 5), ("a", 3, 8)]
    assert info["kept_tokens"] == 35 and info["partial_group"] and info["groups"] == 2
    kept, info = cut(recs, max_sequences=6)  # a (3) + b (3) whole; c's episodes (1 each) stop
    assert [r["group_id"] for r in kept] == ["a", "a", "b", "a", "b", "b"]
    assert not info["partial_group"]
    kept, _ = cut(recs, max_tokens=1000)
    assert _kept(kept) == SPEC
    assert _kept(cut(recs, max_tokens=45)[0]) == _kept(cut(list(recs), max_tokens=45)[0])
    with pytest.raises(ValueError, match="first episode .2 sequences, 22 tokens. is larger"):
        cut(recs, max_tokens=20)
    # no episode: each record is its own; no group: the episode is the group
    plain = [{"input_ids": np.arange(n)} for n in (4, 4, 4)]
    assert len(cut(plain, max_sequences=2)[0]) == 2


def test_bench_modules_import_without_a_circle():
    """experiments.bench.cli and .run no longer import each other (cli needs only config)."""
    import ast

    tree = ast.parse((ROOT / "experiments/bench/cli.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "experiments.bench.run" not in imported and "experiments.bench.config" in imported
    import argparse

    from experiments.bench import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    cfg = cli.config_from_args(p.parse_args(["--input", "x.jsonl", "--max-tokens", "9"]))
    assert type(cfg).__module__ == "experiments.bench.config"
    assert (cfg.input, cfg.max_tokens, cfg.loss) == ("x.jsonl", 9, None)


def _conversations(path: Path, n: int = 4):
    rng = np.random.default_rng(0)
    words = "flight seat change cancel refund date passenger economy please thanks".split()
    say = lambda k: " ".join(rng.choice(words, k))
    rows = []
    for e in range(n):
        msgs = [{"role": "system", "content": "You are a careful airline agent. " * 3}]
        for _ in range(2 + e % 2):
            msgs += [{"role": "user", "content": say(6)}, {"role": "assistant", "content": say(5)}]
        rows.append({"id": f"e{e}", "group_id": e // 2, "reward": float(e % 2), "messages": msgs})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bench_on_imported_conversations(tmp_path, capsys):
    """Import conversations, then bench them: every mode ok within 1e-4 of one sequence at a
    time, the ideal from the cut batch's tree; the cut is reported; a model whose vocabulary
    does not cover the ids is refused in one line before any run."""
    from experiments.chat_tokenizer import train_chat_tokenizer

    tok = train_chat_tokenizer(["flight seat change cancel refund date passenger economy "
                                "please thanks You are a careful airline agent."] * 50,
                               tmp_path / "tok", vocab_size=300)
    conv = _conversations(tmp_path / "conv.jsonl")
    calls = tmp_path / "calls.jsonl"
    assert dta(["import", "--from", "openai", conv, "--tokenizer", str(tok), "--out",
                str(calls)]) == 0
    recs = [json.loads(x) for x in calls.read_text().splitlines()]
    first_two = [r for r in recs if r["group_id"] == 0]
    budget = sum(len(r["input_ids"]) for r in first_two) + 1  # group 0 whole, not group 1
    capsys.readouterr()
    rc = dta(["bench", "--input", str(calls), "--model-size", "tiny", "--vocab-size", "100",
              "--repeats", "1", "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "outside the model's vocabulary [0, 100)" in err[0]
    assert "calls.jsonl line 1" in err[0] and "qwen3-tiny-v100" in err[0]
    assert not (tmp_path / "c").exists()
    modes = "padded,microbatch,treemask,dfs-node,dfs-retain,dfs-recompute"
    rc = dta(["bench", "--input", str(calls), "--model-size", "tiny", "--vocab-size", "300",
              "--max-tokens", str(budget), "--repeats", "1", "--in-process", "--warmup", "none",
              "--threads", "1", "--modes", modes, "--out", str(tmp_path / "b"), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    d = json.loads(out.strip().splitlines()[-1])
    assert d["sequences"] == len(first_two) and d["loss"] == "nll" and d["workload"] is None
    assert d["model"] == "qwen3-tiny-v300"
    import torch
    import transformers

    from dta.model.models import build_config

    with torch.device("meta"):
        want = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
            build_config("qwen3", "tiny", vocab_size=300)).parameters())
    runs = json.loads((tmp_path / "b" / "results.json").read_text())["points"][0]["runs"]
    assert {r["params"] for r in runs} == {want}  # the worker built the 300-id model
    assert d["input_cut"]["kept_sequences"] == len(first_two) and d["input_cut"]["groups"] == 1
    assert d["ideal_speedup"] > 1
    for m, v in d["modes"].items():
        assert v["status"] == "ok" and v["grad_rel_err"] <= 1e-4, (m, v)
    assert d["headline"]["best_dfs"].startswith("dfs") and "over_treemask" in d["headline"]
    assert "calls.jsonl" in (tmp_path / "b" / "results.md").read_text()


def test_load_input_refusals(tmp_path):
    """Before any run: ids outside the vocabulary, a sequence beyond the model's positions,
    --loss ppo without advantages / logprobs; the loss follows the records' fields."""
    from dta.records.jsonl import write_jsonl
    from experiments.bench.inputs import load_input

    path = tmp_path / "b.jsonl"
    write_jsonl(path, [{"input_ids": [1, 2, 3, 4], "episode": "e", "call": 0},
                       {"input_ids": [1, 2, 3, 4, 5, 6], "episode": "e", "call": 1}])
    with pytest.raises(ValueError, match=r"b.jsonl line 1: .*outside the model's vocabulary "
                                         r"\[0, 4\) \(m's vocabulary has 4 ids"):
        load_input(str(path), 4, "m")
    with pytest.raises(ValueError, match="call 1. has 6 tokens, beyond m's 5 positions"):
        load_input(str(path), 10, "m", max_positions=5)
    with pytest.raises(ValueError, match="--loss ppo needs 'advantages' and 'logprobs'"):
        load_input(str(path), 10, "m", loss="ppo")
    assert load_input(str(path), 10, "m")[2] == "nll"
    write_jsonl(path, [{"input_ids": [1, 2, 3], "advantages": 1.0, "logprobs": [0, -1, -1]}])
    assert load_input(str(path), 10, "m")[2] == "ppo"

"""`dta verify --family F --dtype float64 --json` reports max relative error <= 1e-10."""
import json

import numpy as np
import pytest

from dta_cli.main import main


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2"])
def test_verify_float64_json(family, capsys):
    code = main(["verify", "--family", family, "--dtype", "float64", "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert code == 0 and report["passed"]
    assert report["max_rel_err"] <= 1e-10
    assert report["sharing_ratio"] > 1.5 and report["truly_float64"]


def test_verify_user_jsonl(tmp_path, capsys):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 20).tolist()
    lines = []
    for g in range(2):
        for k in range(3):
            ids = prompt + rng.integers(3, 500, 6 + k).tolist()
            mask = [0] * 20 + [1] * (6 + k)
            lines.append(json.dumps({"input_ids": ids, "loss_mask": mask,
                                     "advantages": float(k - 1), "group_id": g}))
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code = main(["verify", "--input", str(path), "--dtype", "float64", "--policy", "recompute",
                 "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["sequences"] == 6 and report["max_rel_err"] <= 1e-10


def test_verify_family_tested_configuration(capsys):
    """`dta verify --family F` verifies the family's tested configuration (window 8 here)."""
    code = main(["verify", "--family", "mistral", "--dtype", "float64", "--max-sequences", "4",
                 "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert code == 0 and report["passed"] and report["family"] == "mistral" and report["matrix"]
    assert any("window: all layers" in line for line in out)
    assert report["max_rel_err"] <= 1e-10


def test_verify_takes_blocks(capsys):
    """`dta verify --block-tokens 5`: blocks of 5 tokens (inside a window of 8) on the DFS
    side, float64-exact; a negative block is refused in one line."""
    code = main(["verify", "--family", "mistral", "--dtype", "float64", "--max-sequences", "4",
                 "--policy", "recompute", "--block-tokens", "5", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["passed"] and report["max_rel_err"] <= 1e-10
    assert report["block_tokens"] == 5 and report["blocks_cut"] > 0
    with pytest.raises(SystemExit, match="--block-tokens: -1 must be"):
        main(["verify", "--family", "qwen3", "--block-tokens", "-1"])

"""bf16 fidelity (dta/fidelity.py, `dta verify --against`): DFS in bf16 is as accurate as
per-sequence training in bf16, both measured against per-sequence float64 training."""
import json

import pytest

from dta_cli.main import main


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen3_5", "gemma3"])
def test_verify_bf16_against_float64_json(family, capsys):
    code = main(["verify", "--family", family, "--size", "tiny", "--dtype", "bfloat16",
                 "--against", "float64", "--max-sequences", "16", "--json"])  # as docs/results.md
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert code == 0 and r["passed"] and r["dtype"] == "bfloat16" and r["against"] == "float64"
    for side in ("dfs", "per_sequence"):  # bf16 is not exact: both sides err, measurably
        assert 0 < r[side]["logprobs_rel_l2"] < 1e-2 and 0 < r[side]["grad_rel_l2"] < 0.1, side
    for k in ("logprobs_rel_l2", "grad_rel_l2"):
        assert r["ratio"][k] == pytest.approx(r["dfs"][k] / r["per_sequence"][k])
        assert r["ratio"][k] <= 1.5, k


def test_fidelity_flags_are_checked(capsys):
    with pytest.raises(SystemExit, match="wider dtype"):
        main(["verify", "--family", "llama", "--size", "tiny", "--dtype", "float64",
              "--against", "float32", "--max-sequences", "2"])

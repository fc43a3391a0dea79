"""experiments/bf16_drift.py: a 2-step run (the 50-step one is run by hand: docs/gpu.md)."""
import json

from experiments import bf16_drift


def test_two_step_drift_run_writes_series_plot_and_json(tmp_path, capsys):
    code = bf16_drift.main(["--steps", "2", "--groups", "2", "--samples", "3", "--json",
                            "--out", str(tmp_path)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((tmp_path / "drift.json").read_text())
    assert (tmp_path / "drift.png").stat().st_size > 1000
    assert out["steps"] == 2 and out["dtype"] == "bfloat16" and code == (0 if out["passed"] else 1)
    for k in ("drift_logprob", "floor_logprob", "drift_param", "floor_param"):
        assert len(saved["series"][k]) == 2 and all(v > 0 for v in saved["series"][k]), k
    # the three runs differ (bf16 rounding), and the verdict is the ratio of the last step's
    assert out["ratio"]["logprob"] == saved["final"]["drift_logprob"] / saved["final"]["floor_logprob"]
    assert out["passed"] == (max(out["ratio"].values()) <= out["claim"])

"""Honest reports: NaN anywhere fails `dta verify`; a sequence with no trained token is
compared on what it has (no false FAIL); --json is strict JSON; bad input is one line."""
import json

import numpy as np
import pytest

import dta.verify
from dta.batch import Batch
from dta.losses import NLL
from dta.model.models import build_model
from dta_cli.main import main


def strict_loads(line: str):
    def no_constants(name):
        raise ValueError(f"not strict JSON: {name}")
    return json.loads(line, parse_constant=no_constants)


def _jsonl(tmp_path, zero_mask_line: bool = False):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 12).tolist()
    lines = []
    for k in range(3):
        ids = prompt + rng.integers(3, 500, 5 + k).tolist()
        lines.append({"input_ids": ids, "loss_mask": [0] * 12 + [1] * (5 + k), "advantages": 1.0})
    if zero_mask_line:  # shares the prompt, then its own tail: no trained token at all
        ids = prompt + rng.integers(3, 500, 7).tolist()
        lines.append({"input_ids": ids, "loss_mask": [0] * len(ids), "advantages": 1.0})
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_verify_fails_on_nan(tmp_path, capsys, monkeypatch):
    real = dta.verify.unpacked_gradients

    def nan_in_one_gradient(model, *a, **kw):
        out = real(model, *a, **kw)
        next(p for p in model.parameters() if p.grad is not None).grad[0].fill_(float("nan"))
        return out

    monkeypatch.setattr(dta.verify, "unpacked_gradients", nan_in_one_gradient)
    code = main(["verify", "--input", str(_jsonl(tmp_path)), "--dtype", "float64", "--loss",
                 "nll", "--json"])
    captured = capsys.readouterr()
    report = strict_loads(captured.out.strip().splitlines()[-1])
    assert code == 1 and report["passed"] is False
    assert report["grad_rel_err"] is None and report["max_rel_err"] is None  # NaN -> null
    assert "FAIL" in captured.out


def test_report_with_nan_is_not_passed():
    m = build_model("qwen3", "tiny", seed=0, dtype="float64")
    batch = Batch.from_records([dict(input_ids=np.arange(3, 12))])
    rep = dta.verify.verify(m, batch, NLL())
    assert rep.passed(1e-10)
    rep.grad_rel_err = float("nan")
    assert not rep.passed(1e-10) and np.isnan(rep.max_rel_err())
    rep.grad_rel_err, rep.loss_rel_err = 0.0, float("inf")
    assert not rep.passed(1e-10)


def test_all_zero_mask_sequence_is_no_false_fail(tmp_path, capsys):
    code = main(["verify", "--input", str(_jsonl(tmp_path, zero_mask_line=True)), "--dtype",
                 "float64", "--loss", "nll", "--json"])
    report = strict_loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["passed"] and report["sequences"] == 4
    assert report["logprobs_rel_err"] <= 1e-10 and report["logprobs_sequences"] == 3


def test_bad_input_is_one_line_naming_file_line_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [3, 4, 5]}\n{"input_ids": [3, 4], "respons_mask": [0, 1]}\n')
    code = main(["verify", "--input", str(path), "--dtype", "float64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert f"{path} line 2: unknown field 'respons_mask'" in err[0] and "Traceback" not in err[0]
    with pytest.raises(Exception, match="respons_mask"):
        main(["verify", "--input", str(path), "--dtype", "float64", "--debug"])

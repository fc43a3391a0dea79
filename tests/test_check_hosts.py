"""scripts/check-hosts.sh's logic, offline: a host's pins read from the package metadata of an
installed distribution (markers and extras as pip applies them), a moved or removed pin of the
host's freeze found, ``pip check`` lines split into DTA's and the host's own, the package that
stopped an install named, and the table marking a failed check."""
from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import check_hosts  # noqa: E402
import host_env  # noqa: E402

sys.path.remove(str(SCRIPTS))

METADATA = """Metadata-Version: 2.1
Name: fakehost
Version: 1.0.4
Requires-Dist: torch<2.11,>=2.9.1
Requires-Dist: transformers<=5.3.0,>=5.0.0
Requires-Dist: Flash_Attn
Requires-Dist: ray[default]>=2.41
Requires-Dist: pytest; extra == "dev"
Requires-Dist: old-thing; python_version < "3"
"""


@pytest.fixture
def fakehost(tmp_path):
    info = tmp_path / "fakehost-1.0.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(METADATA)
    return next(d for d in md.distributions(path=[str(tmp_path)]) if d.metadata["Name"] == "fakehost")


def test_a_hosts_pins_come_from_its_installed_metadata(fakehost):
    reqs = host_env.requirements_of(fakehost)
    # what a plain `pip install fakehost` installs: no extra's, no other Python's
    assert reqs == ["torch<2.11,>=2.9.1", "transformers<=5.3.0,>=5.0.0", "Flash_Attn",
                    "ray[default]>=2.41"]
    assert host_env.pins_of(reqs) == {"torch": "<2.11,>=2.9.1", "transformers": "<=5.3.0,>=5.0.0"}
    assert host_env.pins_of(reqs, names=("flash-attn",)) == {"flash-attn": "any"}


def test_a_moved_or_removed_pin_is_found():
    before = {"torch": "2.10.0", "Transformers": "5.3.0", "peft": "0.18.1", "pip": "23.2.1"}
    assert host_env.moved_pins(before, dict(before, ray="2.60.0", pip="25.0")) == []
    after = {"torch": "2.10.0", "transformers": "5.25.0", "pip": "23.2.1"}
    assert host_env.moved_pins(before, after) == ["peft 0.18.1 -> removed",
                                                  "transformers 5.3.0 -> 5.25.0"]


def test_pip_check_lines_split_into_dtas_and_the_hosts():
    lines = ["dta 0.1.0 has requirement torch<=2.13.0,>=2.6, but you have torch 2.14.1.",
             "ray 2.60.0 requires aiohttp, which is not installed.",
             "sglang 0.5.23 requires flash-attn, which is not installed."]
    assert host_env.dta_check_problems(lines, {"dta", "Ray"}) == lines[:2]
    assert host_env.dta_check_problems(lines[2:], {"dta", "ray"}) == []


def test_the_package_that_stopped_an_install_is_named():
    built = "Building wheel for flash-attn (setup.py): finished with status 'error'\n" \
            "  ERROR: Failed building wheel for flash-attn\nFailed to build flash-attn\n"
    assert host_env.culprit(built) == ("flash-attn", "its build failed")
    meta = ("Collecting areal==1.0.4\nCollecting flash_attn<3 (from areal==1.0.4)\n"
            "  Downloading flash_attn-2.8.3.tar.gz (8.4 MB)\n  Preparing metadata (setup.py): "
            "finished with status 'error'\nerror: metadata-generation-failed\n")
    assert host_env.culprit(meta)[0] == "flash-attn"
    assert host_env.culprit("ERROR: No matching distribution found for cupy-cuda12x==13\n") \
        == ("cupy-cuda12x", "no distribution for this platform/Python")
    conflict = "ERROR: Cannot install dta because these package versions have conflicting " \
               "dependencies.\nERROR: ResolutionImpossible: for help visit ...\n"
    assert host_env.culprit(conflict) is None


def test_the_table_marks_failures_and_what_could_not_be_installed():
    result = {"host": "areal", "version": "1.0.4", "pins": {"torch": "<2.11,>=2.9.1"},
              "resolved": {"torch": "2.10.0", "transformers": "5.3.0"},
              "not_installable": {"flash-attn": "its build failed"},
              "checks": {"host install": {"passed": True, "detail": "without flash-attn"},
                         "DTA install": {"passed": False, "detail": "ResolutionImpossible: x"}}}
    table = check_hosts.render([result], datetime.datetime(2026, 12, 7), "abc1234")
    row = next(ln for ln in table.splitlines() if ln.startswith("| areal 1.0.4"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:6] == ["pass, without flash-attn", "**FAIL**", "not run"]
    assert "**not installable here**: flash-attn (its build failed)" in table
    assert "2026-12-07" in table and "abc1234" in table


def test_one_hosts_checks_from_two_runs_merge_into_one_row(tmp_path):
    def run(name, checks):
        host = {"host": "verl", "version": "0.9.1", "pins": {}, "resolved": {},
                "checks": {c: {"passed": ok, "detail": "x"} for c, ok in checks.items()}}
        path = tmp_path / name
        path.write_text("verl: done\n" + json.dumps({"started": "2026-12-07T04:00:00+00:00",
                                                     "commit": "abc1234", "hosts": [host]}))
        return str(path)

    main = run("main.json", {"host install": True, "DTA install": True, "dta train": True})
    door = run("door.json", {"door tests": False})
    out = tmp_path / "table.md"
    assert check_hosts.merge([main, door], str(out)) == 1  # the door tests failed
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| verl")]
    assert len(rows) == 1 and rows[0].count("pass") == 3 and rows[0].endswith("**FAIL** |")

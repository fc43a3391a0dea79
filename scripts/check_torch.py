"""torch releases against DTA's core families: a venv per torch release, the lock's transformers.

For each torch version (default: the newest patch of every minor release from pyproject's floor
to the newest on the registry), a virtual environment is made under ``--work``, torch is
installed from the registry (2.13.0: the local CPU wheel; the others are CUDA builds, which
run on a CPU machine; pip reads no machine-wide config file, whose constraint caps torch on
some machines), then DTA and its dependencies at the lock's versions
(``constraints.txt`` without its torch pins). There ``dta verify --family F --dtype float64``
runs for the core families and pytest for the core exactness tests; the venv is deleted after
(``--keep`` keeps it). Prints a table version x family.

    .venv/bin/python scripts/check_torch.py                    # every minor of the range
    .venv/bin/python scripts/check_torch.py 2.9.1 2.15.0       # these versions only

Run by scripts/check-torch.sh; docs/versions.md holds its table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_upstream import (  # noqa: E402
    REFUSED,
    first_line,
    key,
    load,
    merged_rows,
    read_runs,
    row_notes,
    run_record,
)

ROOT = Path(__file__).resolve().parent.parent
CORE = ["llama", "qwen3", "qwen3_moe", "gemma2", "qwen3_5"]  # dense, MoE, soft-capped, hybrid
TESTS = ["tests/test_equivalence.py", "tests/test_families_selfcheck.py"]
TORCH_PINS = re.compile(r"^(torch|torchdata|torchvision|torchaudio)==", re.I)


def torch_range() -> tuple[str, str]:
    m = re.search(r'"torch>=([0-9.]+),<=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    if m is None:
        raise SystemExit("check_torch: pyproject.toml has no 'torch>=A,<=B' dependency")
    return m.group(1), m.group(2)


def default_versions() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "torch"],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, PIP_CONSTRAINT="", PIP_CONFIG_FILE=os.devnull))
    found = re.search(r"Available versions: (.*)", out.stdout).group(1).split(",")
    finals = sorted({v.strip() for v in found if re.fullmatch(r"[0-9.]+", v.strip())}, key=key)
    floor = key(torch_range()[0])
    newest: dict[tuple, str] = {}
    for v in finals:
        if key(v) >= floor:
            newest[key(v)[:2]] = v
    return [newest[m] for m in sorted(newest)]


def make_venv(version: str, work: Path) -> Path:
    venv = work / f"torch-{version}"
    py = venv / "bin" / "python"
    if not py.exists():
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    # no machine-wide pip config: a global constraint capping torch (PIP_CONSTRAINT= alone
    # leaves a config file's on); the local wheels stay reachable through PIP_FIND_LINKS
    env = dict(os.environ, PIP_CONSTRAINT="", PIP_CONFIG_FILE=os.devnull,
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [str(py), "-m", "pip", "install", "-q", "--no-cache-dir"]
    subprocess.run(pip + [f"torch=={version}"], check=True, env=env)
    lock = work / "lock-without-torch.txt"
    lock.write_text("".join(ln + "\n" for ln in (ROOT / "constraints.txt").read_text().splitlines()
                            if not TORCH_PINS.match(ln.strip())))
    subprocess.run(pip + ["-c", str(lock), "-e", f"{ROOT}[dev]"], check=True, env=env)
    return py


def run_version(py: Path, fams: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([str(py), str(ROOT / "scripts" / "check_upstream.py"), "--worker",
                          *[f"{f}:1" for f in fams]], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    done = {json.loads(ln)["family"]: json.loads(ln) for ln in out.stdout.splitlines()
            if ln.startswith("{") and '"family"' in ln}
    row = {}
    for f in fams:
        r = done.get(f)
        if r is None:
            row[f] = (False, first_line(out.stderr or out.stdout))
            continue
        last = r["stdout"].strip().splitlines()[-1] if r["stdout"].strip() else ""
        try:
            report = json.loads(last)
        except json.JSONDecodeError:
            row[f] = (False, first_line(r["stderr"] or r["stdout"]))
            continue
        ok = r["code"] == 0 and bool(report.get("passed"))
        row[f] = (ok, f"{report['max_rel_err']:.1e}" if ok else first_line(r["stderr"] or last))
    tests = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    tail = tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr
    row["core tests"] = (tests.returncode == 0, first_line(tail))
    versions = subprocess.run([str(py), "-c", "import torch, transformers; print(torch.__version__, "
                               "transformers.__version__)"], capture_output=True, text=True)
    row["_installed"] = (True, versions.stdout.strip())
    return row


def render(rows: dict, columns: list[str], started, notes: list[str] = ()) -> str:
    when = "merged runs" if started is None else f"{started:%Y-%m-%d %H:%M} UTC"
    head = [f"# torch releases against DTA's core families ({when})", "",
            f"`scripts/check-torch.sh`, Python {sys.version.split()[0]}: a venv per torch "
            "release with the lock's other packages; `dta verify --family F --dtype float64` "
            f"(pass = max relative error <= 1e-10, shown) and `pytest {' '.join(TESTS)}`.", "",
            "| torch (installed) | transformers | " + " | ".join(columns) + " |",
            "|---|---|" + "---|" * len(columns)]
    fails = []
    for v, row in sorted(rows.items(), key=lambda kv: key(kv[0])):
        have = row.get("_installed", (True, f"{v} ?"))[1].split() or [v, "?"]
        cells = []
        for c in columns:
            ok, detail = row.get(c, (False, "not run"))
            cells.append(("pass " + detail if re.fullmatch(r"[0-9.e+-]+", detail) else
                          "refused" if detail.startswith(REFUSED) else "pass " + detail)
                         if ok else "**FAIL**")
            if not ok:
                fails.append(f"- {v} ({c}): {detail}")
        head.append(f"| {have[0]} | {have[-1]} | " + " | ".join(cells) + " |")
    return "\n".join(head + (["", *notes] if notes else [])
                     + (["", "Failures (first error line):", ""] + fails if fails else [])) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("versions", nargs="*", help="torch versions (default: every minor of the range)")
    ap.add_argument("--work", default="/tmp/dta-torch", help="where the venvs are made")
    ap.add_argument("--families", default=",".join(CORE), help="comma-separated")
    ap.add_argument("--keep", action="store_true", help="keep each venv (default: delete it)")
    ap.add_argument("--markdown", default="", help="also write the table to this file")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line "
                    "(printed after every version: a stopped run keeps its finished rows)")
    ap.add_argument("--merge", nargs="+", default=[], metavar="LOG",
                    help="only render one table from earlier runs' --json lines (logs)")
    args = ap.parse_args(argv)
    if args.merge:
        rows, facts = merged_rows(read_runs(args.merge, "check_torch"))
        columns = [c for c in dict.fromkeys(c for r in rows.values() for c in r) if c[0] != "_"]
        table = render(rows, columns, None, row_notes(facts))
        print(table)
        if args.markdown:
            Path(args.markdown).write_text(table)
        return 0 if all(ok for r in rows.values() for ok, _ in r.values()) else 1
    versions = args.versions or default_versions()
    fams = args.families.split(",")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    columns = fams + ["core tests"]
    for v in versions:
        t0, load0 = time.time(), load()
        try:
            py = make_venv(v, work)
        except subprocess.CalledProcessError as e:
            rows[v] = {c: (False, f"install failed ({e.returncode})") for c in columns}
        else:
            rows[v] = run_version(py, fams)
        finally:
            if not args.keep:
                shutil.rmtree(work / f"torch-{v}", ignore_errors=True)
        for c in columns:
            ok, detail = rows[v][c]
            print(f"torch {v} {c}: {'pass' if ok else 'FAIL'} {detail}", flush=True)
        print(f"torch {v}: {time.time() - t0:.0f} s", flush=True)
        runs[v] = {"seconds": round(time.time() - t0), "load": [load0, load()]}
        if args.markdown:
            Path(args.markdown).write_text(render(rows, columns, started))
        if args.json:  # after every version: a stopped run keeps its finished rows
            print(json.dumps(run_record(started, rows, runs)), flush=True)
    print(render(rows, columns, started))
    if args.json:
        print(json.dumps(run_record(started, rows, runs)))
    return 0 if all(all(ok for ok, _ in rows[v].values()) for v in versions) else 1


if __name__ == "__main__":
    sys.exit(main())

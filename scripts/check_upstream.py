"""Upstream drift, found by us: each transformers release against every family of DTA's matrix.

For each version (default: the newest patch of every minor release from the supported range's
floor in pyproject.toml to the newest on the registry), transformers is installed with
``--no-deps`` into a folder of its own under ``--work`` (the venv is not touched) and put first
on ``PYTHONPATH``; then ``dta verify --family F --dtype float64 --json`` runs for every family
of the support matrix (``dta.model.families.FAMILIES``) and the hybrid pack tests run under
pytest. The table says, per version and family, pass or fail with the error's first line.

    .venv/bin/python scripts/check_upstream.py                 # every minor of the range + newest
    .venv/bin/python scripts/check_upstream.py 5.24.0 5.25.0   # these versions only
    .venv/bin/python scripts/check_upstream.py --markdown docs/upstream-transformers.md

Run by scripts/check-upstream.sh; docs/versions.md says how its table is used.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# transformers' extras that change what it imports at run time (not its dev/test/docs tools)
RUNTIME_EXTRAS = ("kernels", "integrations", "torch", "accelerate", "tokenizers", "sentencepiece")
HYBRID_TESTS = ["tests/test_hybrid.py", "tests/test_hybrid_packs.py", "tests/test_gdn_kernels.py"]


def families() -> dict[str, str]:
    """Every family of the support matrix -> the first transformers release DTA has it on."""
    out = subprocess.run([sys.executable, "-c", "import json; from dta.model.families import "
                          "FAMILIES; print(json.dumps({f: x.since for f, x in FAMILIES.items()}))"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def supported_range() -> tuple[str, str]:
    """(floor, ceiling) of transformers in pyproject.toml's dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"transformers>=([0-9.]+),<=([0-9.]+)"', text)
    if m is None:
        raise SystemExit("check_upstream: pyproject.toml has no 'transformers>=A,<=B' dependency")
    return m.group(1), m.group(2)


def key(v: str) -> tuple:
    return tuple(int(x) for x in v.split("."))


def registry_versions() -> list[str]:
    """Every final transformers release on the registry, oldest first."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"],
                         capture_output=True, text=True, check=True)
    m = re.search(r"Available versions: (.*)", out.stdout)
    if m is None:
        raise SystemExit(f"check_upstream: cannot read pip's version list: {out.stdout[:200]}")
    return sorted((v.strip() for v in m.group(1).split(",") if re.fullmatch(r"[0-9.]+", v.strip())),
                  key=key)


def default_versions() -> list[str]:
    """The newest patch of each minor release from the range's floor to the newest release."""
    floor = key(supported_range()[0])
    newest: dict[tuple, str] = {}
    for v in registry_versions():
        if key(v)[:2] >= floor[:2] and key(v)[0] == floor[0]:
            newest[key(v)[:2]] = v
    return [newest[m] for m in sorted(newest)]


def pip_target(target: Path, *specs: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), *specs], check=True)


def _unmet(requires: list[str], have, extras: tuple[str, ...]) -> list[str]:
    """Those of ``requires`` (a distribution's Requires-Dist lines) that ``have(name)`` (the
    version the run will import, or None) does not meet: unconditional ones, and an extra's
    (``extras``) where it is installed -- transformers imports what is installed."""
    from packaging.requirements import Requirement

    unmet = []
    for line in requires:
        req = Requirement(line)
        if req.name == "torch":
            continue
        optional = req.marker is not None and "extra" in str(req.marker)
        if req.marker is not None:
            envs = [{"extra": e} for e in extras] if optional else [{"extra": ""}]
            if not any(req.marker.evaluate(env) for env in envs):
                continue
        version = have(req.name)
        if version is None:
            if not optional:
                unmet.append(f"{req.name}{req.specifier}")
        elif req.specifier and not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req.name}{req.specifier}")
    return unmet


def install(version: str, work: Path) -> tuple[Path, list[str]]:
    """transformers ``version`` in a folder of its own, with those of its own requirements
    that the venv's versions do not satisfy (old releases pin tokenizers / huggingface-hub
    below the venv's; an optional one such as ``kernels`` counts where the venv has it,
    since transformers imports what is installed), then theirs in turn (``kernels`` 0.15
    needs ``kernels-data``, which the venv lacks: transformers 5.13 - 5.17 failed to import
    without it), all ``--no-deps``; returns the folder and what else went in."""
    from importlib.metadata import PackageNotFoundError, distributions
    from importlib.metadata import version as venv_version

    from packaging.utils import canonicalize_name

    target = work / f"transformers-{version}"
    if not (target / "transformers").is_dir():
        pip_target(target, f"transformers=={version}")
    done = target / ".deps-done"
    if done.exists():
        return target, [x for x in done.read_text().splitlines() if x]

    def local():
        return {canonicalize_name(d.metadata["Name"]): d for d in distributions(path=[str(target)])}

    def have(name):
        d = local().get(canonicalize_name(name))
        if d is not None:
            return d.version
        try:
            return venv_version(name)
        except PackageNotFoundError:
            return None

    extra: list[str] = []
    for _ in range(5):  # transformers' pins, then what those bring, to a fixed point
        unmet = []
        for name, dist in local().items():
            extras = RUNTIME_EXTRAS if name == "transformers" else ()
            for u in _unmet(dist.requires or [], have, extras):
                if u not in unmet:
                    unmet.append(u)
        if not unmet:
            break
        pip_target(target, *unmet)
        extra += [u for u in unmet if u not in extra]
    done.write_text("\n".join(extra))
    return target, extra


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() or "FAIL" in ln]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:160]


REFUSED = "refused: "


def _worker(families: list[str]) -> None:
    """Run inside one process per version (one import of torch and transformers): each
    family's ``dta verify`` (main(), as the command runs it), one JSON line per family."""
    import contextlib
    import io

    from dta_cli.main import main

    for family, debug in (f.split(":") for f in families):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["verify", "--family", family, "--dtype", "float64", "--json",
                             *(["--debug"] if debug == "1" else [])])
            except BaseException as e:  # noqa: BLE001 -- --debug re-raises: its last line counts
                code = getattr(e, "code", 1) or 1
                print(f"{type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        print(json.dumps({"family": family, "code": code, "stdout": out.getvalue()[-4000:],
                          "stderr": err.getvalue()[-4000:]}), flush=True)


def verify_all(fams: list[str], env: dict, since: dict, version: str) -> dict:
    """{family: (ok, detail)}: detail is the max relative error of a pass, the error's first
    line of a failure; a family ``version`` predates (``since``) must be refused in one line
    naming that release (ok, detail ``refused: ...``), and anything else there fails."""
    refuse = {f: key(version) < key(since[f]) for f in fams}  # refusals: the user's one line
    todo = [f"{f}:{0 if refuse[f] else 1}" for f in fams]
    proc = subprocess.run([sys.executable, __file__, "--worker", *todo], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    done = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"family"' in line:
            r = json.loads(line)
            done[r["family"]] = r
    results = {}
    for f in fams:
        r = done.get(f)
        if r is None:
            results[f] = (False, first_line(proc.stderr or proc.stdout))
        elif refuse[f]:
            lines = [ln for ln in r["stderr"].splitlines() if "error:" in ln]
            ok = r["code"] != 0 and len(lines) == 1 and f"needs transformers >= {since[f]}" in lines[0]
            results[f] = (ok, REFUSED + lines[0].split("error: ", 1)[1] if ok else
                          "not refused as expected: " + first_line(r["stderr"] or r["stdout"]))
        else:
            last = r["stdout"].strip().splitlines()[-1] if r["stdout"].strip() else ""
            try:
                report = json.loads(last)
            except json.JSONDecodeError:
                results[f] = (False, first_line(r["stderr"] or r["stdout"]))
                continue
            ok = r["code"] == 0 and bool(report.get("passed"))
            results[f] = (ok, f"{report.get('max_rel_err', float('nan')):.1e}" if ok
                          else first_line(r["stderr"] or last))
    return results


def hybrid_tests(env: dict, since: str, version: str) -> tuple[bool, str]:
    if key(version) < key(since):
        return True, f"{REFUSED}the hybrids need transformers >= {since}"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *HYBRID_TESTS], capture_output=True, text=True, env=env, cwd=ROOT)
    summary = first_line(out.stdout.splitlines()[-1] if out.stdout.strip() else out.stderr)
    return out.returncode == 0, summary


def load() -> str:
    """The machine's 1-minute load average now (a row's time means little without it)."""
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def run_record(started, rows: dict, runs: dict) -> dict:
    """The --json object: the rows so far and, per version, its seconds, the load average at
    its start and end and what went in beside it; printed after every version, so a run
    stopped half-way still leaves every finished row on its last JSON line."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    torch_v = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    return {"date": started.strftime("%Y-%m-%d"), "started": started.isoformat(), "commit": commit,
            "torch": torch_v, "python": sys.version.split()[0], "versions": list(rows),
            "passing": [v for v, r in rows.items() if all(ok for ok, _ in r.values())],
            "results": {v: {c: {"passed": ok, "detail": d} for c, (ok, d) in r.items()}
                        for v, r in rows.items()}, "runs": runs}


def read_runs(files: list[str], script: str) -> list[dict]:
    """The last --json line of each file (one run's log), oldest run first; a file without
    one (a run that finished no row) is refused in one line."""
    runs = []
    for f in files:
        lines = [ln for ln in Path(f).read_text().splitlines()
                 if ln.startswith("{") and '"results"' in ln]
        if not lines:
            raise SystemExit(f"{script}: {f} holds no --json line (a run that finished no row?)")
        runs.append(json.loads(lines[-1]))
    return sorted(runs, key=lambda r: r.get("started", ""))


def merged_rows(runs: list[dict]) -> tuple[dict, dict]:
    """{version: {column: (passed, detail)}} and {version: run facts} over several runs; a
    version measured twice keeps its later run (a re-run after a fix)."""
    rows, facts = {}, {}
    for r in runs:
        for v, cols in r["results"].items():
            rows[v] = {c: (x["passed"], x["detail"]) for c, x in cols.items()}
            facts[v] = dict(r.get("runs", {}).get(v, {}), commit=r.get("commit", "?"),
                            date=r.get("date", "?"), torch=r.get("torch", "?"))
    return rows, facts


def row_notes(facts: dict) -> list[str]:
    """One line per version: when, at which commit, how long, under what load."""
    out = []
    for v in sorted(facts, key=key):
        f = facts[v]
        load_s = "-".join(f.get("load", [])) or "?"
        out.append(f"- {v}: {f.get('date')} at {f.get('commit')}, {f.get('seconds', '?')} s, "
                   f"load average {load_s}" + (f"; beside it: {', '.join(f['deps'])}"
                                                if f.get("deps") else ""))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("versions", nargs="*", help="transformers versions (default: every minor of "
                    "the supported range and the newest release)")
    ap.add_argument("--work", default="/tmp/dta-upstream", help="where the versions are installed")
    ap.add_argument("--families", default="", help="comma-separated (default: every family)")
    ap.add_argument("--markdown", default="", help="also write the table to this file")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line "
                    "(printed after every version: a stopped run keeps its finished rows)")
    ap.add_argument("--merge", nargs="+", default=[], metavar="LOG",
                    help="only render one table from earlier runs' --json lines (logs)")
    args = ap.parse_args(argv)
    if args.merge:
        rows, facts = merged_rows(read_runs(args.merge, "check_upstream"))
        columns = list(dict.fromkeys(c for r in rows.values() for c in r))
        torches = sorted({f["torch"] for f in facts.values()})
        table = render(rows, columns, None, {}, ", ".join(torches), row_notes(facts))
        print(table)
        if args.markdown:
            Path(args.markdown).write_text(table)
        return 0 if all(ok for r in rows.values() for ok, _ in r.values()) else 1
    versions = args.versions or default_versions()
    since = families()
    fams = args.families.split(",") if args.families else list(since)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    rows: dict[str, dict[str, tuple[bool, str]]] = {}
    deps: dict[str, list[str]] = {}
    runs: dict[str, dict] = {}
    for v in versions:
        t0, load0 = time.time(), load()
        try:
            target, extra = install(v, work)
        except subprocess.CalledProcessError as e:
            rows[v] = {f: (False, f"pip install failed ({e.returncode})") for f in fams}
            runs[v] = {"seconds": round(time.time() - t0), "load": [load0, load()]}
            continue
        if extra:
            print(f"{v}: beside it, its own pins {', '.join(extra)}", flush=True)
            deps[v] = extra
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(target), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        row = verify_all(fams, env, since, v)
        for f in fams:
            label = "FAIL" if not row[f][0] else "" if row[f][1].startswith(REFUSED) else "pass"
            print(f"{v} {f}: {label} {row[f][1]}".replace(": ", ": ", 1), flush=True)
        row["hybrid tests"] = hybrid_tests(env, max(since.values(), key=key), v)  # the hybrids
        print(f"{v} hybrid tests: {'pass' if row['hybrid tests'][0] else 'FAIL'} "
              f"{row['hybrid tests'][1]} ({time.time() - t0:.0f} s)", flush=True)
        rows[v] = row
        runs[v] = {"seconds": round(time.time() - t0), "load": [load0, load()], "deps": extra}
        if args.markdown:  # after every version: a long run's table so far
            Path(args.markdown).write_text(render(rows, fams + ["hybrid tests"], started, deps))
        if args.json:  # after every version too: a stopped run keeps its finished rows
            print(json.dumps(run_record(started, rows, runs)), flush=True)
    table = render(rows, fams + ["hybrid tests"], started, deps)
    print(table)
    if args.json:
        print(json.dumps(run_record(started, rows, runs)))
    return 0 if all(all(ok for ok, _ in rows[v].values()) for v in versions) else 1


def render(rows: dict, columns: list[str], started, deps: dict, torch_v: str = "",
           notes: list[str] | None = None) -> str:
    """A markdown table: versions down, families across; failures listed below it (``started``
    None: merged from several runs, whose ``notes`` say when each row ran)."""
    torch_v = torch_v or subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True, text=True).stdout.strip()
    when = "merged runs" if started is None else f"{started:%Y-%m-%d %H:%M} UTC"
    head = [f"# transformers releases against DTA's support matrix ({when})",
            "", f"`scripts/check-upstream.sh` on torch {torch_v}, Python "
            f"{sys.version.split()[0]}: `dta verify --family F --dtype float64 --json` per family "
            f"(pass = max relative error <= 1e-10, shown; refused = the release predates the family "
            f"and `dta verify` refuses it in one line naming the release that brings it) and "
            f"`pytest {' '.join(HYBRID_TESTS)}`.", "",
            "| transformers | " + " | ".join(columns) + " |",
            "|---|" + "---|" * len(columns)]
    fails = []
    for v, row in sorted(rows.items(), key=lambda kv: key(kv[0])):
        cells, why = [], {}
        for c in columns:
            ok, detail = row.get(c, (False, "not run"))
            cells.append(("refused" if detail.startswith(REFUSED) else
                          f"pass {detail}" if re.fullmatch(r"[0-9.e+-]+", detail) else "pass")
                         if ok else "**FAIL**")
            if not ok:
                why.setdefault(detail, []).append(c)
        head.append(f"| {v} | " + " | ".join(cells) + " |")
        for detail, cols in why.items():  # one line per distinct error
            who = "every column" if len(cols) == len(columns) else ", ".join(cols)
            fails.append(f"- {v} ({who}): {detail}")
    notes = notes if notes is not None else [
        f"- {v} ran beside its own pins: {', '.join(d)} (installed with it)"
        for v, d in deps.items()]
    return "\n".join(head + ([""] + notes if notes else [])
                     + (["", "Failures (first error line):", ""] + fails if fails else [])) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""DTA inside its hosts' own environments: AReaL, verl, SGLang and vLLM as their users have them.

For each host a fresh virtual environment (``--venvs``/host-NAME, outside the repository) gets
the host first, with its dependencies, as its users install it (``pip install areal==1.0.4``).
Where one of them cannot be installed on this machine (a CUDA-only build, no wheel), it is
named, the host goes in with ``--no-deps`` and its requirements, read from its own package
metadata, go in without that one. The host's resolved versions are frozen into a constraints
file, then DTA goes in from this checkout (``pip install -e '.[ray,dev,lora]' -c freeze``) and
the script checks that no version of the freeze moved and that ``pip check`` is clean for
DTA's requirements. Then, in that environment: ``dta train`` (the embedded default, 1 step),
``dta verify --dtype float64`` on every family of the support matrix that the host's
transformers has, and the host door's tests (AReaL: tests/test_areal*.py, verl:
tests/test_verl*.py). It prints a table host x check; ``--markdown FILE``, ``--json``.

    bash scripts/check-hosts.sh                      # all four hosts
    bash scripts/check-hosts.sh verl --keep          # one host, keep its venv
    bash scripts/check-hosts.sh --markdown out.md --json

pip runs with PIP_CONSTRAINT= and PIP_CONFIG_FILE=/dev/null so that only the host's pins apply. A host's venv is
deleted after its checks unless --keep; with --reuse an existing one (and the freeze it saved)
is used again. docs/versions.md has the table and how it was made.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_env import (  # noqa: E402
    NOT_HOST_PINS,
    ROOT,
    Env,
    Host,
    canon,
    dta_check_problems,
    first_error,
    install_host,
    moved_pins,
    pins_of,
)

DTA_EXTRAS = "ray,dev,lora"
HOSTS = {
    "areal": Host("areal", "1.0.4", ("tests/test_areal*.py",),
                  "from areal.engine.fsdp_engine import FSDPEngine; import runtime.areal"),
    "verl": Host("verl", "0.9.1", ("tests/test_verl*.py",),
                 "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead; "
                 "import runtime.verl"),
    "sglang": Host("sglang", "0.5.23"),
    "vllm": Host("vllm", "0.33.0"),
}


# ---------------------------------------------------------------- DTA in the host's venv

def install_dta(env: Env, freeze: dict[str, str], constraints: Path, again: bool) -> dict:
    """DTA from this checkout, constrained to the host's freeze; then the pins and pip check
    (against the freeze saved before DTA went in). ``again=False`` where a --reuse finds DTA
    installed already (a second run on the venv: checks only)."""
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(freeze.items())
                                   if n not in NOT_HOST_PINS))
    rc, out = env.pip("install", "--no-cache-dir", "-e", f"{ROOT}[{DTA_EXTRAS}]",
                      "-c", str(constraints)) if again else (0, "")
    if rc:
        why = "ResolutionImpossible: " if "ResolutionImpossible" in out else ""
        conflict = [ln.strip() for ln in out.splitlines()
                    if "requested" in ln or "depends on" in ln or "The user requested" in ln]
        return {"ok": False, "error": why + ("; ".join(conflict[:4]) or first_error(out))[:400]}
    after = env.freeze()
    brought = set(after) - set(freeze)
    moved = moved_pins(freeze, after)
    _, out = env.pip("check")
    problems = dta_check_problems(out.strip().splitlines(), brought | {"dta"})
    host_unmet = [ln for ln in out.strip().splitlines() if ln not in problems
                  and not ln.startswith("No broken")]
    return {"ok": True, "moved": moved, "brought": sorted(brought - {"dta"}),
            "pip_check": problems, "host_unmet": host_unmet}


def families(env: Env) -> tuple[list[str], list[str], str]:
    """(families the venv's transformers has, those it lacks, its version)."""
    code = ("import json, transformers; from dta.model.families import FAMILIES; "
            "print(json.dumps([transformers.__version__, "
            "{f: hasattr(transformers, v.config_class) for f, v in FAMILIES.items()}]))")
    rc, out = env.py(code)
    if rc:
        raise RuntimeError(f"cannot list the families: {first_error(out)}")
    version, have = json.loads(out.strip().splitlines()[-1])
    return [f for f, ok in have.items() if ok], [f for f, ok in have.items() if not ok], version


def verify(env: Env, family: str) -> tuple[bool, str]:
    rc, out = env.run([str(env.path / "bin" / "dta"), "verify", "--family", family,
                       "--dtype", "float64", "--json"], timeout=1200)
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                rep = json.loads(line)
            except json.JSONDecodeError:
                break
            ok = rc == 0 and bool(rep.get("passed"))
            return ok, f"{rep.get('max_rel_err', float('nan')):.1e}" if ok else first_error(out)
    return False, first_error(out)


def train(env: Env) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="dta-host-train-") as cwd:
        rc, out = env.run([str(env.path / "bin" / "dta"), "train", "train.steps=1"], cwd=cwd,
                          timeout=1800)
    return rc == 0, ("1 step" if rc == 0 else first_error(out))


def door_tests(env: Env, host: Host) -> tuple[bool, str]:
    """The door's test files under pytest; an import the door needs failing is a failure
    (the files would otherwise skip themselves)."""
    rc, out = env.py(host.door)
    if rc:
        return False, f"import failed: {first_error(out)}"
    files = sorted(f for g in host.tests for f in glob.glob(str(ROOT / g)))
    rc, out = env.run([env.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                       *[os.path.relpath(f, ROOT) for f in files]], timeout=5400)
    summary = [ln for ln in out.strip().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    line = summary[-1].strip("= ") if summary else first_error(out)
    return rc == 0, f"{len(files)} files: {line}" if rc == 0 else f"{line}; {first_error(out)}"


def adopt(env: Env, host: Host, state: Path) -> None:
    """--reuse of a venv into which ``pip install HOST==V`` alone went (no DTA yet)."""
    have = env.freeze()
    if have.get(canon(host.name)) == host.version and "dta" not in have:
        state.write_text(json.dumps({"install": {"ok": True, "not_installable": {},
                                                 "how": f"pip install {host.name}=={host.version}"},
                                     "freeze": have, "requirements": env.requirements(host.name)}))


def check_host(host: Host, venvs: Path, keep: bool, reuse: bool, skip: list[str],
               only_verify: list[str], runs=("train", "verify", "door")) -> dict:
    t0 = time.time()
    path = venvs / f"host-{host.name}"
    state = path / "dta-check-hosts.json"  # the host's install, saved for --reuse
    path.parent.mkdir(parents=True, exist_ok=True)
    res = {"host": host.name, "version": host.version, "checks": {}}
    checks = res["checks"]
    if reuse and not state.exists() and (path / "bin" / "python").exists():
        adopt(Env(path, path / "check-hosts.log"), host, state)
    if reuse and state.exists():
        saved = json.loads(state.read_text())
        print(f"{host.name}: reusing {path}", flush=True)
    else:
        if path.exists():
            shutil.rmtree(path)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        env = Env(path, path / "check-hosts.log")
        print(f"{host.name}: installing {host.name}=={host.version} into {path}", flush=True)
        hi = install_host(env, host, skip)
        saved = {"install": hi, "freeze": env.freeze() if hi["ok"] else {}}
        if hi["ok"]:
            saved["requirements"] = env.requirements(host.name)
        state.write_text(json.dumps(saved, indent=1))
    env = Env(path, path / "check-hosts.log")
    hi, freeze = saved["install"], saved["freeze"]
    res["not_installable"] = hi["not_installable"]
    res["host_install"] = hi["how"]
    res["pins"] = pins_of(saved.get("requirements", []))
    res["resolved"] = {n: freeze.get(n) for n in ("torch", "transformers", "peft", "ray")}
    checks["host install"] = (hi["ok"], hi.get("error") or (
        "with its dependencies" if not hi["not_installable"] else
        "without " + ", ".join(f"{n} ({why})" for n, why in hi["not_installable"].items())))
    if not hi["ok"]:
        return finish(res, path, keep, t0)
    again = "dta" not in env.freeze()
    print(f"{host.name}: {'installing DTA -c' if again else 'DTA installed already; checking'} "
          f"{path / 'host-freeze.txt'}", flush=True)
    di = install_dta(env, freeze, path / "host-freeze.txt", again)
    checks["DTA install"] = (di["ok"], di.get("error") or (
        "brought " + (", ".join(di["brought"]) or "nothing")))
    if not di["ok"]:
        return finish(res, path, keep, t0)
    res["host_unmet"] = di["host_unmet"]
    checks["pins kept"] = (not di["moved"], "; ".join(di["moved"]) or f"{len(freeze)} unchanged")
    checks["pip check (DTA)"] = (not di["pip_check"], "; ".join(di["pip_check"]) or "clean")
    have, lacks, tv = families(env)
    res["transformers"], res["families_absent"] = tv, lacks
    if "train" in runs:
        print(f"{host.name}: dta train", flush=True)
        checks["dta train"] = train(env)
    fam = {}
    for f in have if "verify" in runs else []:
        if only_verify and f not in only_verify:
            continue
        fam[f] = verify(env, f)
        print(f"{host.name}: verify {f}: {'pass' if fam[f][0] else 'FAIL'} {fam[f][1]}", flush=True)
    res["verify"] = {f: {"passed": ok, "detail": d} for f, (ok, d) in fam.items()}
    bad = [f for f, (ok, _) in fam.items() if not ok]
    errs = [float(d) for ok, d in fam.values() if ok]
    if fam:
        checks["dta verify float64"] = (not bad, (
            f"{len(fam) - len(bad)}/{len(fam)} families"
            + (f" (max {max(errs):.1e})" if errs else "")
            + (f"; FAIL {', '.join(bad)}: {fam[bad[0]][1]}" if bad else "")
            + (f"; absent in transformers {tv}: {', '.join(lacks)}" if lacks else "")))
    if "door" in runs and host.tests:
        print(f"{host.name}: the door's tests", flush=True)
        checks["door tests"] = door_tests(env, host)
    return finish(res, path, keep, t0)


def finish(res: dict, path: Path, keep: bool, t0: float) -> dict:
    res["checks"] = {k: {"passed": ok, "detail": d} for k, (ok, d) in res["checks"].items()}
    res["seconds"] = round(time.time() - t0)
    if not keep and path.exists():
        shutil.rmtree(path)
    print(f"{res['host']}: done in {res['seconds']} s", flush=True)
    return res


CHECKS = ["host install", "DTA install", "pins kept", "pip check (DTA)", "dta train",
          "dta verify float64", "door tests"]


def render(results: list[dict], started, commit: str) -> str:
    head = [f"`scripts/check-hosts.sh` on {started:%Y-%m-%d %H:%M} UTC (checkout {commit}, "
            f"Python {sys.version.split()[0]}, CPU):", "",
            "| host | its pins (metadata) | resolved torch / transformers | "
            + " | ".join(CHECKS) + " |", "|---|---|---|" + "---|" * len(CHECKS)]
    notes = []
    for r in results:
        pins = "; ".join(f"{k} {v}" for k, v in r.get("pins", {}).items()) or "–"
        got = r.get("resolved", {})
        cells = []
        for c in CHECKS:
            if c not in r["checks"]:
                cells.append("–" if c == "door tests" and c not in r["checks"] else "not run")
                continue
            ok, d = r["checks"][c]["passed"], r["checks"][c]["detail"]
            cells.append("pass" if ok else "**FAIL**")
            notes.append(f"- {r['host']} {r['version']}, {c}: {'pass' if ok else 'FAIL'} — {d}")
        for n, why in r.get("not_installable", {}).items():
            cells[0] = "pass, without " + ", ".join(r["not_installable"])
            notes.append(f"- {r['host']}: **not installable here**: {n} ({why})")
        head.append(f"| {r['host']} {r['version']} | {pins} | {got.get('torch')} / "
                    f"{got.get('transformers')} | " + " | ".join(cells) + " |")
    return "\n".join(head + ["", *notes]) + "\n"


def merge(files: list[str], markdown: str) -> int:
    """One table from the JSON lines of several runs (e.g. one host each, in parallel)."""
    runs = []
    for f in files:
        lines = [ln for ln in Path(f).read_text().splitlines() if ln.startswith("{")]
        if not lines:
            raise SystemExit(f"check_hosts: {f} holds no --json line (a run not finished?)")
        runs.append(json.loads(lines[-1]))
    results: dict[str, dict] = {}
    for h in (h for r in runs for h in r["hosts"]):  # one host's checks may come from two runs
        if h["host"] in results:
            results[h["host"]]["checks"].update(h["checks"])
            results[h["host"]].setdefault("verify", {}).update(h.get("verify", {}))
        else:
            results[h["host"]] = h
    results = [results[n] for n in HOSTS if n in results]
    started = min(datetime.datetime.fromisoformat(r["started"]) for r in runs)
    table = render(results, started, ", ".join(sorted({r["commit"] for r in runs})))
    print(table)
    if markdown:
        Path(markdown).write_text(table)
    return 0 if all(c["passed"] for r in results for c in r["checks"].values()) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("hosts", nargs="*", help=f"which hosts (default: {' '.join(HOSTS)})")
    ap.add_argument("--venvs", default="/work/venvs", help="where host-NAME venvs are built")
    ap.add_argument("--keep", action="store_true", help="keep each host's venv")
    ap.add_argument("--reuse", action="store_true", help="reuse a venv this script built")
    ap.add_argument("--skip", action="append", default=[], metavar="PKG",
                    help="a dependency not to install (the host goes in --no-deps without it)")
    ap.add_argument("--checks", default="train,verify,door",
                    help="which of train, verify, door to run after the installs")
    ap.add_argument("--families", default="", help="comma-separated (default: every family)")
    ap.add_argument("--markdown", default="", help="also write the table to this file")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                    help="only render the table of earlier --json outputs (one run per host)")
    args = ap.parse_args(argv)
    unknown = [h for h in args.hosts if h not in HOSTS]
    if unknown:
        raise SystemExit(f"check_hosts: unknown host {unknown[0]!r} (one of {', '.join(HOSTS)})")
    if args.merge:
        return merge(args.merge, args.markdown)
    venvs = Path(args.venvs).resolve()
    if venvs == ROOT or ROOT in venvs.parents:
        raise SystemExit(f"check_hosts: --venvs {venvs} is inside the checkout; use a folder outside")
    started = datetime.datetime.now(datetime.timezone.utc)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip() or "unknown"
    results = [check_host(HOSTS[h], venvs, args.keep, args.reuse, args.skip,
                          [f for f in args.families.split(",") if f],
                          tuple(args.checks.split(",")))
               for h in (args.hosts or list(HOSTS))]
    table = render(results, started, commit)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        print(json.dumps({"date": f"{started:%Y-%m-%d}", "started": started.isoformat(),
                          "commit": commit, "hosts": results}))
    return 0 if all(c["passed"] for r in results for c in r["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

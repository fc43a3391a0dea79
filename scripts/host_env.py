"""A host's virtual environment for scripts/check_hosts.py: the host installed as its users do,
its requirements read from its own package metadata, and the pure checks on pip's outputs
(which pin moved, which ``pip check`` line is DTA's, which package stopped an install).
Standard library only (``packaging`` from the venv, or pip's own copy), so that a host's venv
can import it too; tests/test_check_hosts.py tests it offline.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_HOST_PINS = {"pip", "setuptools", "wheel", "dta"}  # the venv's tools, and DTA itself


@dataclass(frozen=True)
class Host:
    name: str  # the PyPI name
    version: str
    tests: tuple = ()  # the door's tests (globs under the checkout)
    door: str = ""  # the import that the door's tests need


# ---------------------------------------------------------------- pure logic (tested offline)

def canon(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare venv: pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def requirements_of(dist) -> list[str]:
    """The requirements a plain ``pip install NAME`` installs, from the distribution's own
    metadata (markers evaluated here, extras left out), as ``name[extras]specifier``."""
    Requirement = _requirement_class()
    out = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        out.append(f"{req.name}{extras}{req.specifier}")
    return out


def pins_of(requirements: list[str], names=("torch", "transformers")) -> dict[str, str]:
    """``{name: specifier}`` for the named packages among ``requirements`` ("any": unpinned)."""
    Requirement = _requirement_class()
    pins = {}
    for line in requirements:
        req = Requirement(line)
        if canon(req.name) in names:
            pins[canon(req.name)] = str(req.specifier) or "any"
    return pins


def moved_pins(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Every package of the host's freeze whose version changed or that is gone."""
    after = {canon(k): v for k, v in after.items()}
    moved = []
    for name, version in sorted((canon(k), v) for k, v in before.items()):
        if name in NOT_HOST_PINS:
            continue
        now = after.get(name)
        if now != version:
            moved.append(f"{name} {version} -> {now or 'removed'}")
    return moved


def dta_check_problems(lines: list[str], dta_side: set[str]) -> list[str]:
    """The lines of ``pip check`` about a requirement of DTA or of a package DTA brought in
    (``dta_side``); the host's own unmet requirements (what could not be installed) are not."""
    side = {canon(n) for n in dta_side}
    return [ln for ln in lines if ln.split() and canon(ln.split()[0]) in side]


_CULPRIT = [  # pip's messages that name the one package it could not install
    (re.compile(r"Failed to build ([A-Za-z0-9_.\-]+)"), "its build failed"),
    (re.compile(r"Failed building wheel for ([A-Za-z0-9_.\-]+)"), "its build failed"),
    (re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+)"),
     "no distribution for this platform/Python"),
]


def culprit(output: str) -> tuple[str, str] | None:
    """(package, reason) of the one package that stopped a ``pip install``, or None where the
    failure is not one package's (a resolution conflict, the network)."""
    for pattern, reason in _CULPRIT:
        m = pattern.search(output)
        if m:
            return canon(m.group(1)), reason
    if "metadata-generation-failed" in output or "Getting requirements to build wheel did not " \
            "run successfully" in output:
        last = re.findall(r"^\s*(?:Collecting|Downloading|Processing)\s+(\S+)", output, re.M)
        if last:
            name = re.split(r"-\d|[<>=!~\[(;]", os.path.basename(last[-1]))[0]
            return canon(name), "its build needs what this machine lacks (metadata step failed)"
    return None


def first_error(output: str) -> str:
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("ERROR", "error", "RuntimeError", "ValueError",
                                                   "ImportError", "ModuleNotFoundError"))
              or "Error:" in ln or "FAILED" in ln or "refused" in ln]
    return (errors[0] if errors else lines[-1] if lines else "no output")[:200]


# ---------------------------------------------------------------- the venv

class Env:
    def __init__(self, path: Path, log: Path):
        self.path, self.log = path, log
        self.python = str(path / "bin" / "python")
        # only the host's pins apply: no machine-wide pip config (a global constraint, as on
        # the machine this was written on, would cap torch; PIP_CONSTRAINT= alone does not
        # lift one set in a config file)
        self.env = dict(os.environ, PIP_CONSTRAINT="", PIP_CONFIG_FILE=os.devnull,
                        PIP_DISABLE_PIP_VERSION_CHECK="1",
                        VIRTUAL_ENV=str(path), PATH=f"{path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        self.env.pop("PYTHONPATH", None)

    def run(self, args: list[str], cwd=ROOT, timeout=3600) -> tuple[int, str]:
        with open(self.log, "a") as f:
            f.write(f"\n$ {' '.join(args)}\n")
            try:
                p = subprocess.run(args, cwd=cwd, env=self.env, capture_output=True, text=True,
                                   timeout=timeout)
                rc, out = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:
                rc, out = 124, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s"
            f.write(out if isinstance(out, str) else out.decode(errors="replace"))
        return rc, out if isinstance(out, str) else out.decode(errors="replace")

    def pip(self, *args: str, timeout=3600) -> tuple[int, str]:
        return self.run([self.python, "-m", "pip", *args], timeout=timeout)

    def py(self, code: str, timeout=600) -> tuple[int, str]:
        return self.run([self.python, "-c", code], timeout=timeout)

    def freeze(self) -> dict[str, str]:
        rc, out = self.pip("list", "--format=json")
        if rc:
            raise RuntimeError(f"pip list failed: {first_error(out)}")
        return {canon(d["name"]): d["version"] for d in json.loads(out[out.index("["):])}

    def requirements(self, name: str) -> list[str]:
        code = (f"import sys, json, importlib.metadata as md; sys.path.insert(0, {str(ROOT / 'scripts')!r}); "
                f"import host_env as c; print(json.dumps(c.requirements_of(md.distribution({name!r}))))")
        rc, out = self.py(code)
        if rc:
            raise RuntimeError(f"cannot read {name}'s requirements: {first_error(out)}")
        return json.loads(out.strip().splitlines()[-1])


def install_host(env: Env, host: Host, skip: list[str]) -> dict:
    """The host as its users install it; where a dependency cannot go in here, the host
    --no-deps and its own requirements without that one (repeated for each such package)."""
    spec = f"{host.name}=={host.version}"
    not_installable = {}
    if not skip:
        rc, out = env.pip("install", "--no-cache-dir", spec)
        if rc == 0:
            return {"ok": True, "not_installable": {}, "how": f"pip install {spec}"}
        found = culprit(out)
        if found is None:
            return {"ok": False, "not_installable": {}, "how": f"pip install {spec}",
                    "error": first_error(out)}
        not_installable[found[0]] = found[1]
    for name in skip:
        not_installable.setdefault(canon(name), "named by --skip")
    rc, out = env.pip("install", "--no-cache-dir", "--no-deps", spec)
    if rc:
        return {"ok": False, "not_installable": not_installable, "error": first_error(out),
                "how": f"pip install --no-deps {spec}"}
    reqs = env.requirements(host.name)
    for _ in range(8):
        rest = [r for r in reqs if canon(re.split(r"[\[<>=!~; ]", r)[0]) not in not_installable]
        rc, out = env.pip("install", "--no-cache-dir", *rest)
        if rc == 0:
            break
        found = culprit(out)
        if found is None or found[0] in not_installable:
            return {"ok": False, "not_installable": not_installable, "error": first_error(out),
                    "how": "its requirements"}
        not_installable[found[0]] = found[1]
    direct = {canon(re.split(r"[\[<>=!~; ]", r)[0]) for r in reqs}
    missing = sorted(n for n in not_installable if n not in direct)
    if missing:  # pulled in by a requirement: that requirement was left out with it
        return {"ok": False, "not_installable": not_installable, "how": "its requirements",
                "error": f"indirect dependencies cannot be installed: {', '.join(missing)}"}
    return {"ok": True, "not_installable": not_installable,
            "how": f"pip install --no-deps {spec}, then its requirements except "
                   f"{', '.join(sorted(not_installable))}"}



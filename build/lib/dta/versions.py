"""The tested versions of the libraries whose internals DTA touches, and the installed ones.

The tested range of each watched package is the one place it is stated: ``pyproject.toml``'s
dependency (``transformers>=A,<=B``: the upper bound is the newest release
``scripts/check-upstream.sh`` passed), read back from the installed package's metadata. The
exact set CI tested is ``constraints.txt`` (``scripts/setup.sh`` installs it). docs/versions.md
says how both are kept.

``dta`` commands print one warning line when an installed watched package is outside its
range (:func:`untested`); the walker's self-check names the installed versions when it
refuses a model (:func:`describe`).
"""
from __future__ import annotations

from importlib import metadata

WATCHED = ("torch", "transformers")  # DTA reads their internals (autograd, caches, attention)


def tested_range(name: str) -> str | None:
    """The version specifier of ``name`` in DTA's own dependencies (None: not stated, or DTA
    is not installed as a package)."""
    from packaging.requirements import Requirement

    try:
        requires = metadata.requires("dta") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == name and req.marker is None:
            return str(req.specifier) or None
    return None


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def untested() -> list[str]:
    """One line per watched package installed outside its tested range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    lines = []
    for name in WATCHED:
        spec, have = tested_range(name), installed(name)
        if spec and have and not SpecifierSet(spec).contains(Version(have).public, prereleases=True):
            lines.append(f"{name} {have} is outside the range DTA was tested with ({name}{spec}); "
                         "see docs/versions.md, or re-check with scripts/check-upstream.sh")
    return lines


def describe() -> str:
    """The installed watched packages, e.g. ``torch 2.13.0, transformers 5.25.0``."""
    return ", ".join(f"{n} {installed(n) or 'not installed'}" for n in WATCHED)

"""The architecture, checked on the source: every import points down a declared layer, and no
module imports itself back through others (no cycle), lazy imports inside functions included.

Packages, bottom to top: ``dta`` (the library) < ``runtime`` < ``experiments`` < ``dta_cli``.
Inside ``dta`` and ``runtime`` the groups below are layered too: a module may import its own
group or a group of a lower layer, never a group of its own layer or above. A new module of
``dta/`` or ``runtime/`` must be given a layer here (the test refuses an unknown group)."""
from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dta", "runtime", "experiments", "dta_cli")  # bottom to top
THIRD_PARTY = {  # what a package must never import, whatever its layer
    "dta": ("ray", "areal", "verl"),
}

# Groups of dta/ and runtime/: a sub-package or a top-level module. Layer 0 is the bottom.
LAYERS = {
    # the library: metadata and records, then planning, then the model interface, then the walk
    "dta.tree": 0, "dta.records": 0, "dta.losses": 0, "dta.advantages": 0, "dta.versions": 0,
    "dta.paths": 0,
    "dta.batch": 1, "dta.planning": 1,
    "dta.importing": 2, "dta.objective": 2, "dta.options": 2,
    "dta.model": 3,
    "dta.config": 4, "dta.reference": 4, "dta.walk": 4,
    "dta.local_ranks": 5, "dta.selfcheck": 5,
    "dta.train": 6,
    "dta.verify": 7,
    "dta.fidelity": 8,
    "dta": 9,  # dta/__init__.py: the public names, re-exported lazily
    # the runtime: errors and every line of saving and resuming (checkpoint files, DCP, the
    # logical view, resharding), then sharding, then the runtimes and adapters
    "runtime.errors": 0, "runtime.checkpoints": 0,
    "runtime.sharding": 2,
    "runtime.engine": 3,  # the engine core every front door adapts to
    "runtime.ray_runtime": 4, "runtime.areal": 4, "runtime.verl": 4,
    "runtime": 5,
}


def _modules() -> dict[str, str]:
    mods = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    mods[mod.removesuffix(".__init__")] = path
    return mods


MODULES = _modules()


def imported_modules(path: str):
    """(line, module) of every absolute import in the file, at any depth (lazy ones too);
    ``from a import b`` yields ``a.b`` when that is a module of the project, else ``a``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield node.lineno, sub if sub in MODULES else node.module


def _project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def group(mod: str) -> str:
    """A module's group: ``dta.model`` for ``dta.model.head``, ``dta.walk`` for itself."""
    parts = mod.split(".")
    if parts[0] not in ("dta", "runtime"):
        return parts[0]
    return ".".join(parts[:2])


def edges() -> dict[str, set[tuple[int, str]]]:
    out: dict[str, set[tuple[int, str]]] = {}
    for mod, path in MODULES.items():
        found = out.setdefault(mod, set())
        for line, name in imported_modules(path):
            target = _project_module(name)
            if target is not None and target != mod:
                found.add((line, target))
    return out


def layer_violations() -> list[str]:
    out = []
    for mod, targets in edges().items():
        src = os.path.relpath(MODULES[mod], ROOT)
        for line, target in sorted(targets):
            top, other = mod.split(".")[0], target.split(".")[0]
            if PACKAGES.index(other) > PACKAGES.index(top):
                out.append(f"{src}:{line} imports {target} (package {other} is above {top})")
                continue
            if top != other or top not in ("dta", "runtime"):
                continue
            g, h = group(mod), group(target)
            if g == h:
                continue
            if g not in LAYERS or h not in LAYERS:
                out.append(f"{src}:{line}: group {g if g not in LAYERS else h} has no layer in "
                           "tests/test_layers.py")
            elif LAYERS[h] >= LAYERS[g]:
                out.append(f"{src}:{line} imports {target} (layer {LAYERS[h]} >= {g}'s "
                           f"layer {LAYERS[g]})")
    return out


def third_party_violations() -> list[str]:
    out = []
    for mod, path in MODULES.items():
        for line, name in imported_modules(path):
            if name.split(".")[0] in THIRD_PARTY.get(mod.split(".")[0], ()):
                out.append(f"{os.path.relpath(path, ROOT)}:{line} imports {name}")
    return sorted(set(out))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_imports_point_down_the_layers():
    assert layer_violations() == []


def test_the_library_imports_no_framework():
    assert third_party_violations() == []


def test_no_module_cycle():
    graph = {m: {t for _, t in ts} for m, ts in edges().items()}
    assert cycles(graph) == []


def test_every_group_has_a_layer():
    groups = {group(m) for m in MODULES if m.split(".")[0] in ("dta", "runtime")}
    assert sorted(g for g in groups if g not in LAYERS) == []


def test_no_runtime_storage_module_imports_the_ray_runtime():
    """The issue's rule, spelled out: checkpoint storage, DCP, sharding and the framework
    adapters build on runtime/checkpoints, never on runtime/ray_runtime."""
    bad = [f"{m} -> {t}" for m, ts in edges().items() for _, t in ts
           if t.startswith("runtime.ray_runtime") and not m.startswith("runtime.ray_runtime")
           and m.split(".")[0] == "runtime"]
    assert bad == []


def test_dta_keeps_a_short_top_level():
    top = [n for n in os.listdir(os.path.join(ROOT, "dta")) if n.endswith(".py")]
    assert len(top) <= 16, sorted(top)


# ---------------------------------------------------------------- the check itself can fail --
def test_the_checks_see_violations(tmp_path, monkeypatch):
    bad = tmp_path / "x.py"
    bad.write_text("import os\ndef f():\n    from experiments.workloads import make_workload\n")
    assert (3, "experiments.workloads") in list(imported_modules(str(bad)))
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # a planning module importing the model interface is an upward import
    fake = dict(MODULES)
    fake["dta.planning.fake"] = str(tmp_path / "fake.py")
    (tmp_path / "fake.py").write_text("from dta.model.head import logits_rows\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", fake)
    found = layer_violations()
    assert any("imports dta.model.head (layer 3 >= dta.planning's layer 1)" in v
               for v in found), found


@pytest.mark.parametrize("rule", ["dta->runtime", "runtime->dta_cli", "experiments->dta_cli"])
def test_a_package_importing_upward_is_refused(rule, tmp_path, monkeypatch):
    low, high = rule.split("->")
    fake = dict(MODULES)
    path = tmp_path / "up.py"
    target = next(m for m in MODULES if m.split(".")[0] == high)
    path.write_text(f"import {target}\n")
    fake[f"{low}.up_fake"] = str(path)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", fake)
    found = layer_violations()
    assert any(f"imports {target}" in v for v in found), found

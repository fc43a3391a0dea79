"""The sharding modes are compositions of parts (issue 53's done-when: no expert / offload branch
repeated across modes). Read from the sources, as tests/test_layers.py reads the imports: in
the modules that register a mode (``@register``: runtime/sharding/replicate.py, zero1.py,
zero2.py, fsdp.py and any new one), the expert and offload decisions are the parts'
(runtime/sharding/parts.py: ``offloaded``, ``split_experts``, ``expert_flat_parts``):

- no mode reads ``layout.offload`` or calls ``ExpertPart.of`` / ``.split`` on the experts
  itself (parts.py decides it once for every mode);
- no condition about experts or offload (an ``if``, a conditional expression, a
  comprehension's ``if``) is written in two mode modules (``self.`` aside): a choice two modes
  share is a part's, written once.
"""
from __future__ import annotations

import ast
import pathlib

SHARDING = pathlib.Path(__file__).resolve().parents[1] / "runtime" / "sharding"
WORDS = ("expert", "offload")


def mode_modules() -> dict[str, ast.Module]:
    """The modules that register a sharding mode, parsed."""
    out = {}
    for path in sorted(SHARDING.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register"
                    for d in node.decorator_list):
                out[path.name] = tree
                break
    return out


def outside_parts(tree: ast.Module):
    """Every node of a module but those inside a part's class (a ``...Part`` subclass: its
    branches are that part's own choice)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and any(
                    ast.unparse(b).endswith("Part") for b in child.bases):
                continue
            todo.append(child)


def conditions(tree: ast.Module) -> list[str]:
    """The expert / offload conditions of a module outside its parts' classes, normalized
    (``self.`` dropped)."""
    tests = []
    for node in outside_parts(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
    out = []
    for t in tests:
        text = ast.unparse(t).replace("self.", "")
        if any(w in text.lower() for w in WORDS):
            out.append(text)
    return out


def decided_outside_parts(tree: ast.Module) -> list[str]:
    """The offload / expert decisions parts.py makes for every mode, made here instead."""
    out = []
    for node in outside_parts(tree):
        if isinstance(node, ast.Attribute) and node.attr == "offload" and \
                isinstance(node.value, ast.Name) and node.value.id == "layout":
            out.append(f"line {node.lineno}: layout.offload (parts.offloaded)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            text = ast.unparse(node.func)
            if text == "ExpertPart.of" or (node.func.attr == "split" and "expert" in text):
                out.append(f"line {node.lineno}: {text}(...) (parts.split_experts)")
    return out


def repeated_conditions(modules: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Each expert / offload condition written in more than one mode module: its modules."""
    seen: dict[str, set] = {}
    for name, tree in modules.items():
        for text in conditions(tree):
            seen.setdefault(text, set()).add(name)
    return {text: sorted(names) for text, names in seen.items() if len(names) > 1}


def test_the_modes_are_found():
    assert {"replicate.py", "zero1.py", "zero2.py", "fsdp.py"} <= set(mode_modules())


def test_no_mode_decides_offload_or_experts_itself():
    bad = {name: found for name, tree in mode_modules().items()
           if (found := decided_outside_parts(tree))}
    assert not bad, f"decided in the modes, not in runtime/sharding/parts.py: {bad}"


def test_no_expert_or_offload_condition_is_repeated_across_modes():
    repeated = repeated_conditions(mode_modules())
    assert not repeated, f"the same expert / offload branch in several modes: {repeated}"


def test_the_checks_see_a_repeated_branch():
    """The checks find what they look for: a condition written in two modules, and a mode
    reading the layout's offload itself."""
    a = "def f(experts):\n    return 1 if experts is not None else 0\n"
    b = "class M:\n    def f(self):\n        if self.experts is not None:\n            pass\n"
    in_part = "class P(FlatPart):\n    def f(self):\n        if self.experts is not None:\n" \
              "            pass\n"
    two = {"a.py": ast.parse(a), "b.py": ast.parse(b), "c.py": ast.parse(in_part)}
    assert repeated_conditions(two) == {"experts is not None": ["a.py", "b.py"]}
    own = ast.parse("x = layout is not None and layout.offload == 'optimizer'\n"
                    "e = ExpertPart.of(model, groups)\n")
    assert len(decided_outside_parts(own)) == 2

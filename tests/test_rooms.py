"""One room per job, checked on the source (issue 54), beside tests/test_layers.py's layers:

- the AReaL door is one adapter class (``runtime/areal/engine.py``: ``DTATrainEngine``, on
  AReaL's ``TrainEngine`` alone, no mixins) plus translation helpers that define functions,
  not classes;
- every line of saving and resuming lives in ``runtime/checkpoints/``: no other module of the
  runtime, the CLI or the experiments touches checkpoint storage (DCP, safetensors,
  ``torch.save`` / ``torch.load``, the room's file helpers), and the room defines its helpers
  once;
- the engine core carries no test-only method: each public member is used by a front door;
- one meaning per name: the bin packing of trees is ``dta.planning.binpack``, not "packing".
"""
from __future__ import annotations

import ast
import os

from tests.test_layers import MODULES, ROOT, imported_modules

AREAL = os.path.join(ROOT, "runtime", "areal")
HELPERS = ("parallel", "translate", "walks", "checkpoint", "rollout", "convert", "config",
           "optimizer")
STORAGE_IMPORTS = ("torch.distributed.checkpoint", "safetensors")
STORAGE_CALLS = {"save", "load", "save_tensors", "load_tensors", "write_manifest", "publish",
                 "load_file", "save_file"}
HELPER_DEFS = ("step_name", "read_meta", "latest_checkpoint")


def _tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def _classes(path: str) -> list[ast.ClassDef]:
    return [n for n in ast.walk(_tree(path)) if isinstance(n, ast.ClassDef)]


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in cls.bases]


def test_the_areal_door_is_one_adapter_class():
    adapters, mixins = [], []
    for name in sorted(os.listdir(AREAL)):
        if not name.endswith(".py"):
            continue
        for cls in _classes(os.path.join(AREAL, name)):
            if "TrainEngine" in _base_names(cls):
                adapters.append((name, cls.name, _base_names(cls)))
            if cls.name.endswith("Mixin"):
                mixins.append(f"{name}: {cls.name}")
    assert adapters == [("engine.py", "DTATrainEngine", ["TrainEngine"])]
    assert mixins == []
    helpers = {h: [c.name for c in _classes(os.path.join(AREAL, f"{h}.py"))] for h in HELPERS}
    assert helpers == {h: [] for h in HELPERS}  # translations are functions
    assert not os.path.exists(os.path.join(AREAL, "offload.py"))  # Sharding.to moves state


def _outside_the_room() -> dict[str, str]:
    return {m: p for m, p in MODULES.items()
            if m.split(".")[0] in ("runtime", "dta_cli", "experiments")
            and not m.startswith("runtime.checkpoints")}


def test_checkpoint_storage_lives_in_the_checkpoint_room():
    found = []
    for mod, path in sorted(_outside_the_room().items()):
        for line, name in imported_modules(path):
            if name.startswith(STORAGE_IMPORTS):
                found.append(f"{mod}:{line} imports {name}")
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                owner = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
                if name in STORAGE_CALLS and (owner == "torch" or name not in ("save", "load")):
                    found.append(f"{mod}:{node.lineno} calls {ast.unparse(f)}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "runtime.checkpoints") and any(a.name in STORAGE_CALLS for a in node.names):
                found.append(f"{mod}:{node.lineno} imports the room's file helpers")
        top = [n.name for n in _tree(path).body if isinstance(n, ast.FunctionDef)]
        found += [f"{mod} defines {d}" for d in HELPER_DEFS if d in top]
    assert found == []


def test_the_checkpoint_room_defines_its_helpers_once():
    room = {m: p for m, p in MODULES.items() if m.startswith("runtime.checkpoints")}
    home = {"step_name": "files", "read_meta": "files", "publish": "files",  # below DCP's
            "latest_checkpoint": "checkpoint", "prune": "checkpoint"}
    for helper, module in home.items():
        where = [m for m, p in room.items()
                 if helper in [n.name for n in _tree(p).body if isinstance(n, ast.FunctionDef)]]
        assert where == [f"runtime.checkpoints.{module}"], helper
    for gone in ("runtime.dcp", "runtime.sharding.logical", "runtime.sharding.reshard",
                 "runtime.sharding.state", "runtime.engine.checkpoint"):
        assert gone not in MODULES


def test_the_engine_core_has_no_test_only_member():
    core = MODULES["runtime.engine.core"]
    cls = next(c for c in _classes(core) if c.name == "EngineCore")
    public = [n.name for n in cls.body if isinstance(n, ast.FunctionDef)
              and not n.name.startswith("_")]
    used = set()
    for mod, path in MODULES.items():
        if mod.split(".")[0] not in ("runtime", "dta_cli", "experiments"):
            continue  # the core's own steps count (self.accumulate), the tests' reads do not
        used |= {n.attr for n in ast.walk(_tree(path)) if isinstance(n, ast.Attribute)}
    assert [n for n in public if n not in used] == []


def test_one_meaning_per_name():
    assert "dta.planning.binpack" in MODULES and "dta.planning.packing" not in MODULES
    from dta.options import PACKINGS
    from dta.planning import PACKERS

    assert set(PACKERS).isdisjoint(PACKINGS)  # bin packers vs the walker's packs of nodes

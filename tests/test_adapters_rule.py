"""The front doors are adapters of the engine core (issue 40): ``runtime/areal/`` and
``runtime/verl/`` translate their framework's config and batches and call the core
(``runtime.engine``); none of them holds

- a ``torch.distributed`` collective (all_reduce, broadcast, all_gather, reduce_scatter,
  barrier, send / recv, ...): the step's are the core's, the others go through
  ``runtime.engine.comm``;
- an optimizer step (``<optimizer>.step()``, a gradient clip): the core reduces, clips, steps
  or skips (an LR scheduler's ``.step()`` is the front door's own);
- a LoRA wrapping (``get_peft_model``, ``apply_lora``, ``LoraConfig``): the core builds LoRA by
  its one rule (``runtime.engine.model``);
- a sharding-mode choice: anything of ``runtime.sharding`` (modes are reached through the
  core), a sharding mode made or looked up (``make_sharding``, ``sharding_class``, ``fully_shard``,
  ``FlatShards``), the mode names written out as a list again, or a branch on a mode's name
  (a mode's behaviour is a fact of the mode, in the core);
- a walk of its own (issue 47): an import of ``dta.objective``, ``dta.tree``, ``dta.train``
  or ``dta.model.context_parallel`` (the prefix tree, the walks, the linearization and the
  context-parallel exchange are the core's ``EngineCore.walk_sequences``; a front door only
  translates its batch and its loss).

The scan reads the source (Python's ``ast``) and lists every offender per file and line.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

from dta.planning.memory import SHARDINGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAPTERS = ("runtime/areal", "runtime/verl")
COLLECTIVES = {"all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
               "all_gather_object", "all_gather_single", "all_to_all", "all_to_all_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "broadcast_object_list", "barrier", "monitored_barrier", "send", "recv", "isend",
               "irecv", "batch_isend_irecv", "reduce", "gather", "gather_object", "scatter",
               "scatter_object_list"}
LORA = {"get_peft_model", "apply_lora", "LoraConfig", "inject_adapter_in_model"}
SHARDING = {"make_sharding", "sharding_class", "fully_shard", "FlatShards", "ShardedLayout"}
CLIPS = {"clip_grad_norm_", "clip_and_step"}
WALKS = ("dta.objective", "dta.tree", "dta.train", "dta.model.context_parallel")


def _walk_module(name: str) -> str | None:
    """The walk module ``name`` is (or is inside), else None."""
    return next((m for m in WALKS if name == m or name.startswith(m + ".")), None)


def _text(node) -> str:
    return ast.unparse(node)


def offenders(source: str) -> list[str]:
    """``"line N: what"`` for every breach of the rule in ``source`` (module doc)."""
    tree = ast.parse(source)
    dist_names = {"torch.distributed"}  # names bound to the torch.distributed module
    imported: dict[str, str] = {}  # local name -> what it is (a collective, a LoRA call...)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _walk_module(a.name):
                    out.append(f"line {node.lineno}: imports {a.name} (the walks are the "
                               "core's: EngineCore.walk_sequences)")
                if a.name == "torch.distributed" and a.asname:
                    dist_names.add(a.asname)
                if a.name.startswith("runtime.sharding"):
                    out.append(f"line {node.lineno}: imports {a.name} (a sharding mode is "
                               "the core's)")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            for a in node.names:
                walk = _walk_module(mod) or _walk_module(f"{mod}.{a.name}")
                if walk and node.level == 0:
                    out.append(f"line {node.lineno}: imports {a.name} from {mod} (the walks "
                               "are the core's: EngineCore.walk_sequences)")
                local = a.asname or a.name
                if mod == "torch" and a.name == "distributed":
                    dist_names.add(local)
                elif mod.startswith("torch.distributed") and a.name in COLLECTIVES:
                    imported[local] = f"torch.distributed collective {a.name}"
                elif a.name in LORA:
                    imported[local] = f"LoRA wrapping {a.name}"
                elif a.name in SHARDING or a.name in CLIPS:
                    imported[local] = a.name
            if mod.startswith("runtime.sharding"):
                out.append(f"line {node.lineno}: imports from {mod} (a sharding mode is the "
                           "core's)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute):
                owner = _text(f.value)
                if owner in dist_names and f.attr in COLLECTIVES:
                    out.append(f"line {node.lineno}: torch.distributed collective "
                               f"{owner}.{f.attr}()")
                elif f.attr == "step" and re.search(r"optim|(^|[._])opt$", owner.lower()) \
                        and "sched" not in owner.lower():
                    out.append(f"line {node.lineno}: optimizer step {owner}.step()")
                elif f.attr in LORA:
                    out.append(f"line {node.lineno}: LoRA wrapping {owner}.{f.attr}()")
                elif f.attr in SHARDING:
                    out.append(f"line {node.lineno}: sharding mode {owner}.{f.attr}()")
                elif f.attr in CLIPS:
                    out.append(f"line {node.lineno}: gradient clip {owner}.{f.attr}()")
            elif isinstance(f, ast.Name):
                if f.id in imported:
                    out.append(f"line {node.lineno}: {imported[f.id]}()")
                elif f.id in LORA:
                    out.append(f"line {node.lineno}: LoRA wrapping {f.id}()")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if sum(n in SHARDINGS for n in names) >= 2:
                out.append(f"line {node.lineno}: the sharding modes written out "
                           f"{_text(node)} (the one list: dta.planning.memory.SHARDINGS)")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops) and any(
                    isinstance(s, ast.Constant) and s.value in SHARDINGS for s in sides) and any(
                    re.search(r"sharding|mode", _text(s)) for s in sides
                    if not isinstance(s, ast.Constant)):  # not AReaL's backend "fsdp"
                out.append(f"line {node.lineno}: branches on a sharding mode {_text(node)}")
    return sorted(set(out), key=lambda s: int(s.split(":")[0].split()[1]))


def scan(folder: str) -> dict[str, list[str]]:
    """``{file: offenders}`` for the Python files under ``folder`` (relative to the repo)."""
    found = {}
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(base, name)
                with open(path) as f:
                    bad = offenders(f.read())
                if bad:
                    found[os.path.relpath(path, ROOT)] = bad
    return found


@pytest.mark.parametrize("folder", ADAPTERS)
def test_front_doors_are_adapters(folder):
    assert os.path.isdir(os.path.join(ROOT, folder)), folder
    found = scan(folder)
    report = "\n".join(f"{path}:\n" + "\n".join(f"    {b}" for b in bad)
                       for path, bad in found.items())
    assert not found, f"{folder} is not an adapter of the engine core:\n{report}"


def test_the_scan_finds_each_kind():
    """The scanner itself: every kind of breach is found, and what an adapter may do is not."""
    bad = offenders('''
import torch.distributed as td
from torch import distributed as tdist
from torch.distributed import broadcast as bc
from peft import get_peft_model
from runtime.sharding import make_sharding
import runtime.sharding.fsdp
td.all_reduce(x)
tdist.barrier(group=g)
torch.distributed.all_gather(out, x)
bc(t, src=0)
self.optimizer.step()
opt.step()
get_peft_model(model, cfg)
self.model = apply_lora(model, r=4)
make_sharding("fsdp", model, f)
torch.nn.utils.clip_grad_norm_(ps, 1.0)
SHARDINGS = ("replicate", "zero1", "fsdp")
if self.sharding == "fsdp":
    pass
from dta.objective import linearize
import dta.tree
from dta.model.context_parallel import context_parallel_of as cp
from dta import train
''')
    kinds = [b.split(": ", 1)[1] for b in bad]
    assert kinds == ["imports from runtime.sharding (a sharding mode is the core's)",
                     "imports runtime.sharding.fsdp (a sharding mode is the core's)",
                     "torch.distributed collective td.all_reduce()",
                     "torch.distributed collective tdist.barrier()",
                     "torch.distributed collective torch.distributed.all_gather()",
                     "torch.distributed collective broadcast()",
                     "optimizer step self.optimizer.step()",
                     "optimizer step opt.step()",
                     "LoRA wrapping get_peft_model()",
                     "LoRA wrapping apply_lora()",
                     "make_sharding()",
                     "gradient clip torch.nn.utils.clip_grad_norm_()",
                     "the sharding modes written out ('replicate', 'zero1', 'fsdp') (the one "
                     "list: dta.planning.memory.SHARDINGS)",
                     "branches on a sharding mode self.sharding == 'fsdp'",
                     "imports linearize from dta.objective (the walks are the core's: "
                     "EngineCore.walk_sequences)",
                     "imports dta.tree (the walks are the core's: EngineCore.walk_sequences)",
                     "imports context_parallel_of from dta.model.context_parallel (the walks "
                     "are the core's: EngineCore.walk_sequences)",
                     "imports train from dta (the walks are the core's: "
                     "EngineCore.walk_sequences)"], bad
    assert offenders('''
import torch.distributed as dist
from runtime.engine import comm
dist.init_process_group("gloo")
dist.destroy_process_group()
comm.all_reduce(total, group)
comm.barrier(groups.cpu)
self.lr_scheduler.step()
self.core.optimizer_step(1.0)
mode = "fsdp" if trains else "replicate"
if alloc.backend != "fsdp":  # AReaL's allocation backend, not a sharding mode
    pass
from dta.losses import SequenceLoss
from dta.batch import Batch, unpad
from dta.model.lora import merged_weights
import dta.treelike
''') == []

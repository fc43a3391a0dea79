"""WalkOptions (dta/options.py): every walk setting defaulted and validated in one place, built
once and passed along unchanged; errors name the setting as its caller spells it."""
from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest
import torch

from dta.batch import Batch
from dta.config.schema import ConfigError, as_dict, load_config
from dta.config.walk import CONFIG_KEYS, walk_options
from dta.options import AUTO, NO_CUT, WalkOptionError, WalkOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("dta", "runtime", "dta_cli")  # the library, the runtimes, the CLI


@pytest.fixture(scope="module")
def tiny():
    from dta.model.models import build_model

    torch.manual_seed(0)
    return build_model("qwen3", "tiny")


def _batch(vocab: int) -> Batch:
    rng = np.random.default_rng(0)
    root = rng.integers(3, vocab, 9)
    seqs = [np.concatenate([root, rng.integers(3, vocab, n)]) for n in (4, 6, 3)]
    return Batch.from_records([dict(input_ids=s, loss_mask=np.r_[np.zeros(9), np.ones(len(s) - 9)],
                                    advantages=rng.normal(size=len(s)),
                                    old_logprobs=-rng.random(len(s)))
                               for s in seqs])


# ------------------------------------------------------------------ the dataclass --
def test_frozen_unknown_fields_refused_and_replace_validates():
    o = WalkOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.block_tokens = 5
    with pytest.raises(WalkOptionError, match="unknown walk setting polcy"):
        WalkOptions.make(polcy="retain")
    with pytest.raises(TypeError):
        WalkOptions(polcy="retain")
    with pytest.raises(WalkOptionError, match="logits_chunk: 0 must be"):
        o.replace(logits_chunk=0)
    assert o.replace(block_tokens=NO_CUT).block_tokens == 0  # the one spelling of no cut
    with pytest.raises(WalkOptionError, match="block_tokens: None must be .* or 0 for no cut"):
        o.replace(block_tokens=None)
    assert WalkOptions.given(o) is o and WalkOptions.given(o, {}) is o
    assert WalkOptions.given(o, {"policy": "recompute"}).policy == "recompute"
    assert WalkOptions.given(None, {"pack_tokens": 64}).pack_tokens == 64


@pytest.mark.parametrize("field, bad", [
    ("policy", "keep"), ("packing", "bins"), ("pack_tokens", 0), ("block_tokens", -1),
    ("block_tokens", 2.5), ("block_tokens", True), ("head_rows", -1), ("logits_chunk", 0),
    ("temperature", 0.0), ("router_aux_loss", "drop"), ("router_aux_loss", -0.1),
    ("router_aux_loss", 0),
    ("native_gqa", "yes"), ("min_shared", 0), ("pack_cost", 3)])
def test_each_setting_is_validated_and_named_as_spelled(field, bad):
    with pytest.raises(WalkOptionError, match=f"bad value for {field}: "):
        WalkOptions.make(**{field: bad})
    with pytest.raises(WalkOptionError, match=f"bad value for --the-{field}: "):
        WalkOptions.make({field: f"--the-{field}"}, **{field: bad})


def test_a_bad_router_aux_loss_raises_when_the_walker_is_built(tiny):
    from dta.walk import Walker

    with pytest.raises(WalkOptionError, match="router_aux_loss: 'drop' must be one of refuse"):
        Walker(tiny, router_aux_loss="drop")
    with pytest.raises(WalkOptionError, match="unknown walk setting blok_tokens"):
        Walker(tiny, blok_tokens=8)
    walker = Walker(tiny, router_aux_loss="exclude", block_tokens=8)
    assert walker.options == WalkOptions(router_aux_loss="exclude", block_tokens=8)


# --------------------------------------------------------------- how it is spelled --
@pytest.mark.parametrize("field, bad", [("policy", "keep"), ("logits_chunk", 0),
                                        ("temperature", -1), ("min_shared", 0),
                                        ("block_tokens", -3), ("router_aux_loss", -1)])
def test_a_bad_config_value_names_its_key(field, bad):
    key = CONFIG_KEYS[field]
    with pytest.raises(ConfigError, match=f"bad value for config key '{re.escape(key)}'"):
        load_config(None, [f"{key}={bad}"])


def test_the_config_builds_the_walk_settings_once():
    cfg = load_config(None, ["walker.policy=recompute", "walker.logits_chunk=64",
                             "walker.block_tokens=0", "actor.router_aux_loss_coef=0.01"])
    walk = walk_options(cfg)
    assert walk == WalkOptions(policy="recompute", logits_chunk=64, block_tokens=NO_CUT,
                               router_aux_loss=0.01)
    assert walk.router_aux_coef == 0.01
    off = walk_options(load_config(None, ["actor.router_aux_loss_coef=0"]))
    assert off.router_aux_loss == "refuse" and off.router_aux_coef == 0.0
    auto = load_config(None, [])
    assert auto.walker.block_tokens == AUTO
    assert walk_options(auto).block_tokens == WalkOptions.default("block_tokens")
    assert walk_options(auto, auto_block=512).block_tokens == 512  # the memory model's
    assert walk_options(auto, auto_block=NO_CUT).block_tokens == NO_CUT


def test_areal_options_produce_walk_options_and_name_their_keys():
    from runtime.areal.options import DTAOptions

    d = DTAOptions()
    walk = WalkOptions()
    assert (d.logits_chunk, d.min_shared, d.block_tokens) == \
        (walk.logits_chunk, walk.min_shared, walk.block_tokens)
    assert d.walk_options(policy="recompute", temperature=0.7) == \
        WalkOptions(policy="recompute", temperature=0.7)
    assert DTAOptions(policy="retain").walk_options(policy="recompute").policy == "retain"
    for field, bad in (("logits_chunk", 0), ("min_shared", 0), ("block_tokens", -1),
                       ("policy", "keep")):
        with pytest.raises(WalkOptionError, match=f"bad value for actor.dta.{field}: "):
            DTAOptions(**{field: bad})
    given = WalkOptions(policy="recompute", logits_chunk=32, block_tokens=7, min_shared=2)
    assert DTAOptions.of(given).walk_options() == given


def test_cli_flags_name_the_flag():
    from dta_cli.main import main

    with pytest.raises(SystemExit, match="--pack-tokens: 0 must be"):
        main(["verify", "--family", "qwen3", "--pack-tokens", "0"])
    with pytest.raises(SystemExit, match="--router-aux-loss: -1.0 must be"):
        main(["verify", "--family", "qwen3", "--router-aux-loss", "-1"])


# ------------------------------------------------------------ passed along unchanged --
def _capture_walkers(monkeypatch) -> list:
    from dta.walk import Walker

    seen, init = [], Walker.__init__

    def spy(self, model, options=None, **settings):
        if not settings:  # not the self-check's probe (dta/selfcheck.py: its own settings)
            seen.append(options)
        init(self, model, options, **settings)

    monkeypatch.setattr(Walker, "__init__", spy)
    return seen


def test_the_same_object_reaches_the_walker_through_the_trainer(tiny, monkeypatch):
    from dta.losses import NLL
    from dta.train import DFSTrainer

    walk = walk_options(load_config(None, ["walker.policy=recompute", "walker.block_tokens=5",
                                           "walker.logits_chunk=16"]))
    trainer = DFSTrainer(tiny, torch.optim.SGD(tiny.parameters(), lr=0.0), NLL(), options=walk)
    assert trainer.options is walk
    seen = _capture_walkers(monkeypatch)
    res = trainer.step(_batch(tiny.config.vocab_size))
    assert seen and all(o is walk for o in seen)
    assert res.walk.plan["block_tokens"] == 5 and res.walk.recomputed_tokens > 0


def _constructions(monkeypatch) -> list:
    """Every WalkOptions built from here on, but the self-check's probes (its own settings,
    dta/selfcheck.py): the stack of each."""
    import inspect

    built, post_init = [], WalkOptions.__post_init__

    def spy(self):
        stack = [f.filename for f in inspect.stack()[1:]]
        if not any(f.endswith(os.path.join("dta", "selfcheck.py")) for f in stack):
            built.append(stack[:6])
        post_init(self)

    monkeypatch.setattr(WalkOptions, "__post_init__", spy)
    return built


def test_the_driver_resolved_object_reaches_the_worker_through_ray_unchanged(monkeypatch):
    """The walk options the driver resolved reach the worker's walker through Ray's
    serialization (cloudpickle, what an actor's arguments go through): equal, and the very
    object the worker received; the worker builds none and patches none."""
    import ray.cloudpickle

    from dta.losses import batch_totals
    from runtime.engine import RunSettings
    from runtime.ray_runtime import driver
    from runtime.ray_runtime.worker import DFSWorker

    cfg = load_config(None, ["model.size=tiny", "workload.scale=tiny", "walker.block_tokens=6",
                             "ray.num_workers=1"])
    trainer = driver.Trainer(cfg)
    assert trainer.walk == walk_options(cfg)
    handed = {}

    def start_workers(cfg, n, **kw):
        handed.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(driver, "start_workers", start_workers)
    with pytest.raises(RuntimeError, match="stop here"):
        trainer._start_workers()
    assert handed["settings"] is trainer.settings and trainer.settings.walk is trainer.walk
    received = ray.cloudpickle.loads(ray.cloudpickle.dumps(handed["settings"]))
    assert isinstance(received, RunSettings) and received.walk == trainer.walk
    assert received.walk is not trainer.walk  # another process's copy, as a Ray actor gets it
    built = _constructions(monkeypatch)
    worker = DFSWorker(0, 1, as_dict(cfg), received)
    assert worker.walk is received.walk
    seen = _capture_walkers(monkeypatch)
    batch = _batch(worker.model.config.vocab_size)
    stats = worker.step(0, batch, batch_totals(batch))
    assert stats["updated"] and stats["max_call_tokens"] <= 6  # the driver's block reached it
    assert seen and all(o is received.walk for o in seen)
    assert built == [], f"the worker built walk options: {built[0]}"


def test_a_walk_not_resolved_for_its_layout_is_refused_by_the_core():
    """fsdp under retain walks with one LM-head flush per pack: the driver's resolution puts
    it in the walk (head_rows=0); the core refuses a walk without it instead of patching."""
    from runtime.engine import EngineCore, ParallelLayout
    from runtime.engine.layout import LayoutError
    from tests.workers import settings_for

    cfg = load_config(None, ["workload.scale=tiny", "train.sharding=fsdp",
                             "walker.policy=retain", "ray.num_workers=2"])
    settings = settings_for(cfg, 2)
    assert settings.layout == ParallelLayout(world=2, sharding="fsdp")
    assert settings.walk == walk_options(cfg).replace(head_rows=0)
    with pytest.raises(LayoutError, match="head_rows"):
        EngineCore(lambda dtype: None, layout=settings.layout, walk=walk_options(cfg),
                   make_optimizer=None, compute_dtype="float32")


# ------------------------------------------------------- each default in one place --
# (file, setting): a function of a lower layer taking the setting with its own default, why
ALLOWED = {
    ("dta/tree.py", "min_shared"): "PrefixTree's own parameter (the tree is below the options)",
    ("dta/planning/index.py", "min_shared"): "build_tree, the planner's tree (below the options)",
    ("dta/planning/memory.py", "logits_chunk"): "the memory model prices a given chunk "
                                                "(dta/planning sits below dta/options.py)",
    ("dta/reference.py", "temperature"): "the per-sequence reference, not the walk",
    ("dta/reference.py", "router_aux_loss_coef"): "the per-sequence reference, not the walk",
    ("dta/model/modeling.py", "temperature"): "LogitTransform's own parameter",
    ("dta/selfcheck.py", "temperature"): "the self-check probes the head at temperature 1",
    ("runtime/areal/smoke_engine.py", "temperature"): "the smoke rollout's greedy sampling",
    ("runtime/verl/records.py", "temperature"): "a verl batch's own meta field (verl's "
                                                "sampling temperature), not the walk's",
}


def _literals() -> dict[str, list[str]]:
    """Per setting, the source spellings of its default (None defaults mean 'not given')."""
    out = {}
    for f in dataclasses.fields(WalkOptions):
        d = f.default
        if d is None:
            continue
        if isinstance(d, bool):
            out[f.name] = [str(d)]
        elif isinstance(d, (int, float)):
            out[f.name] = sorted({repr(d), repr(float(d)), str(int(d)) if d == int(d) else repr(d)})
        else:
            out[f.name] = [f'"{d}"', f"'{d}'"]
    out.setdefault("block_tokens", []).extend([f'"{AUTO}"', f"'{AUTO}'"])
    return out


def default_repeats(path: str, text: str) -> list[str]:
    """Lines of ``text`` that give a walk setting its default value literally: a keyword
    default or assignment (``block_tokens: int = 2048``, ``logits_chunk=1024``) or an
    argparse flag's default (``"--block-tokens", ..., default=2048``)."""
    found = []
    for name, lits in _literals().items():
        alts = "|".join(re.escape(x) for x in lits)
        value = rf"\s*=\s*(?:{alts})(?![\w.])"
        keyword = re.compile(rf"\b{name}\b(?:\s*:[^=\n]*)?{value}")
        flag = re.compile(rf"[\"']--{name.replace('_', '-')}[\"'][^)]*?\bdefault{value}", re.S)
        for m in list(keyword.finditer(text)) + list(flag.finditer(text)):
            if (path, name) in ALLOWED:
                continue
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{path}:{line}: {name}: {m.group(0).strip()[:60]!r}")
    return found


def test_the_scan_finds_a_repeated_default():
    planted = ('def f(x, block_tokens: int | None = 2048, logits_chunk=1024):\n'
               '    p.add_argument("--min-shared", type=int,\n                   default=1)\n'
               'block_tokens: Any = "auto"\npolicy: str = "retain"\nlogits_chunk: int = 64\n')
    hits = default_repeats("dta/x.py", planted)
    assert len(hits) == 5, hits  # not logits_chunk = 64: not the default
    assert default_repeats("dta/x.py", "temperature=1.5\nblock_tokens=20480\n") == []


def test_each_walk_default_is_written_only_in_dta_options():
    found = []
    for package in SCANNED:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.relpath(os.path.join(folder, name), ROOT)
                    if path == os.path.join("dta", "options.py"):
                        continue
                    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                        found += default_repeats(path.replace(os.sep, "/"), f.read())
    assert found == [], "walk defaults repeated outside dta/options.py:\n" + "\n".join(found)
    with open(os.path.join(ROOT, "dta", "options.py"), encoding="utf-8") as f:
        own = f.read()
    assert default_repeats("dta/options.py", own)  # the one place: the scan sees them there


def test_the_areal_adapter_has_no_literal_walk_default():
    walk = WalkOptions()
    for name in ("options.py", "config.py", "walks.py", "engine.py", "ppo_config.py"):
        with open(os.path.join(ROOT, "runtime", "areal", name), encoding="utf-8") as f:
            text = f.read()
        for value in (walk.block_tokens, walk.logits_chunk):
            assert not re.search(rf"(?<![\w.]){value}(?![\w.])", text), (name, value)


def test_each_check_runs_once_per_step(tiny, monkeypatch):
    """A sequence loss walks the batch twice (forward, then train): the PEFT check, the
    routing checks and the shared-routing check still run once per step."""
    from dta import train, walk
    from dta.selfcheck import ensure_self_check
    from dta.train import DFSTrainer
    from tests.cases import SEQUENCE_LOSS

    ensure_self_check(tiny)  # once per model (cached): its probe walker is not the step's
    calls = {}

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    for module, name in ((walk, "check_peft_model"), (walk, "check_shared_routing"),
                         (train, "check_routing"), (walk, "check_router_aux_loss")):
        counted(module, name)
    trainer = DFSTrainer(tiny, torch.optim.SGD(tiny.parameters(), lr=0.0), SEQUENCE_LOSS,
                         reduction="sum")
    trainer.step(_batch(tiny.config.vocab_size))
    assert calls == {"check_peft_model": 1, "check_shared_routing": 1, "check_routing": 1,
                     "check_router_aux_loss": 1}, calls

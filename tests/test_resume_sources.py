"""What a resume refuses, and the sources it still reads (issue 48): one process, the
τ²-airline tiny model in float64 (bf16 for the masters).

- a checkpoint that is not this run's state -- LoRA <-> full, another optimizer, another
  model size -- is refused in one line saying what and why, before any parameter is
  touched, from a replica's checkpoint (the one format, written by one process), from one
  written by DCP's collective save, and from a replica's legacy ``model.pt`` one (DTA up to
  2026-12-07, built here by tests/legacy_checkpoints.py);
- a sharded checkpoint in the format before 2026-12-05 (zero1's flat tensors, fsdp's
  DTensors and flat vocabulary) still resumes through the engine core, into the exact saved
  state; an AReaL-style DCP load of it (``runtime.checkpoints.sharded.load_sharded`` with the logical view)
  is refused in one line naming the format;
- a replica keeping fp32 masters under bf16 compute saves the masters and resumes them
  exactly, bit-identical to the uninterrupted run, from the one format and the legacy one;
- an engine without an optimizer (AReaL's reference model) loads a trained run's weights
  from every format and saves its own weights alone.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dta.config.schema import load_config
from tests.test_sharding import _step, overrides

peft = pytest.importorskip("peft", reason="the optional lora extra: pip install -e '.[lora]'")

LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"]


def worker(*extra):
    from tests.workers import local_worker

    cfg = load_config(None, overrides("replicate", "float64", "recompute") + list(extra))
    return cfg, local_worker(cfg, 0, 1, truly_float64=True)


def trained(w) -> dict:
    return {n: p.detach().clone() for n, p in w.model.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A full run and a LoRA run after one step: their replicated checkpoints (one process),
    their logical views saved by ``runtime.checkpoints.sharded.save_sharded`` and their
    legacy ``model.pt`` checkpoints."""
    from runtime.checkpoints.sharded import save_sharded
    from tests.legacy_checkpoints import write_legacy_worker

    root = tmp_path_factory.mktemp("refusals")
    out = {}
    for kind, extra in (("full", []), ("lora", LORA)):
        cfg, w = worker(*extra)
        _step(w, cfg, 0, 0, 1)
        out[kind] = w.save_checkpoint(str(root / kind), 1, {"note": "test"})
        out[f"{kind}-dcp"] = save_sharded(str(root / f"{kind}-dcp"), 1,
                                          w.core.sharding.sharded_state(), meta={"note": "test"})
        out[f"{kind}-legacy"] = write_legacy_worker(str(root / f"{kind}-legacy"), 1, w)
        out[f"{kind}-state"] = trained(w)
    return out


@pytest.mark.parametrize("source", ["full", "full-dcp", "full-legacy"])
def test_a_full_checkpoint_is_refused_by_lora_sgd_and_another_size(saved, source):
    from runtime.checkpoints.sharded import ShardedCheckpointError

    cases = [(LORA, r"saved by a full run and this run trains LoRA adapters.*LoRA <-> full"),
             (["optimizer.name=sgd"], r"optimizer state \['exp_avg', 'exp_avg_sq', 'step'\] "
                                      r"per parameter, this run's optimizer keeps \[\]"),
             (["model.size=small"], r"lacks 22 of this run's .* \(another model or size\)")]
    for extra, pattern in cases:
        _, w = worker(*extra)
        before = trained(w)
        with pytest.raises(ShardedCheckpointError, match=pattern) as info:
            w.load_checkpoint(saved[source])
        message = str(info.value)
        assert "\n" not in message and saved[source] in message, message
        after = trained(w)
        assert all((after[k] == v).all() for k, v in before.items()), extra  # untouched
        assert not any(w.optimizer.state.values()), extra
        print(f"{source} into {extra}: {message}")


@pytest.mark.parametrize("source", ["lora", "lora-dcp", "lora-legacy"])
def test_a_lora_checkpoint_resumes_lora_and_is_refused_by_full(saved, source):
    from runtime.checkpoints.sharded import ShardedCheckpointError

    _, w = worker()
    with pytest.raises(ShardedCheckpointError,
                       match=r"saved by a LoRA run and this run trains the full model"):
        w.load_checkpoint(saved[source])
    _, w = worker(*LORA)  # the same LoRA run resumes, replicated or from the DCP view
    w.load_checkpoint(saved[source])
    got = trained(w)
    assert all((got[k] == v).all() for k, v in saved["lora-state"].items())


# ------------------------------------------------------------ the previous format --
def write_previous(path: str, w, sharding: str) -> None:
    """A replica's state in the sharded format before 2026-12-05 (what zero1's
    ``FlatShardsState`` / fsdp's ``DTensorParamsState`` wrote, here as whole tensors):
    published with its meta.json and manifest, as ``runtime.checkpoints.sharded.save_sharded`` did."""
    import torch.distributed.checkpoint as dcp

    from runtime.checkpoints.checkpoint import write_manifest

    mode, opt = w.core.sharding, w.optimizer
    named = list(zip(mode.names, mode.stepped))
    state = {}

    def flat(prefix, items):
        state[f"{prefix}.master"] = torch.cat([p.detach().reshape(-1) for _, p in items])
        for k in ("exp_avg", "exp_avg_sq"):
            state[f"{prefix}.{k}"] = torch.cat([opt.state[p][k].reshape(-1) for _, p in items])
        state[f"{prefix}.steps"] = torch.tensor([float(opt.state[p]["step"]) for _, p in items],
                                                dtype=torch.float64)

    if sharding == "zero1":
        flat("zero1", named)
    else:
        vocab = {n for n, _ in mode.vocab_params()}
        flat("vocab", [(n, p) for n, p in named if n in vocab])
        for n, p in named:
            if n not in vocab:
                state[f"fsdp.param.{n}"] = p.detach().clone()
                for k, v in opt.state[p].items():
                    state[f"fsdp.optim.{n}.{k}"] = v.clone()
    tmp = path + ".tmp"
    os.makedirs(tmp)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"step": 1, "world_size": 2, "format": "dcp", "sharding": sharding}, f)
    write_manifest(tmp, run_id=None, step=1, extra={"kind": "dcp"})
    shutil.move(tmp, path)


@pytest.mark.parametrize("sharding", ["zero1", "fsdp"])
def test_the_previous_sharded_format_still_resumes(tmp_path, sharding):
    from runtime.checkpoints.sharded import ShardedCheckpointError, load_sharded

    cfg, w = worker()
    _step(w, cfg, 0, 0, 1)
    path = str(tmp_path / "step-000001")
    write_previous(path, w, sharding)
    want = {n: (s.detach().clone(), {k: v.clone() for k, v in w.optimizer.state[s].items()})
            for n, s in zip(w.core.sharding.names, w.core.sharding.stepped)}
    _, fresh = worker()
    assert fresh.load_checkpoint(path)["sharding"] == sharding and fresh.completed_steps == 1
    mode = fresh.core.sharding
    for n, s in zip(mode.names, mode.stepped):
        param, st = want[n]
        assert (s == param).all(), n
        for k, v in st.items():
            assert (fresh.optimizer.state[s][k] == v).all(), (n, k)
    with pytest.raises(ShardedCheckpointError, match="format before 2026-12-05") as info:
        load_sharded(path, fresh.core.sharding.sharded_state())
    assert "\n" not in str(info.value)


# ------------------------------------------------------- a replica's fp32 masters --
def masters_core(cfg, masters: bool):
    """A one-rank core in bf16 compute: ``masters`` a replica keeping fp32 masters (AReaL's
    and verl's optimizer dtype), else zero1's layout on one rank is a replica: a plain
    bf16 replica."""
    from runtime.engine import EngineCore
    from runtime.ray_runtime.worker import build_replica
    from runtime.sharding.common import optimizer_factory
    from tests.workers import settings_for

    settings = settings_for(cfg, 1)
    return EngineCore(lambda dtype: build_replica(cfg, dtype=dtype),
                      layout=settings.layout.at(0), walk=settings.walk,
                      make_optimizer=optimizer_factory(cfg.optimizer), compute_dtype="bfloat16",
                      master_dtype="float32" if masters else None).parallelize()


def test_a_replicas_fp32_masters_are_saved_and_resumed_exactly(tmp_path):
    """A replica stepping fp32 masters under bf16 compute writes the masters as its weights;
    a resumed replica holds exactly those masters (not their bf16 cast) and the
    optimizer state, and its next step equals the uninterrupted run's bit for bit."""
    from dta.losses import batch_totals
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime.worker import make_training_loss

    cfg = load_config(None, overrides("replicate", "bfloat16", "recompute"))
    source, loss = BatchSource(cfg, 512), make_training_loss(cfg)

    def step(core, k):
        b = source.batch(k)
        return core.train_step(b, loss, totals=batch_totals(b), max_grad_norm=0.5)

    from tests.legacy_checkpoints import write_legacy_replica

    core = masters_core(cfg, masters=True)
    step(core, 0)
    path = core.save(str(tmp_path / "ckpt"), 1, {"note": "test"})
    assert not os.path.exists(os.path.join(path, "model.pt"))  # the one format
    legacy = write_legacy_replica(str(tmp_path / "legacy"), 1, core.model, core.optimizer,
                                  weights=dict(zip(core.sharding.names, core.sharding.masters)))
    saved = [m.detach().clone() for m in core.sharding.masters]
    step(core, 1)
    for ckpt_path in (path, legacy):
        fresh = masters_core(cfg, masters=True)
        fresh.load(ckpt_path)
        for m, want in zip(fresh.sharding.masters, saved):
            assert m.dtype == torch.float32 and torch.equal(m, want), ckpt_path
        for p, m in zip(fresh.sharding.params, fresh.sharding.masters):
            assert torch.equal(p, m.to(torch.bfloat16))  # the model holds their cast
        step(fresh, 1)
        for a, b in zip(fresh.sharding.masters, core.sharding.masters):
            assert torch.equal(a, b), ckpt_path
        for a, b in zip(fresh.sharding.masters, core.sharding.masters):
            sa, sb = fresh.optimizer.state[a], core.optimizer.state[b]
            assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_an_engine_without_optimizer_loads_and_saves_the_weights_alone(saved, tmp_path):
    """AReaL's reference model (no optimizer, replicated): a trained run's checkpoint, either
    format, gives it the weights (its optimizer state is not read); its own DCP view is the
    weights alone."""
    from runtime.checkpoints.sharded import save_sharded
    from runtime.engine import EngineCore
    from runtime.ray_runtime.worker import build_replica
    from tests.workers import settings_for

    cfg = load_config(None, overrides("replicate", "float64", "recompute"))
    settings = settings_for(cfg, 1)

    def reference():
        return EngineCore(lambda dtype: build_replica(cfg, dtype=dtype),
                          layout=settings.layout.at(0), walk=settings.walk,
                          make_optimizer=lambda params: None, compute_dtype="float64"
                          ).parallelize()

    for source in ("full", "full-dcp", "full-legacy"):
        ref = reference()
        assert ref.optimizer is None
        ref.load(saved[source])
        got = {n: p.detach() for n, p in ref.model.named_parameters()}
        assert all(torch.equal(got[k], v) for k, v in saved["full-state"].items()), source
    path = save_sharded(str(tmp_path / "ref"), 1, ref.sharding.sharded_state())
    again = reference()
    again.load(path)
    assert all(torch.equal(p, q) for p, q in zip(again.model.parameters(),
                                                 ref.model.parameters()))

"""Optimizer-state offload (``train.offload=optimizer``: the AdamW state and the weights it
steps in host memory, stepped there) on every sharding mode, as the Ray worker runs it,
against one process (float64, tiny Qwen3, τ²-airline "tiny"): log-probs, each step's loss,
every reduced gradient and the parameters after one and two AdamW steps within 1e-10 --
replicate, zero1 and fsdp on 2 gloo ranks, and HSDP 2 x 2 + offload on 4; the optimizer
steps separate host tensors (never the model's), the device holds no optimizer state and
``state_bytes`` reports the host's; in one process offload changes no bit (replicate
without masters, and with fp32 masters under bf16 compute); a DCP checkpoint written
offloaded resumes bit-identically offloaded and not offloaded."""
from __future__ import annotations

import os

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_hsdp import (
    assert_matches,
    check_hsdp_traffic,
    one_process,
    overrides,
    record,
    rel_state,
)
from tests.workers import state

# (mode, policy, shard_size, offload) on 2 ranks, and HSDP + offload on 4
TWO = [("replicate", "recompute", None, "optimizer"), ("zero1", "retain", None, "optimizer"),
       ("fsdp", "recompute", None, "optimizer")]
TWO_SLOW = [("replicate", "retain", None, "optimizer"), ("zero1", "recompute", None, "optimizer"),
            ("fsdp", "retain", None, "optimizer")]
FOUR = [("fsdp", "retain", 2, "optimizer")]
FOUR_SLOW = [("zero1", "recompute", 2, "optimizer"), ("fsdp", "recompute", 2, "optimizer")]


def offloaded_cases(rank, world, cases):
    """``record`` per case, plus where the optimizer's tensors live."""
    torch.set_num_threads(1)
    out = []
    for case in cases:
        got = record(rank, world, overrides(*case))
        out.append(got)
    return out


def placement(rank, world, case):
    """Where the optimizer's parameters and state live, and whether they share storage with
    the model's (one step of ``case``)."""
    from tests.test_sharding import _step, _worker

    torch.set_num_threads(1)
    cfg = load_config(None, overrides(*case))
    w = _worker(cfg, rank, world)
    _step(w, cfg, 0, rank, world)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    model = {local(p).untyped_storage().data_ptr() for p in w.model.parameters()}
    stepped = [local(p) for g in w.optimizer.param_groups for p in g["params"]]
    state = [local(v) for st in w.optimizer.state.values() for v in st.values()
             if torch.is_tensor(v) and v.dim() > 0]
    return {"devices": sorted({str(t.device) for t in stepped + state}),
            "shared": sum(t.untyped_storage().data_ptr() in model for t in stepped),
            "stepped": len(stepped), "state": len(state),
            "state_bytes": w.core.state_bytes()}


# ----------------------------------------------------------------------- tests --
def _check(cases, world, results):
    for i, case in enumerate(cases):
        ref = one_process(case)
        ranks = [results[r][i] for r in range(world)]
        worst = assert_matches(ranks, ref, f"offload {case} on {world} ranks")
        if case[2] is not None:
            check_hsdp_traffic(ranks, str(case))
        for got in ranks:  # the device holds no optimizer state; the host does
            sb = got["steps"][-1]["state_bytes"]
            assert sb["optimizer"] == 0 and sb["host"] > 0, (case, sb)
        print(f"offload {case[0]} {case[1]} S={case[2] or world} on {world} ranks: worst "
              f"relative error vs one process { {k: f'{v:.2g}' for k, v in worst.items()} }; "
              f"rank 0 state_bytes {ranks[0]['steps'][-1]['state_bytes']}")


@pytest.mark.parametrize("cases", [pytest.param(TWO, id="fast"),
                                   pytest.param(TWO_SLOW, id="slow", marks=pytest.mark.slow)])
def test_offload_on_two_ranks_equals_one_process(cases):
    _check(cases, 2, run_ranks(offloaded_cases, 2, cases, timeout=900.0))


@pytest.mark.slow  # HSDP + offload through the front doors: tests/test_engine_front_doors.py
@pytest.mark.parametrize("cases", [pytest.param(FOUR, id="retain"),
                                   pytest.param(FOUR_SLOW, id="recompute")])
def test_hsdp_with_offload_equals_one_process(cases):
    _check(cases, 4, run_ranks(offloaded_cases, 4, cases, timeout=900.0))


def placements(rank, world):
    return [placement(rank, world, (mode, "recompute", None, offload))
            for mode in ("replicate", "zero1", "fsdp") for offload in ("none", "optimizer")]


def test_the_optimizer_steps_host_tensors_of_its_own():
    got = run_ranks(placements, 2)[0]
    for i, mode in enumerate(("replicate", "zero1", "fsdp")):
        kept, off = got[2 * i], got[2 * i + 1]
        assert off["devices"] == ["cpu"] and off["stepped"] > 0 and off["state"] > 0
        assert off["shared"] == 0, (mode, off)  # separate copies, never the model's storage
        # without offload zero1 steps its own master slice, fsdp its FSDP shards (and its
        # vocabulary's master slice), replicate the model itself
        shared = {"replicate": kept["stepped"], "zero1": 0}.get(mode, kept["shared"])
        assert kept["shared"] == shared and (mode != "fsdp" or 0 < shared < kept["stepped"])
        ks, os_ = kept["state_bytes"], off["state_bytes"]
        assert ks["host"] == 0 and os_["optimizer"] == 0
        device = {k: sum(b[k2] for k2 in ("params", "grads", "optimizer"))
                  for k, b in (("kept", ks), ("off", os_))}
        # the optimizer state left the device for the host (zero1: its master slice too)
        assert device["off"] <= device["kept"] - ks["optimizer"], (mode, ks, os_)
        assert os_["host"] >= ks["optimizer"], (mode, ks, os_)
        if mode == "zero1":
            assert os_["params"] < ks["params"], (ks, os_)
        print(f"{mode}: state_bytes without offload {ks}, with {os_}")


@pytest.mark.parametrize("master", [None, "float32"])
def test_offload_changes_no_bit_in_one_process(master):
    """replicate on one rank, offloaded or not: the same parameters bit for bit after two
    steps (without masters: float64; with fp32 masters: bf16 compute)."""
    from dta.config.loss import loss_kwargs
    from dta.losses import batch_totals, make_loss
    from dta_cli.batches import BatchSource
    from runtime.engine import EngineCore, ModelSpec, build_model, settle
    from runtime.engine.layout import ParallelLayout
    from runtime.sharding.common import optimizer_factory

    cfg = load_config(None, overrides("replicate", "recompute"))
    compute = "float64" if master is None else "bfloat16"
    source = BatchSource(cfg, 512)
    loss = make_loss(cfg.loss.name, **loss_kwargs(cfg))
    from dta.config.walk import walk_options

    states = {}
    for offload in ("none", "optimizer"):
        layout = ParallelLayout.make(world=1, offload=offload)
        spec = ModelSpec(family=str(cfg.model.family), size=str(cfg.model.size), seed=0)
        core = EngineCore(lambda dtype: build_model(spec, dtype), layout=layout,
                          walk=settle(walk_options(cfg), layout).walk,
                          make_optimizer=optimizer_factory(cfg.optimizer),
                          compute_dtype=compute, master_dtype=master).parallelize()
        for k in range(2):
            batch = source.batch(k)
            out = core.train_step(batch, loss, totals=batch_totals(batch), max_grad_norm=0.5)
            assert out.updated
        states[offload] = (core.full_state(), core.param_norm(), core.state_bytes())
    (a, na, sa), (b, nb, sb) = states["none"], states["optimizer"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert na == nb and sb["optimizer"] == 0 and sb["host"] >= sa["optimizer"]


def resume_offloaded(rank, world, mode, directory):
    """Step 0 offloaded, save, step 1; fresh workers, offloaded and not, load and run
    step 1."""
    from tests.test_sharding import _step, _worker

    torch.set_num_threads(1)
    out = {}
    for name, offload in (("optimizer", "optimizer"), ("none", "none")):
        cfg = load_config(None, overrides(mode, "recompute", None, offload))
        if name == "optimizer":
            w = _worker(cfg, rank, world)
            _step(w, cfg, 0, rank, world)
            path = w.save_checkpoint(os.path.join(directory, mode), 1, {"note": "offload"})
            _step(w, cfg, 1, rank, world)
            out["straight"] = state(w)["model"]
        fresh = _worker(cfg, rank, world)
        fresh.load_checkpoint(path)
        _step(fresh, cfg, 1, rank, world)
        out[name] = state(fresh)["model"]
    return out


@pytest.mark.parametrize("mode", [pytest.param("zero1", marks=pytest.mark.slow), "fsdp"])
def test_offloaded_checkpoint_resumes_either_way(tmp_path, mode):
    from tests.test_runtime import assert_identical

    for rank, got in enumerate(run_ranks(resume_offloaded, 2, mode, str(tmp_path))):
        assert_identical(got["optimizer"], got["straight"], f"{mode} offloaded, rank {rank}")
        assert_identical(got["none"], got["straight"], f"{mode} not offloaded, rank {rank}")
        assert rel_state(got["none"], got["straight"]) == 0.0


def test_front_door_keys_are_translated_or_refused():
    """AReaL: ``actor.dta.shard_size`` / ``actor.dta.offload`` reach the layout (errors name
    them); ``fsdp.offload_params`` (FSDP2's parameter offload) is refused naming it. (verl's
    ``fsdp_size`` / ``optimizer_offload`` / ``param_offload`` / ``offload_policy``:
    tests/test_verl_layouts.py.)"""
    pytest.importorskip("areal")
    from areal.api.cli_args import FSDPEngineConfig, OptimizerConfig, TrainEngineConfig

    from runtime.areal import DTATrainEngine
    from runtime.areal.parallel import layout_of

    layout = layout_of("zero1", world=4, rank=1, shard_size=2, offload="optimizer")
    assert (layout.shard_size, layout.replicas, layout.offload) == (2, 2, "optimizer")
    with pytest.raises(ValueError, match="bad value for actor.dta.shard_size: 3"):
        layout_of("fsdp", world=4, shard_size=3)
    with pytest.raises(ValueError, match="bad value for actor.dta.offload: 'disk'"):
        layout_of("fsdp", world=4, offload="disk")
    config = TrainEngineConfig(experiment_name="x", trial_name="y", path="/nonexistent",
                               optimizer=OptimizerConfig(),
                               fsdp=FSDPEngineConfig(offload_params=True))
    with pytest.raises(NotImplementedError, match="fsdp.offload_params=True"):
        DTATrainEngine(config)

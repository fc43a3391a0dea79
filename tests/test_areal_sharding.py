"""DTATrainEngine sharded (actor.dta.sharding zero1 / fsdp) on 2 gloo ranks as AReaL engine
ranks (``fsdp:d2``, spawned processes, a file:// store on loopback), against one process.

* parameters after 2 ``train_batch`` steps (AReaL's grpo_loss_fn, each rank half of the
  sequences) equal one process's on the whole batch: float64 <= 1e-12, float32 <= 1e-6
  relative L2, for zero1 and fsdp under both memory policies; then forward_batch on each rank's
  half and eval_batch (all-reduced) agree with one process's;
* the HF export is gathered and written by rank 0 (compared with one process), loading it
  back restores the weights and the fp32 masters, and an xccl update gathers every tensor
  (rank 0 sends);
* a DCP save (AReaL's ``SaveLoadMeta(weight_format="dcp")``) under zero1 and fsdp, then a fresh
  engine loads it and continues: bit-identical to the uninterrupted run (weights, optimizer
  shards, LR schedule);
* what a sharded engine refuses, each with a one-line error.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from areal.api.cli_args import OptimizerConfig  # noqa: E402
from areal.api.io_struct import SaveLoadMeta  # noqa: E402

from experiments.local_ranks import run_ranks  # noqa: E402
from runtime.areal import DTAOptions, DTATrainEngine  # noqa: E402
from runtime.areal.parallel import layout_of  # noqa: E402
from tests.test_areal import (  # noqa: E402
    FT_SPEC,
    VOCAB,
    engine_config,
    grpo,
    loss_weight_fn,
    make_train_batch,
    model_dir,  # noqa: F401  (a fixture)
)

CASES = [(mode, policy, dtype) for mode in ("zero1", "fsdp")
         for policy in ("retain", "recompute") for dtype in ("float64", "float32")]
MIXED = [("zero1", "retain", "bfloat16"), ("fsdp", "recompute", "bfloat16")]
RUN = CASES + MIXED  # runtime.engine.lockstep cannot match retain's calls
TOL = {"float64": 1e-12, "float32": 1e-6}
LINEAR = OptimizerConfig(lr=1e-3, weight_decay=0.01, gradient_clipping=1.0,
                         lr_scheduler_type="linear", warmup_steps_proportion=0.0)


# ------------------------------------------------------------------- on a rank --
@contextlib.contextmanager
def _rank_setup():
    """No torch.compile, float32 stats (AReaL's tracker takes float32 only; logging only),
    and every model loaded by the engine made truly float64 (a no-op in float32) before it
    is sharded."""
    import torch._dynamo
    from areal.utils import stats_tracker

    from dta.model import models
    from dta.model.models import make_truly_float64

    stat, load = stats_tracker.stat, models.load_model

    def stat_float32(*args, **kwargs):
        return stat(*args, **{k: v.float() if torch.is_tensor(v) and v.is_floating_point()
                              else v for k, v in kwargs.items()})

    def load_truly(*args, **kwargs):
        model = load(*args, **kwargs)
        make_truly_float64(model)
        return model

    stats_tracker.stat, models.load_model = stat_float32, load_truly
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        stats_tracker.stat, models.load_model = stat, load


def _engine(path, world, mode, policy, dtype, optimizer=None):
    kw = {"optimizer": optimizer} if optimizer is not None else {}
    if dtype == "bfloat16":  # AReaL's mixed precision: bf16 compute, fp32 masters (default)
        kw["dtype"] = "bfloat16"
    eng = DTATrainEngine(engine_config(path, 1, backend=f"fsdp:d{world}", **kw),
                         DTAOptions(policy=policy, sharding=mode if world > 1 else None,
                                    dtype="float64" if dtype == "float64" else None))
    eng.create_process_group()
    eng.initialize(None, FT_SPEC)
    return eng


def _batches(n_steps=3):
    from experiments.workloads import make_workload

    records = make_workload("tau2-airline", scale="tiny", seed=0, vocab_size=VOCAB).records
    return [make_train_batch(records, torch.full((len(records), 1), -6.0), seed=k)
            for k in range(n_steps)]


def _step(eng, batch, rank, world):
    stats = eng.train_batch({k: v[rank::world] for k, v in batch.items()}, grpo(),
                            loss_weight_fn)
    eng.lr_scheduler_step()
    return stats


def _optimizer_state(eng):
    """This rank's optimizer state as plain tensors (flat-shard views and DTensors local)."""
    out = {}
    for i, (p, st) in enumerate(eng.optimizer.state.items()):
        for k, v in st.items():
            if torch.is_tensor(v):
                v = v.to_local() if hasattr(v, "to_local") else v
                out[f"{i}.{k}"] = v.detach().clone()
    return out


def _xccl_update(eng, rank):
    """``update_weights`` of type xccl with the broadcast recorded on rank 0 (the NCCL group to
    the inference servers is tests/test_areal_members.py's; here the gathers are the point):
    returns rank 0's received ``{name: tensor}`` and the inference engine's calls."""
    from concurrent.futures import Future

    from areal.api.alloc_mode import ModelAllocation
    from areal.api.io_struct import WeightUpdateMeta

    import runtime.areal.rollout as rollout

    calls, sent = [], []

    def done():
        fut = Future()
        fut.set_result(None)
        return fut

    class Recording:
        def pause_generation(self):
            calls.append("pause")

        def continue_generation(self):
            calls.append("continue")

        def update_weights_from_distributed(self, meta, specs):
            calls.append(("bucket", [s.name for s in specs]))
            return done()

    meta = WeightUpdateMeta.from_fsdp_xccl(ModelAllocation.from_str("sglang:d1"),
                                           weight_chunked_mem_mb=1)
    eng.rollout_engine, eng.rollout_coordinator = Recording(), object()
    eng.weight_update_group = "recorded" if rank == 0 else None
    eng._weight_update_address = ("127.0.0.1", 0)
    broadcast = rollout.broadcast_bucket
    rollout.broadcast_bucket = lambda tensors, group: sent.extend(t.clone() for t in tensors)
    try:
        eng.update_weights(meta.with_version(1))
    finally:
        rollout.broadcast_bucket = broadcast
        eng.rollout_engine = eng.rollout_coordinator = eng.weight_update_group = None
    names = [n for c in calls if isinstance(c, tuple) for n in c[1]]
    return dict(zip(names, sent)), calls


def train_cases(rank, world, path, cases, hf_dir):
    """Each case: 2 steps, the gathered weights and the parameter norm. zero1/retain/float64
    and fsdp/recompute/float32 also export HF after step 2, take a third step and load the
    export back."""
    out = []
    with _rank_setup():
        batches = _batches()
        for mode, policy, dtype in cases:
            eng = _engine(path, world, mode, policy, dtype)
            stats = [_step(eng, b, rank, world) for b in batches[:2]]
            mine = {k: v[rank::world] for k, v in batches[2].items()}
            logp = eng.forward_batch({k: mine[k] for k in ("input_ids", "attention_mask")})
            lengths = mine["attention_mask"].sum(-1).tolist()
            walked = dict(logp=[row[:n - 1] for row, n in zip(logp, lengths)],
                          eval=float(eng.eval_batch(mine, grpo(), loss_weight_fn)))
            res = {"walked": walked, "sharding": eng.sharding, "state": eng.full_state_dict(),
                   "norm": eng.param_norm(), "stats": stats,
                   "master_dtype": str(eng.optimizer.param_groups[0]["params"][0].dtype),
                   "optim_dtypes": sorted({str(v.dtype) for st in eng.optimizer.state.values()
                                           for k, v in st.items() if k != "step"})}
            if world > 1 and (mode, policy, dtype) in (("zero1", "retain", "float64"),
                                                       ("fsdp", "recompute", "float32")):
                res["xccl"], res["xccl_calls"] = _xccl_update(eng, rank)
                target = os.path.join(hf_dir, f"{mode}-{policy}-{dtype}")
                eng.save(SaveLoadMeta(path=target, weight_format="hf", with_optim=False))
                _step(eng, batches[2], rank, world)
                moved = eng.param_norm()
                eng.load(SaveLoadMeta(path=target, weight_format="hf", with_optim=False))
                res.update(hf=target, moved_norm=moved, reloaded=eng.full_state_dict(),
                           reloaded_norm=eng.param_norm())
            out.append(res)
            eng.destroy()
    return out


DCP_CASES = [("zero1", "retain"), ("fsdp", "recompute")]


def _dcp_round_trip(rank, world, path, directory, mode, policy):
    """Uninterrupted steps 0, 1 vs step 0, DCP save, a fresh engine loads, step 1. Returns
    both final states and the fresh engine (for the refusals)."""
    b0, b1 = _batches(2)
    eng = _engine(path, world, mode, policy, "float32", optimizer=LINEAR)
    _step(eng, b0, rank, world)
    eng.set_version(1)
    eng.save(SaveLoadMeta(path=directory, weight_format="dcp", with_optim=True))
    _step(eng, b1, rank, world)
    straight = dict(state=eng.full_state_dict(), optim=_optimizer_state(eng),
                    lr=eng.lr_scheduler.get_last_lr()[0], norm=eng.param_norm())
    eng.destroy()
    fresh = _engine(path, world, mode, policy, "float32", optimizer=LINEAR)
    fresh.load(SaveLoadMeta(path=directory, weight_format="dcp", with_optim=True))
    lr_loaded = fresh.lr_scheduler.get_last_lr()[0]
    _step(fresh, b1, rank, world)
    resumed = dict(state=fresh.full_state_dict(), optim=_optimizer_state(fresh),
                   lr=fresh.lr_scheduler.get_last_lr()[0], norm=fresh.param_norm())
    files = sorted(os.listdir(os.path.join(directory, "step-000001")))
    return fresh, {"straight": straight, "resumed": resumed, "lr_loaded": lr_loaded,
                   "files": files}


def _refusals(eng, directory):
    attempts = {
        "offload": eng.offload,
        "hf_with_optim": lambda: eng.save(SaveLoadMeta(
            path=os.path.join(directory, "hf"), weight_format="hf", with_optim=True)),
        "dcp_without_optim": lambda: eng.save(SaveLoadMeta(
            path=directory, weight_format="dcp", with_optim=False)),
        "forward_backward": lambda: eng.forward_backward_batch([], None),
    }
    refused = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            refused[name] = None
        except (ValueError, NotImplementedError) as exc:
            refused[name] = str(exc)
    return refused


def dcp_and_refusals(rank, world, path, directory):
    """The DCP round trip under zero1 and fsdp, then what a sharded engine refuses."""
    out, engines = {}, {}
    with _rank_setup():
        for mode, policy in DCP_CASES:
            engines[mode], out[mode] = _dcp_round_trip(rank, world, path,
                                                       os.path.join(directory, mode),
                                                       mode, policy)
        for mode in ("zero1", "fsdp"):
            out[mode]["refused"] = _refusals(engines[mode], os.path.join(directory, mode))
        for eng in engines.values():
            eng.destroy()
    return out


def two_ranks(rank, world, path, cases, hf_dir, dcp_dir):
    """Everything the 2-rank tests check, in one spawn (each process imports AReaL once)."""
    return {"cases": train_cases(rank, world, path, cases, hf_dir),
            "dcp": dcp_and_refusals(rank, world, path, dcp_dir)}


# ------------------------------------------------------------------------ tests --
def rel_l2(a, b):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):  # noqa: F811
    hf_dir = str(tmp_path_factory.mktemp("hf"))
    dcp_dir = str(tmp_path_factory.mktemp("dcp") / "recover")
    two = run_ranks(two_ranks, 2, model_dir, RUN, hf_dir, dcp_dir)
    with pytest.MonkeyPatch.context() as mp:  # one process: the engine's own 1-rank group
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(key, raising=False)
        one = train_cases(0, 1, model_dir, RUN, hf_dir)
    reference = dict(zip(RUN, one))
    return [r["cases"] for r in two], reference, [r["dcp"] for r in two]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_two_sharded_engine_ranks_match_one_process(runs, case):
    two, reference, _ = runs
    i = RUN.index(case)
    ref = reference[case]
    assert ref["sharding"] == "replicate"
    for rank in (0, 1):
        got = two[rank][i]
        assert got["sharding"] == case[0]
        assert all(s["update_successful"] == 1.0 for s in got["stats"])
        err = rel_l2(got["state"], ref["state"])
        print(f"{case} rank {rank}: params relative L2 {err:.2e}")
        assert err <= TOL[case[2]], f"{case} rank {rank}: relative L2 {err:.3g}"
        assert got["norm"] == pytest.approx(ref["norm"], rel=TOL[case[2]])
        for s, r in zip(got["stats"], ref["stats"]):
            assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6)
        assert got["master_dtype"] == str(getattr(torch, case[2]))
        # forward_batch on this rank's half and eval_batch (all-reduced) after the steps
        for j, row in enumerate(got["walked"]["logp"]):
            want = ref["walked"]["logp"][rank + 2 * j]
            assert row.shape == want.shape
            assert float((row - want).abs().max()) <= 10 * TOL[case[2]], (case, rank, j)
        # eval_batch sums in float32 (as AReaL): rank partial sums vs one sum
        assert got["walked"]["eval"] == pytest.approx(ref["walked"]["eval"], rel=1e-5)


@pytest.mark.parametrize("case", MIXED, ids=["-".join(c) for c in MIXED])
def test_mixed_precision_as_areal(runs, case):
    """bf16 compute, fp32 master weights and AdamW state, fp32 gradient reduction: the
    sharded step stays within bf16 rounding of one process's."""
    two, reference, _ = runs
    ref = reference[case]
    for rank in (0, 1):
        got = two[rank][RUN.index(case)]
        assert got["sharding"] == case[0]
        assert {str(v.dtype) for v in got["state"].values()} == {"torch.bfloat16"}
        assert got["master_dtype"] == "torch.float32"
        assert got["optim_dtypes"] == ["torch.float32"]
        err = rel_l2(got["state"], ref["state"])
        gn = max(abs(s["grad_norm"] / r["grad_norm"] - 1)
                 for s, r in zip(got["stats"], ref["stats"]))
        print(f"{case} rank {rank}: bf16 params relative L2 {err:.2e}, fp32 master norm "
              f"{got['norm']:.6f} vs {ref['norm']:.6f}, grad norms within {gn:.1e}")
        assert err <= 1e-2  # bf16's own rounding: one ulp is 3.9e-3
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-4)
        assert gn <= 1e-2


def test_hf_export_is_gathered_on_rank_0_and_loads_back(runs):
    from runtime.areal.checkpoint import local_state_dict

    two, reference, _ = runs
    checked = 0
    for i, case in enumerate(RUN):
        got = two[0][i]
        if "hf" not in got:
            continue
        checked += 1
        saved = local_state_dict(got["hf"])
        assert set(saved) == set(got["state"]) - ({"lm_head.weight"} - set(saved))
        err = rel_l2(saved, reference[case]["state"])
        assert err <= TOL[case[2]], f"{case}: HF export vs one process {err:.3g}"
        for rank in (0, 1):  # the load restored the exported weights and the masters
            r = two[rank][i]
            assert r["moved_norm"] != r["norm"]
            for k, v in saved.items():
                assert torch.equal(r["reloaded"][k], v), (case, rank, k)
            assert r["reloaded_norm"] == r["norm"]
    assert checked == 2


def test_xccl_update_gathers_every_tensor_and_rank_0_sends(runs):
    two, _, _ = runs
    checked = 0
    for i, case in enumerate(RUN):
        if "xccl" not in two[0][i]:
            continue
        checked += 1
        state, sent, calls = two[0][i]["state"], two[0][i]["xccl"], two[0][i]["xccl_calls"]
        assert calls[0] == "pause" and calls[-1] == "continue" and len(calls) >= 3
        assert set(sent) == set(state) - ({"lm_head.weight"} - set(sent))
        for name, t in sent.items():
            assert t.dtype == state[name].dtype and torch.equal(t, state[name]), (case, name)
        assert two[1][i]["xccl"] == {} and two[1][i]["xccl_calls"] == []  # rank 1 gathers only
    assert checked == 2


@pytest.mark.parametrize("mode", [m for m, _ in DCP_CASES])
def test_dcp_round_trip_continues_bit_identically(runs, mode):
    """AReaL's SaveLoadMeta(weight_format="dcp", with_optim=True), what RecoverHandler
    writes: every rank its shards; a fresh engine's load + the next step == uninterrupted."""
    res = [runs[2][rank][mode] for rank in (0, 1)]
    for rank, r in enumerate(res):
        assert ".metadata" in r["files"] and "manifest.json" in r["files"]
        assert r["lr_loaded"] < LINEAR.lr  # the schedule resumed, not restarted
        s, t = r["straight"], r["resumed"]
        assert s["lr"] == t["lr"] and s["norm"] == t["norm"]
        for part in ("state", "optim"):
            assert s[part].keys() == t[part].keys() and s[part]
            for k in s[part]:
                assert torch.equal(s[part][k], t[part][k]), (rank, part, k)
        refused = r["refused"]
        assert refused["offload"] is None  # colocated offload moves every layout's state
        assert "use weight_format='dcp'" in refused["hf_with_optim"]
        assert f"with_optim=False under actor.dta.sharding={mode}" in \
            refused["dcp_without_optim"]
        assert "forward_backward_batch(forward_only=False)" in refused["forward_backward"]
        # another mode's checkpoint loads (the logical view): tests/test_resume_front_doors.py
    # the optimizer state is sharded: each rank holds half of a replica's (AdamW: 2 / param)
    sizes = [sum(v.numel() for v in r["straight"]["optim"].values()) for r in res]
    replica = 2 * sum(v.numel() for v in res[0]["straight"]["state"].values())
    assert all(n <= 0.55 * replica for n in sizes), (sizes, replica)


def test_sharding_is_resolved_as_fsdp_dn_means_it():
    def mode(option, world, C=1, trains=True):
        return layout_of(option, world=world, context_parallel=C, trains=trains).sharding

    assert mode(None, 1) == "replicate"
    assert mode("fsdp", 1) == "replicate"  # one rank: nothing to shard
    assert mode(None, 2) == "fsdp"  # AReaL's fsdp:d2
    assert mode(None, 2, C=2) == "replicate"  # fsdp:d1c2: one data-parallel rank
    assert mode(None, 4, C=2) == "fsdp"  # fsdp:d2c2
    assert mode("zero1", 2, C=2) == "zero1"  # given: over the whole world
    assert mode(None, 2, trains=False) == "replicate"  # a reference model
    assert mode("replicate", 4) == "replicate"
    assert mode("zero1", 4) == "zero1"
    with pytest.raises(ValueError, match="needs an optimizer"):
        layout_of("zero1", world=2, trains=False)
    with pytest.raises(ValueError, match="actor.dta.sharding"):
        layout_of("zero3", world=2)
    with pytest.raises(ValueError, match="unknown DTA sharding 'zero3'"):
        DTAOptions(sharding="zero3")

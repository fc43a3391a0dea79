"""Sharded training (runtime.sharding) on 2 gloo ranks, as the Ray worker runs it
(``DFSWorker`` in spawned processes, a file:// store on loopback): parameters after 2 steps
equal one process's (float64 <= 1e-12, float32 <= 1e-6 relative L2) for zero1 (both memory
policies) and fsdp (recompute; retain and branched trees: tests/test_sharding_retain.py);
zero1's collectives per step do not grow with the tree; a
DCP checkpoint resumed by fresh workers continues bit-identically."""
from __future__ import annotations

import os

import pytest
import torch

from dta.config.schema import ConfigError, load_config
from experiments.local_ranks import run_ranks
from tests.workers import state, trainer_state

CASES = [("zero1", "float64", "retain"), ("zero1", "float32", "recompute"),
         ("zero1", "float64", "recompute"), ("zero1", "float32", "retain"),
         ("fsdp", "float64", "recompute"), ("fsdp", "float32", "recompute")]
TOL = {"float64": 1e-12, "float32": 1e-6}


def overrides(mode, dtype, policy):
    return ["workload.scale=tiny", f"model.dtype={dtype}", f"walker.policy={policy}",
            f"train.sharding={mode}", "optimizer.lr=1e-3", "optimizer.max_grad_norm=0.5"]


def _worker(cfg, rank, world):
    from tests.workers import local_worker

    return local_worker(cfg, rank, world, truly_float64=True)  # HF norms upcast otherwise


def _step(w, cfg, k, rank, world, source=None):
    """Step k: the batch's trees balanced over the data-parallel groups (of
    ``train.context_parallel`` ranks each); every rank of a group gets its group's share, as
    the Ray trainer hands them out."""
    from dta.losses import batch_totals
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from dta_cli.batches import BatchSource

    cp = int(cfg.train.context_parallel)
    batch = (source or BatchSource(cfg, 512)).batch(k)
    ids = assign_workers(PrefixTree(batch.input_ids), world // cp).workers[rank // cp]
    return w.step(k, batch.subset(ids) if ids else None, batch_totals(batch))


def rel_l2(a, b):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


# ------------------------------------------------------------------- on the ranks --
def train_cases(rank, world, cases):
    out = []
    for case in cases:
        cfg = load_config(None, overrides(*case))
        w = _worker(cfg, rank, world)
        stats = [_step(w, cfg, k, rank, world) for k in range(2)]
        out.append({"state": state(w)["model"], "param_norm": w.param_norm(),
                    "state_bytes": stats[-1]["state_bytes"], "sharding": stats[-1]["sharding"]})
    return out


def count_collectives(rank, world):
    """zero1's collectives in one step, for a small batch and one with ~10x the nodes."""
    import torch.distributed as dist

    from dta.batch import Batch
    from dta.tree import PrefixTree
    from dta_cli.batches import BatchSource

    cfg = load_config(None, overrides("zero1", "float32", "retain"))
    src = BatchSource(cfg, 512)

    class Big:  # fourteen generated batches in one (10x the nodes)
        def batch(self, k):
            return Batch.from_records([r for s in range(14) for r in src.records(k + s)])

    counts, nodes = [], []
    names = ("all_reduce", "reduce_scatter_single", "all_gather_single", "broadcast",
             "all_gather", "reduce_scatter_tensor", "all_gather_into_tensor", "barrier")
    for source in (src, Big()):
        w = _worker(cfg, rank, world)
        calls = {"n": 0}
        saved = {n: getattr(dist, n) for n in names}

        def counting(fn):
            def wrapped(*a, **kw):
                calls["n"] += 1
                return fn(*a, **kw)
            return wrapped

        for n in names:
            setattr(dist, n, counting(saved[n]))
        try:
            _step(w, cfg, 0, rank, world, source)
        finally:
            for n in names:
                setattr(dist, n, saved[n])
        counts.append(calls["n"])
        nodes.append(len(PrefixTree(source.batch(0).input_ids)))
    return {"counts": counts, "nodes": nodes}


def resume_cases(rank, world, cases, directory):
    """Uninterrupted: steps 0, 1. Interrupted: step 0, save, then fresh workers load and
    run step 1. Returns both final states (model and this rank's optimizer state)."""
    out = []
    for case in cases:
        cfg = load_config(None, overrides(*case))
        w = _worker(cfg, rank, world)
        _step(w, cfg, 0, rank, world)
        path = w.save_checkpoint(os.path.join(directory, case[0]), 1, {"note": "test"})
        _step(w, cfg, 1, rank, world)
        straight = state(w)
        fresh = _worker(cfg, rank, world)  # the replacement workers
        meta = fresh.load_checkpoint(path)
        _step(fresh, cfg, 1, rank, world)
        out.append({"straight": straight, "resumed": state(fresh), "meta": meta,
                    "files": sorted(os.listdir(path))})
    return out


# ------------------------------------------------------------------------- tests --
def _one_process(case, export=None, make_overrides=None):
    """The same 2 steps in this process (replicated, W = 1); optionally its HF export."""
    threads = torch.get_num_threads()
    try:
        cfg = load_config(None, (make_overrides or overrides)(*case))
        w = _worker(cfg, 0, 1)
        for k in range(2):
            _step(w, cfg, k, 0, 1)
        if export:
            w.export_hf(export)
        return state(w)["model"], w.param_norm()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["zero1", "fsdp"])
def test_two_sharded_ranks_match_one_process(mode):
    cases = [c for c in CASES if c[0] == mode]
    results = run_ranks(train_cases, 2, cases)
    for i, case in enumerate(cases):
        ref, ref_norm = _one_process(case)
        for rank in (0, 1):
            got = results[rank][i]
            assert got["sharding"] == mode
            err = rel_l2(got["state"], ref)
            assert err <= TOL[case[1]], f"{case} rank {rank}: relative L2 {err:.3g}"
            assert got["param_norm"] == pytest.approx(ref_norm, rel=TOL[case[1]])
        # the sharded state really is sharded: half the optimizer state of a replica
        opt = results[0][i]["state_bytes"]["optimizer"]
        full = 2 * sum(v.numel() * v.element_size() for v in ref.values())
        assert opt <= 0.55 * full, (case, opt, full)


def test_zero1_collectives_do_not_grow_with_the_tree():
    res = run_ranks(count_collectives, 2)[0]
    small, big = res["counts"]
    assert res["nodes"][1] >= 10 * res["nodes"][0], res["nodes"]
    assert small == big and small <= 8, res


def test_dcp_resume_is_bit_identical(tmp_path):
    from tests.test_runtime import assert_identical

    cases = [("zero1", "float32", "retain"), ("fsdp", "float32", "recompute")]
    results = run_ranks(resume_cases, 2, cases, str(tmp_path))
    for rank in (0, 1):
        for case, got in zip(cases, results[rank]):
            assert got["meta"]["step"] == 1 and got["meta"]["sharding"] == case[0]
            assert got["meta"]["world_size"] == 2 and ".metadata" in got["files"]
            assert_identical(got["resumed"], got["straight"], f"{case} rank {rank}")


def test_sharding_mode_is_checked_and_fsdp_takes_both_policies():
    with pytest.raises(ConfigError, match="train.sharding"):
        load_config(None, ["train.sharding=zero3"])
    for policy in ("retain", "recompute"):  # fsdp + retain: tests/test_sharding_retain.py
        assert load_config(None, overrides("fsdp", "float32", policy)).walker.policy == policy


# --------------------------------------------------------------- as Ray workers --
@pytest.mark.ray
def test_ray_zero1_matches_one_process_and_resumes_bit_identically(tmp_path):
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime import StepFailed, Trainer, start_or_join
    from tests.test_runtime import assert_identical

    case = ("zero1", "float32", "recompute")
    cfg = load_config(None, overrides(*case) + [
        "ray.num_workers=2", "ray.object_store_memory=104857600",
        f"train.checkpoint_dir={tmp_path / 'ckpt'}"])
    source = BatchSource(cfg, 512)
    b0, b1 = source.batch(0), source.batch(1)
    handle = start_or_join(cfg.ray)
    try:
        with Trainer(cfg) as straight:
            straight.step(b0, 0)
            stats = straight.step(b1, 1)
            reference = trainer_state(straight, 0)
            norms = straight.param_norms()
        with Trainer(cfg, fault={"rank": 1, "step": 1}) as trainer:
            trainer.step(b0, 0)
            path = trainer.save()
            assert sorted(n for n in os.listdir(path) if n.endswith(".distcp"))  # DCP shards
            with pytest.raises(StepFailed, match="worker 1"):
                trainer.step(b1, 1)  # rank 1 dies before the reduce-scatter
            trainer.fault = None
            meta = trainer.recover()  # fresh workers, DCP checkpoint of step 1
            assert meta["step"] == 1 and meta["sharding"] == "zero1"
            trainer.step(b1, 1)
            resumed = trainer_state(trainer, 0)
    finally:
        handle.shutdown()
    assert_identical(resumed["model"], reference["model"], "resumed vs uninterrupted")
    assert_identical(resumed["optimizer"], reference["optimizer"], "optimizer shard")
    one, one_norm = _one_process(case)
    assert rel_l2(reference["model"], one) <= TOL["float32"]
    assert norms[0] == norms[1] == pytest.approx(one_norm, rel=1e-6)
    for w in stats.workers:  # what `dta train --json` reports per worker
        assert w["sharding"] == "zero1" and set(w["state_bytes"]) == {"params", "grads",
                                                                       "optimizer", "host"}
    full = 2 * sum(v.numel() * v.element_size() for v in one.values())
    assert stats.workers[0]["state_bytes"]["optimizer"] <= 0.55 * full


def test_dcp_checkpoint_is_checksummed_and_found_for_resume(tmp_path):
    """A sharded checkpoint carries the manifest (written before the rename): the Ray
    runtime's resume finds it, and a flipped byte in a shard is refused naming the file
    before DCP reads anything."""
    from runtime.checkpoints.checkpoint import CheckpointError, latest_checkpoint, read_meta
    from runtime.checkpoints.sharded import load_sharded, save_sharded

    state = {"w": torch.arange(64, dtype=torch.float64)}
    path = save_sharded(str(tmp_path), 3, state, meta={"run_id": "r1"})
    assert os.path.isfile(os.path.join(path, "manifest.json"))
    assert latest_checkpoint(str(tmp_path)) == path and read_meta(path)["step"] == 3
    into = {"w": torch.zeros(64, dtype=torch.float64)}
    load_sharded(path, into)
    assert torch.equal(into["w"], state["w"])
    shard = next(n for n in os.listdir(path) if n.endswith(".distcp"))
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    into = {"w": torch.zeros(64, dtype=torch.float64)}
    with pytest.raises(CheckpointError, match=shard):
        load_sharded(path, into)
    assert not into["w"].any()  # nothing was read into the state


@pytest.mark.parametrize("mode", ["replicate", "zero1"])
def test_buffers_are_raised_to_the_compute_dtype_never_lowered(mode, tmp_path):
    """RoPE's ``inv_freq`` (built float32 by Hugging Face whatever the model's dtype) is held in
    float64 by a float64 engine core in every sharding mode (the float64 harness computes RoPE
    in its dtype on transformers before 5.19), and stays float32 under bf16 compute with fp32
    masters (replicate once rounded it to bf16 with the parameters)."""
    from dta.model.models import build_model, load_model
    from dta.options import WalkOptions
    from runtime.engine.core import EngineCore
    from runtime.engine.layout import ParallelLayout

    build_model("qwen3", "tiny", dtype="float32").save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float64")  # what a front door loads
    assert {b.dtype for n, b in loaded.named_buffers() if "inv_freq" in n} == {torch.float32}
    def buffers(compute, masters=None):
        core = EngineCore(lambda dtype: load_model(str(tmp_path), dtype=dtype),
                          layout=ParallelLayout(sharding=mode, world=2 if mode != "replicate"
                                                else 1), walk=WalkOptions(),
                          make_optimizer=lambda ps: torch.optim.SGD(list(ps), lr=0.1),
                          compute_dtype=compute, master_dtype=masters)
        if mode == "replicate":  # one rank: its sharding mode too (the others cast parameters)
            core.parallelize()
        params = {p.dtype for p in core.model.parameters()}
        return params, {n: b.dtype for n, b in core.model.named_buffers() if "inv_freq" in n}

    params, bufs = buffers(torch.float64)
    assert params == {torch.float64} and bufs and set(bufs.values()) == {torch.float64}, bufs
    params, bufs = buffers(torch.bfloat16, torch.float32)
    assert set(bufs.values()) == {torch.float32}, bufs
    assert params == ({torch.bfloat16} if mode == "replicate" else {torch.float32})

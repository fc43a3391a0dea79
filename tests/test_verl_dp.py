"""The dta verl engine over 2 gloo ranks and across a checkpoint (float64): two ``train_batch``
steps with the batch's rows split over 2 ranks give the parameters one process gives
(rel. <= 1e-10), and on each rank a DCP checkpoint taken after step 1, loaded into a fresh
engine, continues step 2 bit-identically (parameters, optimizer state, learning rate)."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.test_verl import (  # noqa: F401
    VOCAB,
    fp64_verl,
    grpo,
    make_engine,
    model_dir,
    params,
    records,
    rel,
    verl_batch,
)

pytestmark = pytest.mark.verl

MODE = "seq-mean-token-mean"  # normalized by the global batch size: the rank split matters


def _steps(engine, halves, loss, ckpt: str | None = None):
    """Step 1 on ``halves[0]``, a checkpoint, step 2 on ``halves[1]`` (LR scheduler stepped)."""
    for step, td in enumerate(halves, start=1):
        out = engine.train_batch(td.clone(), loss_function=loss)
        assert out["metrics"]["grad_norm"] > 0
        engine.lr_scheduler_step()
        if step == 1 and ckpt is not None:
            engine.save_checkpoint(ckpt, global_step=1)


def _optimizer_state(engine) -> list[torch.Tensor]:
    out = []
    for p in engine.module.parameters():
        for k, v in sorted(engine.optimizer.state[p].items()):
            out.append(torch.as_tensor(v).detach().clone())
    return out


def _fp64_verl():
    from verl.utils import torch_dtypes

    original = torch_dtypes.PrecisionType.to_dtype
    if getattr(original, "dta_fp64", False):
        return
    def to_dtype(p):
        return torch.float64 if p == "fp64" else original(p)
    to_dtype.dta_fp64 = True
    torch_dtypes.PrecisionType.to_dtype = staticmethod(to_dtype)


def _rank_run(rank: int, path: str, rows: list, tmp: str) -> dict:
    """Rank ``rank`` of 2: the two steps with a checkpoint after step 1, then a fresh engine
    from that checkpoint repeating step 2; its parameters and whether the resume matched."""
    import torch.distributed as dist

    from experiments.workloads import make_workload

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=2)
    try:
        recs = make_workload("tau2-airline", scale="tiny", seed=0, vocab_size=VOCAB).records
        loss = grpo(MODE)
        halves = [_rank_half(recs, step_rows, rank) for step_rows in rows]
        ckpt = os.path.join(tmp, "ckpt")
        engine = make_engine("dta", path, "fp64")
        _steps(engine, halves, loss, ckpt)
        fresh = make_engine("dta", path, "fp64")
        fresh.load_checkpoint(ckpt)
        _steps(fresh, halves[1:], loss)
        same = all(torch.equal(a, b) for a, b in zip(params(engine).values(),
                                                     params(fresh).values()))
        same_opt = all(torch.equal(a, b) for a, b in zip(_optimizer_state(engine),
                                                         _optimizer_state(fresh)))
        same_lr = engine.lr_scheduler.get_last_lr() == fresh.lr_scheduler.get_last_lr()
        return dict(params=params(engine), resumed=(same, same_opt, same_lr))
    finally:
        dist.destroy_process_group()


def _child(_index: int, path: str, rows: list, tmp: str):
    """Rank 1, in a spawned process (the test process is rank 0)."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    from runtime.verl import use_cpu_platform

    _fp64_verl()
    use_cpu_platform()
    torch.save(_rank_run(1, path, rows, tmp), os.path.join(tmp, "rank1.pt"))


def _rank_half(recs, step_rows, rank):
    """This rank's rows of the step's batch, split after verl's conversion (so the non-tensor
    ``max_response_len`` and ``global_batch_size`` are the whole batch's, as verl's dispatch
    leaves them)."""
    from verl.utils import tensordict_utils as tu

    whole = verl_batch(recs, rows=step_rows)
    n = len(step_rows)
    mine = list(range(n))[: (n + 1) // 2] if rank == 0 else list(range(n))[(n + 1) // 2:]
    return tu.index_select_tensor_dict(whole, mine)


STEPS = [[0, 1, 2, 3, 4, 5, 6, 7, 8], [8, 6, 4, 2, 0, 1, 3]]  # two batches of the 9 rows


def test_two_gloo_ranks_equal_one_process_and_resume_bit_identically(
        model_dir, records, fp64_verl, tmp_path, monkeypatch):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from runtime.verl import use_cpu_platform

    use_cpu_platform()
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/one", rank=0, world_size=1)
    try:
        one = make_engine("dta", model_dir, "fp64")
        initial = params(one)
        _steps(one, [verl_batch(records, rows=r) for r in STEPS], grpo(MODE))
        want = params(one)
    finally:
        dist.destroy_process_group()

    tmp = str(tmp_path / "ranks")
    os.makedirs(tmp)
    monkeypatch.setenv("WORLD_SIZE", "2")
    child = mp.start_processes(_child, args=(model_dir, STEPS, tmp), nprocs=1, join=False,
                               start_method="spawn")
    try:
        results = [_rank_run(0, model_dir, STEPS, tmp)]
    finally:
        while not child.join():
            pass
    results.append(torch.load(os.path.join(tmp, "rank1.pt")))
    for r, res in enumerate(results):
        assert res["resumed"] == (True, True, True), \
            f"rank {r}: resumed step 2 not bit-identical (params, optimizer, lr)"
        worst = max((rel(res["params"][k], want[k]), k) for k in want)
        assert worst[0] <= 1e-10, f"rank {r}: {worst[1]} rel. error {worst[0]:.3e}"
    # the two ranks hold one model, and the steps moved it
    assert all(torch.equal(results[0]["params"][k], results[1]["params"][k]) for k in want)
    assert max(rel(want[k], initial[k]) for k in want) > 1e-6

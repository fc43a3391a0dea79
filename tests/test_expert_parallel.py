"""Expert parallelism under the walk (docs/expert-parallel.md): ``train.expert_parallel=E``
on local gloo ranks, as ``dta train``'s workers run it (``DFSWorker``, the engine core),
against the same worker in one process (which equals per-sequence training: tests/test_moe.py)
in float64: log-probs (a forward-only walk, ``EngineCore.logprobs``), the loss, every
gradient after the reduction, and the parameters and their norm after 2 AdamW steps, all
<= 1e-10 -- with replayed routing and the router aux loss, on a batch with fully masked fork
tails. Each rank walks a different tree (the data-parallel groups' shares), so the ranks'
decoder calls are matched by the lockstep (``runtime.engine.lockstep``) and the owners serve
the backward of whichever call a peer backpropagates (``dta.model.expert_parallel``): under
retain, B rounds where one rank backpropagates and another makes a dummy call happen
(checked), and the Hugging Face export (the slices gathered) equals one process's. The
default suite runs E = 2 (qwen3_moe retain in blocks, mixtral recompute in packs); ``-m slow``
runs E = 2 and 4 x qwen3_moe, mixtral x retain, recompute x packs,
blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.test_sharding import _step, _worker, rel_l2
from tests.workers import state

TOL = 1e-10
STEPS = 2


def overrides(family, policy, block, expert_parallel=1, mode="replicate", cp=1, shard=None,
              offload="none"):
    return ["workload.scale=tiny", "model.dtype=float64", f"walker.policy={policy}",
            f"walker.block_tokens={block}", f"train.sharding={mode}", "optimizer.lr=1e-3",
            "optimizer.max_grad_norm=0.5", f"model.family={family}",
            "actor.router_aux_loss_coef=0.01", f"train.expert_parallel={expert_parallel}",
            f"train.context_parallel={cp}", f"train.offload={offload}"] + (
        [f"train.shard_size={shard}"] if shard is not None else [])


class RoutedTails:
    """The generated batch plus a small tree whose fork tails carry no trained token (packs
    reached by the aux loss only), every sequence with a replayed routing (a function of its
    prefix, mostly not the router's choice)."""

    def __init__(self, cfg):
        from dta_cli.batches import BatchSource

        self.source, self.family = BatchSource(cfg, 512), str(cfg.model.family)

    def batch(self, k):
        from dta.batch import Batch
        from dta.model.models import build_config
        from dta.model.routing import synthetic_routing
        from tests.cases import make_records
        from tests.test_moe import small_sequences

        recs = make_records(small_sequences(seed=k), prompt=4)
        for i, r in enumerate(recs):
            r["logprobs"], r["group_id"] = r.pop("old_logprobs"), 1000 + i
            del r["prox_logprobs"]
            if i < 3:
                r["loss_mask"][-2:] = 0
        records = list(self.source.records(k)) + recs
        c = build_config(self.family, "tiny")
        n = getattr(c, "num_local_experts", None) or c.num_experts
        routed = synthetic_routing([r["input_ids"] for r in records], c.num_hidden_layers,
                                   c.num_experts_per_tok, n, seed=k)
        for r, x in zip(records, routed):
            r["routed_experts"] = x
        return Batch.from_records(records)


def share(batch, cfg, rank, world):
    """This rank's share of a batch (the trees balanced over the data-parallel groups)."""
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree

    cp = int(cfg.train.context_parallel)
    ids = assign_workers(PrefixTree(batch.input_ids), world // cp).workers[rank // cp]
    return ids, (batch.subset(ids) if ids else None)


def run_case(rank, world, case, export=None):
    """2 steps on this rank; the first step's batch's log-probs before it, every reduced
    gradient of the first step (before clipping, as the mode holds it); ``export``: then the
    Hugging Face export into that folder (every rank: the expert slices are gathered)."""
    cfg = load_config(None, overrides(*case))
    w = _worker(cfg, rank, world)
    source = RoutedTails(cfg)
    ids, mine = share(source.batch(0), cfg, rank, world)
    logprobs = w.core.logprobs(mine).logprobs if mine is not None else []  # every rank: matched
    mode, grads = w.core.sharding, {}
    reduce = mode.reduce_gradients

    def reduce_and_capture():
        reduce()
        grads.setdefault("first", reduced_gradients(mode))

    mode.reduce_gradients = reduce_and_capture
    stats = [_step(w, cfg, k, rank, world, source) for k in range(STEPS)]
    mode.reduce_gradients = reduce
    if export is not None:
        w.export_hf(export)
    sync = w.core.sync
    return {"state": state(w)["model"], "param_norm": w.param_norm(), "grads": grads["first"],
            "loss": stats[0]["loss"], "logprobs": dict(zip(ids, logprobs)),
            "sent": [s["expert_parallel_sent_bytes"] for s in stats],
            "lockstep": sync.stats() if sync is not None else None,
            "slices": expert_slices(w.core)}


def reduced_gradients(mode) -> dict:
    """Every reduced gradient as the mode holds it after its reduction (a collective: flat
    shards gathered over their groups, FSDP's DTensors over the world); an expert slice's
    stays the slice."""
    from dta.model.collectives import all_gather_single

    if mode.name == "replicate":
        return {n: p.grad.detach().clone() for n, p in zip(mode.names, mode.stepped)
                if p.grad is not None}
    out = {}
    for f in (getattr(mode, a, None) for a in ("shards", "vocab", "expert_shards")):
        if f is None:
            continue
        mine = torch.zeros(f.chunk, dtype=f.master_dtype)
        mine[: f.hi - f.lo].copy_(f.grad_shard)
        full = torch.empty(f.chunk * f.world, dtype=f.master_dtype)
        if f.world > 1:
            all_gather_single(full, mine, group=f.group)
        else:
            full = mine
        for i, (name, p) in enumerate(zip(f.names, f.params)):
            out[name] = full[f.offsets[i]:f.offsets[i + 1]].view(p.shape).clone()
    if mode.name in ("fsdp", "zero2"):
        out.update({n: g.full_tensor().detach().clone()
                    for n, g in zip(mode.names, mode.layer_part.gradients()) if g is not None})
    return out


def expert_slices(core) -> dict:
    """name -> (first, stop) of the expert slices this rank holds."""
    from dta.model.expert_parallel import expert_parallel_of

    ep = expert_parallel_of(core.model)
    if ep is None:
        return {}
    return {n: ep.slice_of(p)[:2] for n, p in core.model.named_parameters() if ep.is_expert(p)}


def on_ranks(rank, world, cases, export=None):
    torch.set_num_threads(1)
    return [run_case(rank, world, case, export if i == 0 else None)
            for i, case in enumerate(cases)]


def one_process(case, export=None):
    """The case in one process: replicate, no expert or context parallelism."""
    threads = torch.get_num_threads()
    try:
        family, policy, block = case[:3]
        out = run_case(0, 1, (family, policy, block), export)
    finally:
        torch.set_num_threads(threads)
    if export is not None:  # the expert-parallel export (slices gathered) equals this one
        from safetensors.torch import load_file

        ep, one = (load_file(f"{d}/model.safetensors") for d in (export[:-4], export))
        assert set(ep) == set(one), sorted(set(ep) ^ set(one))
        err = rel_l2(ep, one)
        assert err <= TOL, f"{case}: export vs one process's: relative L2 {err:.3g}"
    return out


def compare(case, ranks, ref) -> float:
    """The worst relative error of every check; raises naming the first that fails."""
    worst = 0.0

    def check(what, err):
        nonlocal worst
        worst = max(worst, err)
        if not err <= TOL:
            raise AssertionError(f"{case}: {what}: relative error {err:.3g}")

    logprobs = {}
    for got in ranks:
        logprobs.update(got["logprobs"])
    assert sorted(logprobs) == sorted(ref["logprobs"]), case
    for i, lp in ref["logprobs"].items():
        got = torch.as_tensor(np.asarray(logprobs[i]))
        check(f"log-probs of sequence {i} (absolute)",
              float((got - torch.as_tensor(np.asarray(lp))).abs().max()))
    check("loss", abs(sum(g["loss"] for g in ranks) - ref["loss"]) / abs(ref["loss"]))
    for rank, got in enumerate(ranks):
        assert got["slices"], f"{case} rank {rank}: no expert slices"
        for name, g in ref["grads"].items():
            first, stop = got["slices"].get(name, (None, None))
            want = g if first is None else g[first:stop]
            check(f"rank {rank} gradient of {name}", rel_l2({name: got["grads"][name]},
                                                            {name: want}))
        check(f"rank {rank} parameters after {STEPS} steps", rel_l2(got["state"], ref["state"]))
        check(f"rank {rank} parameter norm",
              abs(got["param_norm"] - ref["param_norm"]) / ref["param_norm"])
        assert all(s > 0 for s in got["sent"]), (case, rank, got["sent"])
    return worst


def run_and_compare(world, cases, export=None) -> list:
    """Every case on ``world`` ranks against one process (``export``: the first case's
    Hugging Face export written there, checked to be its whole state); returns the
    lockstep's stats."""
    results = run_ranks(on_ranks, world, cases, export, timeout=900.0)
    locks = []
    for i, case in enumerate(cases):
        ranks = [results[r][i] for r in range(world)]
        ref = one_process(case, export + "-one" if export is not None and i == 0 else None)
        err = compare(case, ranks, ref)
        lock = ranks[0]["lockstep"]
        spans = case[3] > 1 and (case[5] if len(case) > 5 else 1) % case[3] != 0
        matched = spans or (len(case) > 4 and case[4] == "fsdp")
        assert (lock is not None) == matched, (case, lock)  # the calls matched where needed
        if matched and case[1] == "retain":  # kept graphs backpropagated in B rounds
            assert lock["B"] > 0, (case, lock)
        locks.append(lock)
        print(f"{case}: worst relative error {err:.2g}, sent per step "
              f"{[g['sent'] for g in ranks]} bytes, lockstep {lock}")
    return locks


DEFAULT = [("qwen3_moe", "retain", 8, 2), ("mixtral", "recompute", 0, 2)]
MATRIX = [(family, policy, block, E) for E in (2, 4) for family in ("qwen3_moe", "mixtral")
          for policy in ("retain", "recompute") for block in (0, 8)]


def test_expert_parallel_2_matches_one_process(tmp_path):
    locks = run_and_compare(2, DEFAULT, export=str(tmp_path / "export"))
    # retain: a rank backpropagated a kept graph while its peer made a dummy call (the peer
    # matched the dummy's forward exchanges and served the backward)
    assert locks[0]["mixed_backwards"] > 0, locks[0]


@pytest.mark.slow
@pytest.mark.parametrize("E", [2, 4])
def test_expert_parallel_matrix(E):
    run_and_compare(E, [c for c in MATRIX if c[3] == E and c not in DEFAULT])


# E = 2 with HSDP (shard groups of 2 of the 4 ranks, replicated across) and optimizer offload:
# (family, policy, block, E, sharding, C, shard size, offload)
WITH_HSDP = [("qwen3_moe", "recompute", 8, 2, "zero1", 1, 2, "optimizer"),
             ("mixtral", "retain", 0, 2, "fsdp", 1, 2, "none"),
             ("qwen3_moe", "retain", 0, 2, "fsdp", 1, 2, "optimizer")]


@pytest.mark.parametrize("case", [WITH_HSDP[0], *(pytest.param(c, marks=pytest.mark.slow)
                                                   for c in WITH_HSDP[1:])])
def test_expert_parallel_with_hsdp_and_offload(case):
    """The expert slices' flat shards over their replicas beside HSDP's dense shards (summed
    across the shard groups once per step), the masters and optimizer state on the host:
    4 ranks equal one process."""
    run_and_compare(4, [case])

"""One engine core behind the front doors (runtime/engine): the same batches trained for 2
steps through a front door on every layout -- replicate, zero1, fsdp; context parallel C = 1
and 2; expert parallel E = 2 on an MoE model (qwen3_moe) -- on 2 local gloo ranks end at the
parameters the same front door reaches in one process (float64 <= 1e-10 relative L2, and the
parameter norm), with C = 2's path attention and E = 2's routed rows really exchanged between
the ranks; and on 4 ranks HSDP 2 x 2 (fsdp), HSDP + optimizer offload (zero1) and offload
(replicate), each front door spelling them its way (``train.shard_size`` / ``train.offload``;
verl's ``fsdp_size`` / ``optimizer_offload``; AReaL's ``actor.dta.shard_size`` /
``actor.dta.offload``); fsdp's node-resident gathers and prefetch likewise
(``train.node_resident`` / ``train.prefetch``; verl's ``dta_node_resident`` /
``forward_prefetch``; AReaL's ``actor.dta.node_resident`` / ``actor.dta.prefetch``).

A front door is an entry of ``FRONT_DOORS``: ``train(rank, world, mode, C, E, moe)`` runs 2
steps through it on this rank and returns ``{"state", "param_norm", "layout", "sent",
"expert_sent"}`` (E through the door's own key: ``train.expert_parallel``, AReaL's allocation
``e``, verl's ``expert_parallel_size``); the reference is ``train(0, 1, "replicate", 1, 1,
moe)``. The Ray worker (``DFSWorker``, without Ray) is
the first, verl's ``DTAEngine`` the second and AReaL's ``DTATrainEngine`` the third (the run
config's batches, loss and optimizer as each writes them -- AReaL: ``fsdp:dNcM`` +
``actor.dta.sharding``, its padded batches, DTA's PPO through its ``loss_fn`` /
``loss_weight_fn``; each one process also ends where the Ray worker's does:
``test_front_doors_agree``). A door that needs an optional extra skips, saying so, where it
is not installed."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from runtime.sharding import SHARDINGS
from tests.workers import state

WORLD = 2
LAYOUTS = [(mode, cp) for cp in (1, 2) for mode in SHARDINGS]
EXPERT_LAYOUTS = [(mode, 1, 2) for mode in SHARDINGS]  # (mode, C, E) on qwen3_moe
TOL = 1e-10


def _rel_l2(a, b):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


# ------------------------------------------------------------------ front doors --
def run_config(world, mode, cp, ep=1, moe=False, shard=None, offload="none", extra=()):
    """What every front door trains: ``dta train``'s run config (blocks of 16 tokens: the
    paths span several packs, so C = 2 spreads their K/V); ``moe``: the tiny Qwen3-MoE;
    ``shard``: HSDP's shard size (``train.shard_size``), ``offload``: ``train.offload``;
    ``extra``: further ``train.key=value`` overrides (tests/layouts.py)."""
    return load_config(None, ["workload.scale=tiny", "model.dtype=float64",
                              "walker.policy=recompute", "walker.block_tokens=16",
                              "optimizer.lr=1e-3", "optimizer.max_grad_norm=0.5",
                              f"train.sharding={mode}", f"ray.num_workers={world}",
                              f"train.context_parallel={cp}", f"train.expert_parallel={ep}",
                              f"train.offload={offload}",
                              *(["model.family=qwen3_moe"] if moe else []),
                              *([f"train.shard_size={shard}"] if shard is not None else []),
                              *extra])


def ray_worker(rank, world, mode, cp, ep=1, moe=False, shard=None, offload="none",
               extra=()):
    """``dta train``'s worker: the run config, the driver's resolved settings, 2 steps of
    the driver's batches (the trees balanced over the data-parallel groups)."""
    from tests.test_sharding import _step
    from tests.workers import local_worker

    cfg = run_config(world, mode, cp, ep, moe, shard, offload, extra)
    w = local_worker(cfg, rank, world, truly_float64=True)
    stats = [_step(w, cfg, k, rank, world) for k in range(2)]
    assert all(s["updated"] for s in stats)
    return {"state": state(w)["model"], "param_norm": w.param_norm(),
            "loss": [s["loss"] for s in stats],  # this rank's share of each step's loss
            "layout": w.core.layout, "sent": sum(s["context_parallel_sent_bytes"] for s in stats),
            "expert_sent": sum(s["expert_parallel_sent_bytes"] for s in stats)}


def verl_engine(rank, world, mode, cp, ep=1, moe=False, shard=None, offload="none",
                extra=()):
    """verl's ``DTAEngine`` (``strategy: dta``; ``dta_sharding``,
    ``ulysses_sequence_parallel_size``, ``fsdp_size``, ``optimizer_offload``,
    ``dta_node_resident``, ``forward_prefetch``): the run config's
    model, batches, loss and optimizer as verl writes them, 2 ``train_batch`` steps
    (tests/test_verl_layouts.py: front_door)."""
    from tests.test_verl_layouts import front_door

    cfg = run_config(world, mode, cp, ep, moe, shard, offload, extra)
    return front_door(rank, world, mode, cp, cfg, ep)


def areal_engine(rank, world, mode, cp, ep=1, moe=False, shard=None, offload="none",
                 extra=()):
    """AReaL's ``DTATrainEngine`` (``fsdp:d{W/C}c{C}`` + ``actor.dta.sharding`` /
    ``shard_size`` / ``offload`` / ``node_resident`` / ``prefetch``): the run config's
    model, batches, loss and optimizer as AReaL writes them, 2 ``train_batch`` steps
    (tests/areal_front_door.py)."""
    from tests.areal_front_door import front_door

    cfg = run_config(world, mode, cp, ep, moe, shard, offload, extra)
    return front_door(rank, world, mode, cp, cfg, ep)


FRONT_DOORS = {"ray_worker": ray_worker, "verl": verl_engine, "areal": areal_engine}
# the optional extras a door needs (absent: that door's cases skip, saying so)
EXTRAS = {"verl": "verl", "areal": "areal"}


# ------------------------------------------------------------------------ tests --
def _on_ranks(rank, world, door, layouts, moe=False):
    torch.set_num_threads(1)
    return [FRONT_DOORS[door](rank, world, mode, cp, *rest, moe=moe)
            for mode, cp, *rest in layouts]


def _reference(door, moe=False):
    threads = torch.get_num_threads()
    try:
        return FRONT_DOORS[door](0, 1, "replicate", 1, 1, moe=moe)
    finally:
        torch.set_num_threads(threads)


def _doors(*skip):
    out = []
    for door in FRONT_DOORS:
        if door in skip:
            continue
        extra = EXTRAS.get(door)
        missing = extra is not None and importlib.util.find_spec(extra) is None
        out.append(pytest.param(door, marks=pytest.mark.skipif(
            missing, reason=f"the optional {extra} extra is not installed")))
    return out


@pytest.mark.parametrize("door", _doors())
def test_every_layout_equals_one_process(door):
    ref = _reference(door)
    results = run_ranks(_on_ranks, WORLD, door, LAYOUTS, timeout=900.0)
    for i, (mode, cp) in enumerate(LAYOUTS):
        for rank in range(WORLD):
            got = results[rank][i]
            layout = got["layout"]
            assert (layout.sharding, layout.context_parallel, layout.rank) == (mode, cp, rank)
            assert (got["sent"] > 0) == (cp > 1), (mode, cp, rank, got["sent"])
            err = _rel_l2(got["state"], ref["state"])
            assert err <= TOL, f"{door} {mode} C={cp} rank {rank}: relative L2 {err:.3g}"
            assert got["param_norm"] == pytest.approx(ref["param_norm"], rel=TOL)
        print(f"{door} {mode} C={cp}: relative L2 vs one process "
              f"{max(_rel_l2(r[i]['state'], ref['state']) for r in results):.2g}, sent "
              f"{[r[i]['sent'] for r in results]} bytes")


@pytest.mark.parametrize("door", _doors())
def test_expert_parallel_layouts_equal_one_process(door):
    """E = 2 through the door's own key: each rank holds half of every MoE layer's experts,
    its routed rows exchanged (each rank walks its own trees: the calls matched)."""
    ref = _reference(door, moe=True)
    results = run_ranks(_on_ranks, WORLD, door, EXPERT_LAYOUTS, True, timeout=900.0)
    for i, (mode, cp, ep) in enumerate(EXPERT_LAYOUTS):
        for rank in range(WORLD):
            got = results[rank][i]
            layout = got["layout"]
            assert (layout.sharding, layout.expert_parallel, layout.rank) == (mode, ep, rank)
            assert got["expert_sent"] > 0 and got["sent"] == 0, (mode, rank, got["expert_sent"])
            err = _rel_l2(got["state"], ref["state"])
            assert err <= TOL, f"{door} {mode} E={ep} rank {rank}: relative L2 {err:.3g}"
            assert got["param_norm"] == pytest.approx(ref["param_norm"], rel=TOL)
        print(f"{door} {mode} E={ep}: relative L2 vs one process "
              f"{max(_rel_l2(r[i]['state'], ref['state']) for r in results):.2g}, routed rows "
              f"sent {[r[i]['expert_sent'] for r in results]} bytes")


# HSDP and offload on 4 ranks: (mode, shard size, offload) at C = 1
HSDP_OFFLOAD = [("fsdp", 2, "none"), ("zero1", 2, "optimizer"), ("replicate", None, "optimizer")]


def _on_four(rank, world, door, layouts):
    torch.set_num_threads(1)
    return [FRONT_DOORS[door](rank, world, mode, 1, shard=shard, offload=offload)
            for mode, shard, offload in layouts]


def _four_rank_doors():
    """The Ray worker by default; verl's and AReaL's (~50 s each on 4 ranks) under -m slow."""
    return [d if d.values[0] == "ray_worker" else
            pytest.param(*d.values, marks=(*d.marks, pytest.mark.slow)) for d in _doors()]


@pytest.mark.parametrize("door", _four_rank_doors())
def test_hsdp_and_offload_equal_one_process(door):
    """HSDP 2 x 2 (fsdp), HSDP + offload (zero1) and offload (replicate) through the front
    door on 4 ranks end where the same door ends in one process."""
    ref = _reference(door)
    results = run_ranks(_on_four, 4, door, HSDP_OFFLOAD, timeout=900.0)
    for i, (mode, shard, offload) in enumerate(HSDP_OFFLOAD):
        for rank in range(4):
            got = results[rank][i]
            layout = got["layout"]
            assert (layout.sharding, layout.shard_size, layout.offload, layout.rank) == \
                (mode, shard or 4, offload, rank)
            err = _rel_l2(got["state"], ref["state"])
            assert err <= TOL, f"{door} {mode} S={shard} {offload} rank {rank}: {err:.3g}"
            assert got["param_norm"] == pytest.approx(ref["param_norm"], rel=TOL)
        print(f"{door} {mode} shard_size={shard or 4} offload={offload} on 4 ranks: relative "
              f"L2 vs one process {max(_rel_l2(r[i]['state'], ref['state']) for r in results):.2g}")


@pytest.mark.parametrize("door", _doors("ray_worker"))
def test_front_doors_agree(door):
    """The same batches, loss and optimizer through another front door end where the Ray
    worker ends, in one process (each door's layouts equal its own one process above)."""
    ref = _reference("ray_worker")
    got = _reference(door)
    assert set(got["state"]) == set(ref["state"])
    err = _rel_l2(got["state"], ref["state"])
    assert err <= TOL, f"{door} vs ray_worker: relative L2 {err:.3g}"
    assert got["param_norm"] == pytest.approx(ref["param_norm"], rel=TOL)
    print(f"{door} vs ray_worker, one process, 2 steps: relative L2 {err:.2g}")

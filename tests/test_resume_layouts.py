"""Resuming under another layout (issue 48; runtime/checkpoints/logical.py, reshard.py): float64,
the τ²-airline tiny model, local gloo ranks as the Ray worker runs them (``DFSWorker``).

A run saves at step 2 under one layout -- fsdp on 4 ranks with context parallelism 2, zero1
on 2 ranks, replicate on 1 -- and resumes under another; after step 4 its parameters and
its optimizer state (AdamW's exp_avg, exp_avg_sq and step count per parameter, read back
independently of the checkpoint code: flat pieces, ``full_tensor()``, a replica's own
state) equal the uninterrupted run's, relative L2 <= 1e-12, and the step counts exactly.
fsdp 4 x C=2 -> zero1 2 and -> replicate 1, and zero1 2 / replicate 1 -> fsdp 4 x C=2."""
from __future__ import annotations

import math
import os

import pytest
import torch

from dta.config.schema import load_config
from experiments.local_ranks import run_ranks
from tests.layouts import LAYOUTS as MATRIX
from tests.layouts import Layout
from tests.test_sharding import _step

TOL = 1e-12
# name -> (layout, context parallel C): the issue-48 layouts by their names, and every layout
# of the one list (tests/layouts.py, under its own name, C = 1) that the runtime can do
LAYOUTS = {"fsdp4c2": (Layout("fsdp", world=4), 2), "fsdp2c2": (MATRIX["fsdp"], 2),
           "zero1w2": (MATRIX["zero1"], 1), "rep1": (Layout("replicate", world=1), 1),
           "zero2w2": (MATRIX["zero2"], 1), "zero2c2": (MATRIX["zero2"], 2),
           **{n: (lay, 1) for n, lay in MATRIX.items() if lay.refused is None}}
KEYS = ("param", "exp_avg", "exp_avg_sq")


def overrides(layout):
    lay, cp = LAYOUTS[layout]
    # blocks of 16 tokens: the paths span several packs, so under C=2 their K/V are spread
    return ["workload.scale=tiny", "model.dtype=float64", "walker.policy=recompute",
            "optimizer.lr=1e-3", "optimizer.max_grad_norm=0.5", "walker.block_tokens=16",
            f"train.context_parallel={cp}", *lay.overrides()]


def _worker(cfg, rank, world):
    from tests.workers import local_worker

    return local_worker(cfg, rank, world, truly_float64=True)  # HF norms upcast otherwise


def snapshot(w) -> list[tuple]:
    """This rank's training state as ``(name, key, first flat element, flat data)`` pieces,
    read from the mode's own storage (not through the checkpoint view): a replica's
    parameters and AdamW state, zero1's / the vocabulary's flat pieces, fsdp's layers
    gathered whole (``full_tensor``: every rank calls it, rank 0 keeps them), or under node
    residency the flat master slices of this rank's node shard."""
    mode, opt = w.core.sharding, w.core.optimizer
    out = []

    def add(name, stepped, start, whole=lambda t: t):
        out.append((name, "param", start, whole(stepped.detach()).reshape(-1).clone()))
        st = opt.state.get(stepped) or {}
        for k in KEYS[1:]:
            if k in st:
                out.append((name, k, start, whole(st[k]).reshape(-1).clone()))
        out.append((name, "step", 0, torch.tensor([float(st.get("step", 0))])))

    if mode.name == "replicate":
        for n, s in zip(mode.names, mode.stepped):
            add(n, s, 0)
    flat = getattr(mode, "shards", None) or getattr(mode, "vocab", None)
    if flat is not None:
        for mp, pc in zip(flat.master_params, flat.pieces):
            add(flat.names[pc.index], mp, pc.start)
    from runtime.sharding.node_resident import NodeResidentPart

    node = getattr(mode, "layer_part", None)
    node = node.flat if isinstance(node, NodeResidentPart) else None
    if node is not None:  # node-resident: flat slices of this rank's node shard (rows)
        for mp, pc in zip(node.master_params, node.pieces):
            p = mode.layer_part.sharded[pc.index]
            first = p.__create_chunk_list__()[0].offsets[0]  # the node shard's first row
            add(node.names[pc.index], mp, first * math.prod(p.shape[1:]) + pc.start)
    elif mode.name in ("fsdp", "zero2"):  # the layer shards, or their host masters (offload)
        for n, p in zip(mode.layer_part.names, mode.layer_part.stepped):
            add(n, p, 0, whole=lambda t: t.full_tensor())
    return out


def assemble(per_rank: list[list[tuple]], shapes: dict) -> dict:
    """Whole tensors per (name, key) from every rank's pieces; every element covered."""
    out, covered = {}, {}
    for pieces in per_rank:
        for name, key, start, data in pieces:
            n = 1 if key == "step" else int(torch.tensor(shapes[name]).prod())
            t = out.setdefault((name, key), torch.full((n,), float("nan"), dtype=torch.float64))
            t[start:start + data.numel()] = data.double()
            covered[(name, key)] = covered.get((name, key), 0) + data.numel()
    for k, t in out.items():
        if torch.isnan(t).any():
            raise AssertionError(f"{k}: not every element is held by some rank")
    return out


def compare(got: dict, ref: dict) -> dict[str, float]:
    """Relative L2 per key over all parameters; steps must be equal."""
    if set(got) != set(ref):
        raise AssertionError(f"other entries: {sorted(set(got) ^ set(ref))[:4]}")
    errs = {}
    for key in KEYS:
        num = sum(float((got[k] - ref[k]).pow(2).sum()) for k in ref if k[1] == key)
        den = sum(float(ref[k].pow(2).sum()) for k in ref if k[1] == key)
        errs[key] = (num / den) ** 0.5
    steps = {k: float(v) for k, v in got.items() if k[1] == "step"}
    ref_steps = {k: float(v) for k, v in ref.items() if k[1] == "step"}
    if steps != ref_steps or set(ref_steps.values()) != {4.0}:
        raise AssertionError(f"step counts differ: {sorted(set(steps.items()) ^ set(ref_steps.items()))[:4]}")
    return errs


# ---------------------------------------------------------------------- on the ranks --
def run(rank, world, layout, directory, resume_from, straight):
    """``straight``: steps 0-3 uninterrupted, saving after step 2 into ``directory``. Then
    fresh workers load each checkpoint of ``resume_from`` and run steps 2-3. Returns per run
    its snapshot (and the checkpoint's meta)."""
    cfg = load_config(None, overrides(layout))
    out = {}
    if straight:
        w = _worker(cfg, rank, world)
        for k in range(2):
            _step(w, cfg, k, rank, world)
        path = w.save_checkpoint(os.path.join(directory, layout), 2, {"note": "test"})
        for k in range(2, 4):
            _step(w, cfg, k, rank, world)
        out["straight"] = {"path": path, "snapshot": snapshot(w)}
    for source, path in (resume_from or {}).items():
        w = _worker(cfg, rank, world)
        meta = w.load_checkpoint(path)
        steps_at_load = w.completed_steps
        for k in range(2, 4):
            _step(w, cfg, k, rank, world)
        out[source] = {"meta": meta, "at": steps_at_load, "snapshot": snapshot(w)}
    return out


def run_jobs(rank, world, jobs, directory):
    """Several :func:`run` calls in one spawn (layouts of one world size, in order)."""
    return [run(rank, world, layout, directory, resume_from, straight)
            for layout, resume_from, straight in jobs]


def on_layout(layout, directory, resume_from=None, straight=True):
    return on_layouts([(layout, resume_from, straight)], directory)[0]


def on_layouts(jobs, directory, timeout=900.0):
    """Per job ``(layout, resume_from, straight)`` (one world size), its ranks' results."""
    world = {LAYOUTS[layout][0].world for layout, _, _ in jobs}
    if len(world) != 1:
        raise ValueError(f"one world size per spawn, not {sorted(world)}")
    world = world.pop()
    if world > 1:
        per_rank = run_ranks(run_jobs, world, jobs, directory, timeout=timeout)
        return [[r[i] for r in per_rank] for i in range(len(jobs))]
    threads = torch.get_num_threads()
    try:
        return [[r] for r in run_jobs(0, 1, jobs, directory)]
    finally:
        torch.set_num_threads(threads)


def checkpoint_of(directory, layout) -> str:
    """Where :func:`run` saves ``layout``'s uninterrupted run at step 2."""
    return os.path.join(directory, layout, "step-000002")


def shapes_of():
    from tests.test_sharding import _worker as plain

    cfg = load_config(None, overrides("rep1"))
    return {n: tuple(p.shape) for n, p in plain(cfg, 0, 1).model.named_parameters()}


def state(results, run_name, shapes):
    return assemble([r[run_name]["snapshot"] for r in results], shapes)


def _check(checks, refs, shapes) -> None:
    """Each resumed run (saved by, resumed by, its ranks' results) vs every uninterrupted
    one; within TOL of the saving layout's (the others: printed, rounding apart)."""
    for saved_by, resumed_by, results in checks:
        for r in results:
            got = r[saved_by]
            assert got["meta"]["step"] == 2 and got["at"] == 2  # the data position: step 2
        got = state(results, saved_by, shapes)
        for ref_name, ref in refs.items():
            errs = compare(got, ref)
            print(f"saved by {saved_by}, resumed by {resumed_by}, after step 4 vs uninterrupted "
                  f"{ref_name}: " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()))
            if ref_name == saved_by:
                assert max(errs.values()) <= TOL, (saved_by, resumed_by, errs)


def test_resume_across_layouts_equals_the_uninterrupted_run(tmp_path):
    """Two ranks at most (the default suite): a replica's checkpoint resumed by fsdp on 2
    ranks with C=2; that run's checkpoint resumed by zero1 on 2 ranks (C=1) and by one
    replica."""
    d, shapes = str(tmp_path), shapes_of()
    rep = on_layout("rep1", d)
    fsdp, zero1 = on_layouts([("fsdp2c2", {"rep1": checkpoint_of(d, "rep1")}, True),
                              ("zero1w2", {"fsdp2c2": checkpoint_of(d, "fsdp2c2")}, False)], d)
    assert fsdp[0]["straight"]["path"] == checkpoint_of(d, "fsdp2c2")
    rep_back = on_layout("rep1", d, {"fsdp2c2": checkpoint_of(d, "fsdp2c2")}, straight=False)
    refs = {n: state(r, "straight", shapes) for n, r in (("fsdp2c2", fsdp), ("rep1", rep))}
    _check([("rep1", "fsdp2c2", fsdp), ("fsdp2c2", "zero1w2", zero1),
            ("fsdp2c2", "rep1", rep_back)], refs, shapes)


@pytest.mark.slow  # 4 gloo ranks with context parallelism on 2 cores: ~2 min
def test_fsdp_four_ranks_c2_resumes_as_zero1_and_a_replica_and_back(tmp_path):
    """The issue's case: fsdp on 4 ranks with C=2 saved at step 2, resumed by zero1 on 2
    ranks (C=1) and by one replica; zero1's and the replica's checkpoints resumed by fsdp on
    4 ranks with C=2."""
    d, shapes = str(tmp_path), shapes_of()
    fsdp = on_layout("fsdp4c2", d)
    ckpt = fsdp[0]["straight"]["path"]
    zero1 = on_layout("zero1w2", d, {"fsdp4c2": ckpt})
    rep = on_layout("rep1", d, {"fsdp4c2": ckpt})
    back = on_layout("fsdp4c2", d, {"zero1w2": zero1[0]["straight"]["path"],
                                    "rep1": rep[0]["straight"]["path"]}, straight=False)
    refs = {n: state(r, "straight", shapes) for n, r in
            (("fsdp4c2", fsdp), ("zero1w2", zero1), ("rep1", rep))}
    _check([("fsdp4c2", "zero1w2", zero1), ("fsdp4c2", "rep1", rep),
            ("zero1w2", "fsdp4c2", back), ("rep1", "fsdp4c2", back)], refs, shapes)


# every layout of the one list (tests/layouts.py), a replica on one rank and fsdp / zero2 under
# C = 2 (4-rank C = 2: the test above); HUBS: resumed by and resuming every other
PAIRS = ["rep1", "fsdp2c2", "zero2c2", *(n for n, lay in MATRIX.items() if lay.refused is None)]
HUBS = ("rep1", "zero2")


def resume_pairs(names, directory, hubs=None, timeout=900.0) -> dict:
    """Each layout of ``names`` runs uninterrupted (saving at step 2), then resumes the
    checkpoints of the others -- every other (``hubs`` None), or only where the saver or the
    resumer is one of ``hubs``; returns ``{(saved by, resumed by): errors vs the saver's
    uninterrupted run}`` (raises past TOL, naming every pair past it)."""
    pairs = [(s, r) for s in names for r in names
             if s != r and (hubs is None or s in hubs or r in hubs)]
    shapes, worlds = shapes_of(), {}
    for n in names:
        worlds.setdefault(LAYOUTS[n][0].world, []).append(n)
    straight, resumed = {}, {}
    for group in worlds.values():
        straight.update(zip(group, on_layouts([(n, None, True) for n in group], directory,
                                              timeout)))
    for group in worlds.values():
        jobs = [(r, {s: checkpoint_of(directory, s) for s, r2 in pairs if r2 == r},
                 False) for r in group]
        resumed.update(zip(group, on_layouts(jobs, directory, timeout)))
    out, bad = {}, []
    for saver, resumer in pairs:
        results = resumed[resumer]
        if any((r[saver]["meta"]["step"], r[saver]["at"]) != (2, 2) for r in results):
            bad.append(f"{saver} -> {resumer}: not resumed at step 2")
            continue
        errs = compare(state(results, saver, shapes), state(straight[saver], "straight",
                                                              shapes))
        out[saver, resumer] = errs
        print(f"RESUME saved by {saver}, resumed by {resumer}: after step 4 vs "
              f"uninterrupted: " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()))
        if max(errs.values()) > TOL:
            bad.append(f"{saver} -> {resumer}: {errs}")
    assert not bad, f"{len(bad)} of {len(pairs)} resumes:\n" + "\n".join(bad)
    return out


@pytest.mark.slow  # every layout: a run of 4 steps each, 4 (n - 1) - 2 resumes of 2 steps
def test_every_layout_resumes_and_is_resumed_by_zero2_and_a_replica(tmp_path):
    """Every layout's checkpoint resumed by zero2 (2 ranks) and by one replica, and theirs by
    every layout: each layout's save and each layout's load shown (the logical view is one
    format whatever saved it, so any other pair goes through the same two halves)."""
    pairs = resume_pairs(PAIRS, str(tmp_path), HUBS)
    assert len(pairs) == 2 * 2 * (len(PAIRS) - 1) - 2
    print(f"{len(pairs)} resumes, worst relative L2 "
          f"{max(max(e.values()) for e in pairs.values()):.2g}")


# issue 53's layouts joined by a key (node residency, prefetch) or offload=gradients: each
# alone, by name (-k)
KEYED = [n for n, lay in MATRIX.items()
         if lay.refused is None and (lay.extra or lay.offload == "gradients")]


@pytest.mark.slow  # per layout: 3 runs of 4 steps, 6 resumes of 2 steps
@pytest.mark.parametrize("layout", KEYED)
def test_a_keyed_layout_resumes_and_is_resumed_by_zero2_and_a_replica(layout, tmp_path):
    """One of :data:`KEYED` (``-k hpz``): its checkpoint resumed by zero2 and by one replica,
    and theirs by it (the rows the every-pair test above holds for it, alone)."""
    pairs = resume_pairs([*HUBS, layout], str(tmp_path), HUBS)
    assert len(pairs) == 6
    print(f"{layout}: {len(pairs)} resumes, worst relative L2 "
          f"{max(max(e.values()) for e in pairs.values()):.2g}")


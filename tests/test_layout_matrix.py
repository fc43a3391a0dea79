"""The exactness matrix (issue 53 item 7): every layout of tests/layouts.py (replicate, zero1,
zero2, fsdp; HSDP shard sizes; optimizer offload) x every front door (the Ray worker's
``DFSWorker`` on local gloo ranks without Ray, verl's ``DTAEngine``, AReaL's
``DTATrainEngine``, each spelling the layout its own way: tests/test_engine_front_doors.py) x
every parallel axis (none, context parallel C = 2, expert parallel E = 2 on the tiny
Qwen3-MoE, both at once under the retain policy) trains 2 AdamW steps in float64 and ends at the parameters the same door reaches
in one process: relative L2 <= 1e-10 over every parameter, and the parameter norm (the Ray
worker's door: each step's loss too, the ranks' shares summed, where C = 1); C = 2's
K/V and E = 2's routed rows really cross the ranks. A layout the runtime cannot do
(``Layout.refused``) is refused on every rank with a one-line error before anything trains.

The default suite runs one representative case per door and per axis (zero2, which is new,
on each) and every refusal; ``-m slow`` the whole cross product (docs/sharding.md's table
holds its figures). A layout with ``extra`` keys runs through the doors that spell them
(:data:`DOOR_SPELLS`: issue 53's ``train.node_resident`` / ``train.prefetch`` through all
three), and each rank's layout must hold them (a door that dropped one fails)."""
from __future__ import annotations

import pytest
import torch

from experiments.local_ranks import run_ranks
from tests.layouts import AXES, LAYOUTS
from tests.test_engine_front_doors import FRONT_DOORS, _doors, _rel_l2

TOL = 1e-10
# the keys beyond sharding / shard size / offload that a door spells (None: all), each with
# the door's own name for it (the one its refusals print; the Ray door's is the run config's)
DOOR_SPELLS = {"ray_worker": None,
               "verl": {"train.node_resident": "engine_config.dta_node_resident",
                        "train.prefetch": "engine_config.forward_prefetch"},
               "areal": {"train.node_resident": "actor.dta.node_resident",
                         "train.prefetch": "actor.dta.prefetch"}}
FLAGS = ("node_resident", "prefetch")  # ParallelLayout's fields set by train.<flag>=true
# the errors a refusal may raise (one line each, before training)
REFUSALS = ("LayoutError", "ShardingRefused", "NotImplementedError", "ValueError")


def spells(door: str, name: str) -> bool:
    keys = DOOR_SPELLS[door]
    return keys is None or all(x.split("=")[0] in keys for x in LAYOUTS[name].extra)


def expected_refusal(door: str, name: str) -> str:
    """The layout's expected refusal as ``door`` prints it (``'train.key'`` -> its key)."""
    text = LAYOUTS[name].refused
    for key, spelled in (DOOR_SPELLS[door] or {}).items():
        text = text.replace(f"'{key}'", spelled)
    return text


# ------------------------------------------------------------------------ the ranks --
def cases_on_ranks(rank, world, door, cases):
    """Each ``(layout, axis)`` of ``cases`` through ``door`` on this rank: its parameters,
    norm and layout, or the refusal (``type: message``)."""
    torch.set_num_threads(1)
    out = []
    for name, axis in cases:
        lay = LAYOUTS[name]
        cp, ep, moe, more = AXES[axis]
        try:
            got = FRONT_DOORS[door](rank, world, lay.sharding, cp, ep, moe=moe, shard=lay.shard,
                                   offload=lay.offload, extra=(*lay.extra, *more))
        except Exception as exc:  # noqa: BLE001  (a refusal: checked against the layout's)
            out.append({"refused": f"{type(exc).__name__}: {exc}"})
            continue
        ly = got["layout"]
        out.append({"state": got["state"], "param_norm": got["param_norm"],
                    "loss": got.get("loss"),
                    "layout": (ly.sharding, ly.world, ly.shard_size, ly.offload,
                               ly.context_parallel, ly.expert_parallel, ly.rank,
                               *(getattr(ly, f) for f in FLAGS)),
                    "sent": got["sent"], "expert_sent": got["expert_sent"]})
    return out


_REFERENCES: dict = {}


def reference(door: str, moe: bool) -> dict:
    """The door's own one process (replicate, one rank), cached per (door, model)."""
    if (door, moe) not in _REFERENCES:
        threads = torch.get_num_threads()
        try:
            _REFERENCES[door, moe] = FRONT_DOORS[door](0, 1, "replicate", 1, 1, moe=moe)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[door, moe]


# ---------------------------------------------------------------------- the checks --
def verdict(door: str, name: str, axis: str, ranks: list) -> tuple[str, float | None]:
    """``("pass", worst relative L2)`` or ``("refused", the line)``; raises on anything else
    (a wrong result, a refusal not expected, a refusal of another kind or on some ranks)."""
    lay = LAYOUTS[name]
    cp, ep, moe, _ = AXES[axis]
    what = f"{door} {name} {axis}"
    refused = [r.get("refused") for r in ranks]
    if lay.refused is not None or any(refused):
        if lay.refused is None:
            raise AssertionError(f"{what}: refused, not expected to be: {refused[0]}")
        expected = expected_refusal(door, name)
        for line in refused:
            if line is None:
                raise AssertionError(f"{what}: trained, expected the refusal {expected!r}")
            if "\n" in line or line.split(":")[0] not in REFUSALS or expected not in line:
                raise AssertionError(f"{what}: refusal {line!r}, expected one line of "
                                     f"{REFUSALS} with {expected!r}")
        return "refused", refused[0]
    ref = reference(door, moe)
    worst = 0.0
    for rank, got in enumerate(ranks):
        expect = (lay.sharding, lay.world, lay.shard or lay.world, lay.offload, cp, ep, rank,
                  *(f"train.{f}=true" in lay.extra for f in FLAGS))
        if got["layout"] != expect:
            raise AssertionError(f"{what} rank {rank}: layout {got['layout']} != {expect}")
        if (got["sent"] > 0) != (cp > 1) or (got["expert_sent"] > 0) != (ep > 1):
            raise AssertionError(f"{what} rank {rank}: sent {got['sent']} bytes of K/V and "
                                 f"{got['expert_sent']} of routed rows (C={cp}, E={ep})")
        if set(got["state"]) != set(ref["state"]):
            raise AssertionError(f"{what} rank {rank}: other parameters than one process's")
        err = _rel_l2(got["state"], ref["state"])
        norm = abs(got["param_norm"] - ref["param_norm"]) / ref["param_norm"]
        if not (err <= TOL and norm <= TOL):
            raise AssertionError(f"{what} rank {rank}: relative L2 {err:.3g}, parameter norm "
                                 f"{norm:.3g} vs one process (tolerance {TOL})")
        worst = max(worst, err, norm)
    if cp == 1 and ref.get("loss") is not None:  # the ranks' shares add up to each step's
        for k, want in enumerate(ref["loss"]):
            err = abs(sum(r["loss"][k] for r in ranks) - want) / abs(want)
            if not err <= TOL:
                raise AssertionError(f"{what}: step {k} loss {err:.3g} vs one process")
            worst = max(worst, err)
    return "pass", worst


def run_matrix(door: str, cases: list) -> list[str]:
    """Run ``cases`` (``(layout, axis)``) grouped by world size; returns the failures (every
    case is run and printed, as ``MATRIX door layout axis: verdict``)."""
    failures = []
    for world in sorted({LAYOUTS[n].world for n, _ in cases}):
        group = [c for c in cases if LAYOUTS[c[0]].world == world]
        results = run_ranks(cases_on_ranks, world, door, group, timeout=1800.0)
        for i, (name, axis) in enumerate(group):
            try:
                kind, value = verdict(door, name, axis, [r[i] for r in results])
            except AssertionError as exc:
                failures.append(str(exc))
                print(f"MATRIX {door} {name} {axis}: FAIL {exc}")
                continue
            shown = f"{value:.2g}" if kind == "pass" else value
            print(f"MATRIX {door} {name} {axis}: {kind} {shown}")
    return failures


# ------------------------------------------------------------------------- tests --
# One case per door and per axis in the default suite: zero2 (issue 53's new layout) on each.
REPRESENTATIVE = {"ray_worker": [("zero2-offload", "ep2")], "verl": [("zero2", "cp2")],
                  "areal": [("zero2-offload", "plain")]}


@pytest.mark.parametrize("door", _doors())
def test_a_representative_layout_per_door_and_axis_equals_one_process(door):
    failures = run_matrix(door, REPRESENTATIVE[door])
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("door", _doors())
def test_what_the_runtime_cannot_do_is_refused_in_one_line(door):
    """Every refused layout the door spells, on the plain axis: refused on every rank, one
    line naming the setting, before training (the door raises while it builds)."""
    cases = [(n, "plain") for n, lay in LAYOUTS.items() if lay.refused and spells(door, n)]
    assert cases
    failures = run_matrix(door, cases)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("door", _doors())
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_through_every_door_equals_one_process(layout, door):
    """The cross product (module doc): this layout through this door on every axis (one
    spawn of the ranks; ``-k "hpz and verl"`` picks cases by layout and door)."""
    if not spells(door, layout):
        pytest.skip(f"the {door} door has no key for {LAYOUTS[layout].extra}")
    cases = [(layout, axis) for axis in AXES]
    failures = run_matrix(door, cases)
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)

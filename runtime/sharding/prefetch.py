"""fsdp's prefetch (``train.prefetch=true``): the next layer's all-gather issued before the
current layer computes, so that on a device the gather runs under the compute.

Built from FSDP2's explicit prefetch lists, set once on :mod:`.fsdp`'s units and the same on
every rank -- so the ranks' collectives stay in one order, matched by the engine's lockstep
(``runtime.engine.lockstep``) as without prefetch:

- **forward**, every decoder call (the walk's pushes, leaves and packs, recompute's
  re-forward at a pop, the lockstep's dummies): the root unit (the decoder) prefetches layer 0,
  layer i layer i + 1 (``set_modules_to_forward_prefetch``). FSDP2 issues the target's
  all-gather in layer i's pre-forward, after layer i's own gather and before layer i computes;
  layer i + 1's pre-forward then only waits for it.
- **backward**, in the passes the planner credits with overlap
  (``dta.planning.timing.OVERLAPPED``, one list for both: under ``recompute`` a call's
  backward follows its forward at once -- a leaf, a pop's re-forward; under ``retain`` the
  planner prices no backward overlap and none is issued): the root prefetches the last
  layer, layer i layer i - 1 (``set_modules_to_backward_prefetch``), issued in layer i's
  pre-backward before its backward computes. Elsewhere each unit "prefetches" itself, a
  no-op that keeps FSDP2's default backward prefetch off (that one follows the rank's own
  record of post-forwards, which differs between ranks walking different trees).

Prefetch never reaches across calls: the last layer of a forward (layer 0 of a backward)
prefetches nothing, since which call comes next -- a forward, a backward or none -- is the
data's. Inside one pass every prefetched unit is used: a decoder call runs every layer in
order, and one backward covers one decoder call and reaches every layer (the lockstep ties
the call's K/V to its last hidden state). :func:`check_consumed` (after each walk) refuses a
unit left holding an issued, unconsumed gather, whose stale result the next forward would
otherwise use after the update. A prefetched pass holds one more gathered layer than
without (the planner's ``+ L c``).

FSDP2's prefetch state (an issued, not yet consumed all-gather) is read from its parameter
groups (:func:`~runtime.sharding.common.fsdp_param_groups`, ``_all_gather_result``: FSDP2's
internals, read-only here).
"""
from __future__ import annotations

from dta.planning.timing import OVERLAPPED
from runtime.sharding.common import fsdp_param_groups

__all__ = ["passes", "describe", "configure", "pending", "check_consumed", "forward_steps"]


def passes(policy: str) -> tuple:
    """The passes whose all-gathers prefetch overlaps under ``policy`` (the planner's)."""
    if policy not in OVERLAPPED:
        raise ValueError(f"prefetch: unknown walker policy {policy!r} ({sorted(OVERLAPPED)})")
    return OVERLAPPED[policy]


def describe(policy: str) -> str:
    """Which calls' all-gathers prefetch overlaps under ``policy``, in words (the layout
    report's ``prefetch_overlaps``; the planner's ``time.overlapped`` names the same passes)."""
    done = passes(policy)
    what = "the forward of every decoder call"
    if "backward" in done:
        what += " and the backward of every call with gradient (a leaf's, a pop's re-forward's)"
    else:
        what += " (a call's backward is not prefetched: under retain it runs at its pop)"
    return f"{what}: the next layer's all-gather issued before the current layer computes"


def configure(layers: list, root, policy: str, prefetch: bool) -> None:
    """Set the units' prefetch lists (module doc): ``layers`` the decoder layers' units in
    order, ``root`` the decoder's; without ``prefetch`` only the no-op backward lists."""
    backward = prefetch and "backward" in passes(policy)
    for i, unit in enumerate(layers):
        if prefetch:
            unit.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
        unit.set_modules_to_backward_prefetch(layers[i - 1:i] if backward and i else [unit])
    if prefetch:
        root.set_modules_to_forward_prefetch(layers[:1])
    root.set_modules_to_backward_prefetch(layers[-1:] if backward else [root])


def pending(unit) -> bool:
    """Whether ``unit`` holds an all-gather issued and not yet consumed (a prefetch)."""
    return any(g._all_gather_result is not None for g in fsdp_param_groups(unit))


def check_consumed(units: list, names: list) -> None:
    """Refuse a unit left holding a prefetched gather (module doc)."""
    left = [n for unit, n in zip(units, names) if pending(unit)]
    if left:
        raise RuntimeError(f"fsdp prefetch: the all-gather of {', '.join(left)} was issued "
                           "and never used in its pass; its stale result would serve the "
                           "next call (a decoder call that skipped layers?)")


def forward_steps(root, layers: list, inner: dict) -> list:
    """A prefetched forward's collectives without a forward (``Sharding.forward_steps``),
    in a prefetched forward's order: the root gathered (it prefetches layer 0), then for
    layer i its gather (done), the prefetch of layer i + 1, layer i's own ``inner`` steps
    (expert parallelism's exchanges) and its reshard."""
    steps = [root.unshard]
    if layers:
        steps.append(layers[0].unshard)
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            steps.append(layers[i + 1].unshard)
        steps += [*inner.get(i, ()), layer.reshard]
    return steps

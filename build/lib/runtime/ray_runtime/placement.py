"""Where the workers run: one bundle per worker in a Ray placement group.

Each worker gets one bundle: ``ray.cpus_per_worker`` CPUs and, on a GPU cluster, one GPU
(``ray.gpus_per_worker``). ``ray.placement`` picks Ray's strategy for the group:

* ``pack`` (default): as few nodes as possible — a node's GPUs fill up before the next
  node is used, so most of the gradient traffic stays inside a node;
* ``spread``: the bundles round-robin over the nodes (e.g. one worker per node, to use
  every node's memory or network link).

Both are soft: when the preferred layout does not fit, Ray places the bundles elsewhere
rather than waiting. Before asking, :func:`check_fits` counts how many bundles fit on the
alive nodes (a bundle never spans nodes), so a group that can never be placed is an error
naming the key to change, not a wait. Worker ``rank`` runs in bundle ``rank``.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import TrainingError

STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}  # ray.placement -> Ray's strategy


def bundle_for(cpus: float, gpus: float) -> dict[str, float]:
    """One worker's resources (zero amounts left out: Ray refuses them in a bundle)."""
    out = {"CPU": float(cpus)}
    if gpus > 0:
        out["GPU"] = float(gpus)
    return out


def fits_on(node_resources: dict, bundle: dict) -> int:
    """How many ``bundle`` fit on a node with ``node_resources`` (its totals)."""
    counts = [int(float(node_resources.get(k, 0.0)) / v + 1e-9) for k, v in bundle.items()]
    return min(counts) if counts else 0


def check_fits(num_workers: int, bundle: dict, nodes: list[dict]) -> dict[str, int]:
    """Raise a TrainingError when ``num_workers`` bundles cannot fit on ``nodes``
    (``ray.nodes()`` entries); returns how many fit on each alive node (by node id)."""
    per_node = {n["NodeID"]: fits_on(n.get("Resources", {}), bundle)
                for n in nodes if n.get("Alive", n.get("alive", False))}
    if sum(per_node.values()) < num_workers:
        shown = ", ".join(f"{nid[:8]}: {k}" for nid, k in per_node.items()) or "no alive node"
        need = " + ".join(f"{v:g} {k}" for k, v in bundle.items())
        raise TrainingError(
            f"ray.num_workers={num_workers} workers of {need} each do not fit on the "
            f"cluster's nodes (a worker never spans nodes; workers that fit per node: "
            f"{shown}); lower ray.num_workers, ray.cpus_per_worker or ray.gpus_per_worker")
    return per_node


@dataclass
class Placement:
    """A ready placement group and its strategy; :meth:`options` schedules rank ``r`` in
    bundle ``r``; :meth:`remove` frees it."""

    group: object  # ray.util.placement_group.PlacementGroup
    strategy: str  # pack | spread

    def options(self, rank: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.group, placement_group_bundle_index=int(rank))}

    def remove(self) -> None:
        from ray.util import remove_placement_group

        if self.group is not None:
            try:
                remove_placement_group(self.group)
            except Exception:
                pass  # Ray already gone: its groups went with it
            self.group = None


def place_workers(num_workers: int, bundle: dict, strategy: str,
                  timeout_s: float) -> Placement:
    """Check the bundles fit, create the placement group and wait until it is placed."""
    import ray
    from ray.util import placement_group

    if strategy not in STRATEGIES:
        raise TrainingError(f"bad value for config key 'ray.placement': {strategy!r} is not "
                            f"one of {', '.join(STRATEGIES)}")
    check_fits(num_workers, bundle, ray.nodes())
    group = placement_group([dict(bundle) for _ in range(num_workers)],
                            strategy=STRATEGIES[strategy])
    placement = Placement(group, strategy)
    ready, _ = ray.wait([group.ready()], timeout=float(timeout_s))
    if not ready:
        placement.remove()
        raise TrainingError(
            f"the placement group of {num_workers} workers ({bundle}, ray.placement="
            f"{strategy}) was not placed within {timeout_s:g} s (ray.step_timeout_s): the "
            "cluster's resources are taken by other work")
    return placement

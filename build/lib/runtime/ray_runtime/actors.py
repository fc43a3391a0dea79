"""Starting the W worker actors and forming their torch.distributed process group.

:func:`start_workers` checks the cluster has the CPUs/GPUs asked for, reserves one bundle
per rank in a placement group (:mod:`.placement`, ``ray.placement=pack|spread``), starts one
:class:`~runtime.ray_runtime.worker.DFSWorker` actor per rank in its bundle, and forms the
group: gloo on CPU, NCCL when every worker has a GPU. The rendezvous:

* every worker on the driver's Ray node: a ``file://`` store in a fresh 0700 directory
  (nothing listens; ``GLOO_SOCKET_IFNAME=lo``);
* otherwise (workers on other nodes than the driver, or on several): a TCP store served by
  rank 0 on the address Ray reports for rank 0's node, on a free port (a socket bound to
  that address, never a wildcard); each rank's gloo/NCCL sockets use the interface holding
  its own node's Ray address.

Nodes are told apart by their Ray node id, not their address: two raylets can share an
address (two nodes on one machine).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from dta.config.schema import as_dict
from runtime.errors import TrainingError, describe
from runtime.ray_runtime.cluster import cluster_has_gpus, private_dir
from runtime.ray_runtime.placement import Placement, bundle_for, place_workers
from runtime.ray_runtime.worker import DFSWorker


@dataclass
class WorkerGroup:
    workers: list  # Ray actor handles, rank order
    infos: list[dict]  # each worker's info() after the group formed
    backend: str  # gloo | nccl
    group_dir: str | None = None  # the FileStore directory (same-node groups)
    extra: dict = field(default_factory=dict)
    placement: Placement | None = None  # the workers' placement group
    rendezvous: str | None = None  # file | tcp://IP:PORT (None: one worker, no group)

    @property
    def worker_nodes(self) -> list[str]:
        """The Ray node id of each worker, in rank order."""
        return [i.get("node_id") for i in self.infos]

    def kill(self) -> None:
        kill_actors(self.workers)
        self.workers = []
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        if self.group_dir:
            shutil.rmtree(self.group_dir, ignore_errors=True)
            self.group_dir = None


def kill_actors(workers) -> None:
    import ray

    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:
            pass


def _check_resources(cfg, num_workers: int, gpus: float) -> None:
    import ray

    r = cfg.ray
    total = ray.cluster_resources()
    need = {"CPU": num_workers * float(r.cpus_per_worker), "GPU": num_workers * float(gpus)}
    for kind, amount in need.items():
        if amount > float(total.get(kind, 0.0)) + 1e-9:
            key = "ray.cpus_per_worker" if kind == "CPU" else "ray.gpus_per_worker"
            raise TrainingError(
                f"{num_workers} workers need {amount:g} {kind}s ({key} x "
                f"ray.num_workers) but the cluster has {float(total.get(kind, 0)):g}")


def start_workers(cfg, num_workers: int, *, settings, fault=None,
                  generation: int = 1) -> WorkerGroup:
    """Start ``num_workers`` actors and form their process group (see the module doc);
    ``settings``: the run's resolved :class:`runtime.engine.RunSettings` (layout and walk),
    handed to every worker unchanged."""
    import ray

    r = cfg.ray
    gpus = r.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if cluster_has_gpus() else 0.0
    _check_resources(cfg, num_workers, gpus)
    placement = place_workers(num_workers, bundle_for(r.cpus_per_worker, gpus),
                              str(r.placement), float(r.step_timeout_s))
    actor_cls = ray.remote(DFSWorker)
    cfg_dict = as_dict(cfg)
    # No runtime_env: the actors can then start in Ray's prestarted worker processes
    # (the worker sets its own torch thread count).
    workers = [
        actor_cls.options(num_cpus=float(r.cpus_per_worker), num_gpus=float(gpus),
                          max_restarts=0, max_task_retries=0, **placement.options(rank)).remote(
                              rank, num_workers, cfg_dict, settings, use_gpu=gpus > 0,
                              fault=fault)
        for rank in range(num_workers)]
    try:
        infos = ray.get([w.info.remote() for w in workers], timeout=float(r.step_timeout_s))
    except Exception as exc:
        kill_actors(workers)
        placement.remove()
        raise TrainingError(f"starting {num_workers} workers failed: {describe(exc)}") from exc
    backend = "nccl" if gpus > 0 and all(i["device"].startswith("cuda") for i in infos) \
        else "gloo"
    group_dir, rendezvous, init, ifname = None, None, None, None
    try:
        if num_workers > 1 and same_node_as_driver(infos):
            # FileStore rendezvous: nothing listens; a fresh file per group.
            group_dir = private_dir("dta-pg-")  # 0700, swept if this process is killed
            init, rendezvous = "file://" + os.path.join(group_dir, f"store-{generation}"), "file"
            ifname = "lo"  # gloo's pairs and NCCL's bootstrap sockets stay on loopback
        elif num_workers > 1:
            # A TCP store served by rank 0 on its node's Ray address (see the module doc).
            ip, port = ray.get(workers[0].open_store.remote(float(r.step_timeout_s)),
                               timeout=float(r.step_timeout_s))
            init = rendezvous = f"tcp://{_host(ip)}:{port}"
        infos = ray.get([w.setup_group.remote(init, backend, float(r.step_timeout_s), ifname)
                         for w in workers], timeout=float(r.step_timeout_s))
    except Exception as exc:
        kill_actors(workers)
        placement.remove()
        if group_dir:
            shutil.rmtree(group_dir, ignore_errors=True)
        raise TrainingError(f"the workers' process group ({backend}, {init}) did not "
                            f"form: {describe(exc)}") from exc
    return WorkerGroup(workers, infos, backend, group_dir, placement=placement,
                       rendezvous=rendezvous)


def same_node_as_driver(infos: list[dict]) -> bool:
    """Whether every worker runs on the driver's Ray node (where a file store works)."""
    import ray

    driver_node = ray.get_runtime_context().get_node_id()
    return all(i.get("node_id") == driver_node for i in infos)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip

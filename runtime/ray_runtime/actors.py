"""Starting the W worker actors and forming their torch.distributed process group.

:func:`start_workers` checks the cluster has the CPUs/GPUs asked for, starts one
:class:`~runtime.ray_runtime.worker.DFSWorker` actor per rank, and forms the group: gloo on
CPU, NCCL when every worker has a GPU. Workers on one node rendezvous through a ``file://``
store in a fresh directory (nothing listens beyond loopback, ``GLOO_SOCKET_IFNAME=lo``);
workers on several nodes through a TCP store on rank 0's node.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from dta.config import as_dict
from runtime.ray_runtime.cluster import cluster_has_gpus, private_dir
from runtime.ray_runtime.errors import TrainingError, describe
from runtime.ray_runtime.worker import DFSWorker


@dataclass
class WorkerGroup:
    workers: list  # Ray actor handles, rank order
    infos: list[dict]  # each worker's info() after the group formed
    backend: str  # gloo | nccl
    group_dir: str | None = None  # the FileStore directory (same-node groups)
    extra: dict = field(default_factory=dict)

    def kill(self) -> None:
        kill_actors(self.workers)
        self.workers = []
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


def start_workers(cfg, num_workers: int, *, fault=None, generation: int = 1) -> WorkerGroup:
    """Start ``num_workers`` actors and form their process group (see the module doc)."""
    import ray

    r = cfg.ray
    gpus = r.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if cluster_has_gpus() else 0.0
    _check_resources(cfg, num_workers, gpus)
    actor_cls = ray.remote(DFSWorker)
    cfg_dict = as_dict(cfg)
    # No runtime_env: the actors can then start in Ray's prestarted worker processes
    # (the worker sets its own torch thread count).
    workers = [
        actor_cls.options(num_cpus=float(r.cpus_per_worker), num_gpus=float(gpus),
                          max_restarts=0, max_task_retries=0).remote(
                              rank, num_workers, cfg_dict, use_gpu=gpus > 0, fault=fault)
        for rank in range(num_workers)]
    try:
        infos = ray.get([w.info.remote() for w in workers], timeout=float(r.step_timeout_s))
    except Exception as exc:
        kill_actors(workers)
        raise TrainingError(f"starting {num_workers} workers failed: {describe(exc)}") from exc
    backend = "nccl" if gpus > 0 and all(i["device"].startswith("cuda") for i in infos) \
        else "gloo"
    group_dir = None
    if len({i["ip"] for i in infos}) == 1:
        # FileStore rendezvous: nothing listens beyond loopback; a fresh file per group.
        group_dir = private_dir("dta-pg-")  # 0700, swept if this process is killed
        init = "file://" + os.path.join(group_dir, f"store-{generation}")
        ifname = "lo"  # gloo's pairs and NCCL's bootstrap sockets stay on loopback
    else:
        # Workers on several nodes: a TCP store on rank 0's node (its listening socket is
        # on that node's address; keep the cluster on a private network).
        port = ray.get(workers[0].__ray_call__.remote(lambda self: _free_port()))
        init, ifname = f"tcp://{infos[0]['ip']}:{port}", None
    try:
        infos = ray.get([w.setup_group.remote(init, backend, float(r.step_timeout_s), ifname)
                         for w in workers], timeout=float(r.step_timeout_s))
    except Exception as exc:
        kill_actors(workers)
        if group_dir:
            shutil.rmtree(group_dir, ignore_errors=True)
        raise TrainingError(f"the workers' process group ({backend}, {init}) did not "
                            f"form: {describe(exc)}") from exc
    return WorkerGroup(workers, infos, backend, group_dir)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

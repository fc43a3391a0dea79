"""What AReaL's single-controller mode calls on a training worker beyond the ``TrainEngine``
ABC: the ``TrainController`` creates ``runtime.areal.actor.DTAPPOActor`` on each worker by its
import path (with ``config=``) and calls its members by name over RPC — among them
``clear_batches`` and ``fetch_buffer_stats`` at the end of every step (areal 1.0.4,
``infra/controller/train_controller.py``), and the perf-tracer hooks."""
from __future__ import annotations

__all__ = ["WorkerMixin"]


class WorkerMixin:
    """``clear_batches``, ``fetch_buffer_stats``, ``save_perf_tracer``, ``config_perf_tracer``."""

    def clear_batches(self, shard_ids: list[str]) -> None:
        """Drop the given RTensor shards from this worker's client-side fetch buffer."""
        from areal.infra.rpc.rtensor import clear_fetch_buffer

        clear_fetch_buffer(shard_ids)

    def fetch_buffer_stats(self) -> dict[str, int]:
        """``{"num_entries": n}`` of this worker's fetch buffer (the controller's leak check)."""
        from areal.infra.rpc.rtensor import fetch_buffer_stats

        return fetch_buffer_stats()

    def save_perf_tracer(self, step: int | None = None, force: bool = False) -> None:
        from areal.utils import perf_tracer

        perf_tracer.save(step=step, force=force)

    def config_perf_tracer(self, config, rank: int, role: str) -> None:
        from areal.utils import perf_tracer

        if perf_tracer.is_configured():
            return
        perf_tracer.configure(config, rank=rank, role=role)

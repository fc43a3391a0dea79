"""Ray runtime: balanced data-parallel DFS training on a local or remote Ray cluster.

A thin layer over the ``dta`` library's public API (``accumulate_gradients``,
``clip_and_step``, ``dta.planning``): the walk lives in the library, the processes, the
collectives, the plan distribution, checkpoints and job submission live here.
Importing this package does not import Ray; its functions do.
"""
from runtime.ray_runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from runtime.ray_runtime.cluster import (ClusterError, ClusterHandle, check_loopback,
                                         listening_addresses, start_or_join)
from runtime.ray_runtime.driver import (BatchSource, StepFailed, StepStats, Trainer,
                                        TrainingError, run_training, summarize)
from runtime.ray_runtime.plan import Assignment, assign_workers
from runtime.ray_runtime.stream import END, StreamBatch, StreamingBatcher

__all__ = [
    "latest_checkpoint", "load_checkpoint", "save_checkpoint", "ClusterError", "ClusterHandle",
    "check_loopback", "listening_addresses", "start_or_join", "BatchSource", "StepFailed",
    "StepStats", "Trainer", "TrainingError", "run_training", "summarize", "Assignment",
    "assign_workers", "END", "StreamBatch", "StreamingBatcher",
]

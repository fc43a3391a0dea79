"""Ray runtime: balanced data-parallel DFS training on a local or remote Ray cluster.

A thin layer over the ``dta`` library's public API (``accumulate_gradients``,
``clip_and_step``, ``dta.planning``): the walk and the worker plan live in the library; the
processes (:mod:`.actors`, :mod:`.worker`), the step loop (:mod:`.driver`, :mod:`.run`),
failures (:mod:`.failures`), checkpoints, streaming and job submission live here.
Importing this package does not import Ray; its functions do.
"""
from runtime.ray_runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from runtime.ray_runtime.cluster import (ClusterError, ClusterHandle, check_loopback,
                                         listening_addresses, start_or_join)
from runtime.ray_runtime.driver import Trainer
from runtime.ray_runtime.errors import StepFailed, TrainingError
from runtime.ray_runtime.run import run_training
from runtime.ray_runtime.stats import StepStats, summarize
from runtime.ray_runtime.stream import END, StreamBatch, StreamingBatcher

__all__ = [
    "latest_checkpoint", "load_checkpoint", "save_checkpoint", "ClusterError", "ClusterHandle",
    "check_loopback", "listening_addresses", "start_or_join", "StepFailed", "StepStats",
    "Trainer", "TrainingError", "run_training", "summarize", "END", "StreamBatch",
    "StreamingBatcher",
]

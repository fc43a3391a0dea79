"""Ray runtime: balanced data-parallel DFS training on a local or remote Ray cluster.

A thin layer over the ``dta`` library's public API (``accumulate_gradients``,
``clip_and_step``, ``dta.planning``): the walk and the worker plan live in the library; the
processes (:mod:`.actors`, :mod:`.worker`), the step loop (:mod:`.driver`, :mod:`.run`),
failures (:mod:`.failures`), checkpoints, streaming and job submission live here.
Importing this package does not import Ray; its functions do.
"""
import importlib

# Names are imported lazily, so that light modules (``.cluster`` for the CLI's address probe)
# do not pay for torch.
_EXPORTS = {
    "latest_checkpoint": "checkpoint", "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint", "ClusterError": "cluster", "ClusterHandle": "cluster",
    "check_loopback": "cluster", "listening_addresses": "cluster", "start_or_join": "cluster",
    "Trainer": "driver", "StepFailed": "errors", "TrainingError": "errors",
    "run_training": "run", "StepStats": "stats", "summarize": "stats", "END": "stream",
    "StreamBatch": "stream", "StreamingBatcher": "stream",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"runtime.ray_runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'runtime.ray_runtime' has no attribute {name!r}")

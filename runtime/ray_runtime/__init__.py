"""Ray runtime: balanced data-parallel DFS training on a local or remote Ray cluster.

A thin layer over the ``dta`` library's public API (``accumulate_gradients``,
``clip_and_step``, ``dta.planning``): the walk and the worker plan live in the library; the
processes (:mod:`.actors`, :mod:`.worker`), the step loop (:mod:`.driver`, :mod:`.run`),
failures (:mod:`.failures`), streaming and job submission live here; checkpoint storage is
``runtime.checkpoints`` (shared with DCP, resharding and the AReaL adapter).
Importing this package does not import Ray; its functions do.
"""
import importlib

# Names are imported lazily, so that light modules (``.cluster`` for the CLI's address probe)
# do not pay for torch.
_EXPORTS = {
    "latest_checkpoint": "runtime.checkpoints.checkpoint",
    "load_checkpoint": "runtime.checkpoints.whole",
    "save_checkpoint": "runtime.checkpoints.whole", "ClusterError": "cluster", "ClusterHandle": "cluster",
    "check_loopback": "cluster", "listening_addresses": "cluster", "start_or_join": "cluster",
    "Trainer": "driver", "StepFailed": "runtime.errors", "TrainingError": "runtime.errors",
    "run_training": "run", "StepStats": "stats", "summarize": "stats", "END": "stream",
    "StreamBatch": "stream", "StreamingBatcher": "stream",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = _EXPORTS[name]
        if "." not in module:  # a module of this package
            module = f"runtime.ray_runtime.{module}"
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'runtime.ray_runtime' has no attribute {name!r}")

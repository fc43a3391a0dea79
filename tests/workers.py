"""Ray workers (``runtime.ray_runtime.worker.DFSWorker``) outside Ray, for tests: the settings
resolved as the driver resolves them (``runtime.engine.resolve_run_config``) for a world of
``world`` ranks, and the core parallelized on a process group that already exists (local gloo
ranks: ``runtime.sharding.local.run_ranks``)."""
from __future__ import annotations

from omegaconf import OmegaConf

from dta.config.schema import as_dict


def settings_for(cfg, world: int, tree=None):
    """The driver's settings for ``cfg`` on ``world`` ranks (``ray.num_workers`` = world)."""
    from runtime.engine import resolve_run_config
    from runtime.ray_runtime.model_info import model_limits

    cfg = OmegaConf.merge(cfg, {"ray": {"num_workers": int(world)}})
    hf_config = model_limits(cfg)[2] if tree is not None else None
    return resolve_run_config(cfg, hf_config, tree)


def local_worker(cfg, rank: int = 0, world: int = 1, *, truly_float64: bool = False,
                 settings=None):
    """A worker of rank ``rank`` of ``world``; ``truly_float64``: a float64 model computing in
    float64 throughout (before it is sharded)."""
    from runtime.ray_runtime.worker import DFSWorker

    w = DFSWorker(rank, world, as_dict(cfg), settings or settings_for(cfg, world))
    if truly_float64 and cfg.model.dtype == "float64":  # HF norms upcast to fp32 otherwise
        from dta.model.models import make_truly_float64

        make_truly_float64(w.model)
    if world > 1:
        w.parallelize()  # the process group exists (run_ranks made it)
    return w

"""Ray workers (``runtime.ray_runtime.worker.DFSWorker``) outside Ray, for tests: the settings
resolved as the driver resolves them (``runtime.engine.resolve_run_config``) for a world of
``world`` ranks, and the core parallelized on a process group that already exists (local gloo
ranks: ``experiments.local_ranks.run_ranks``); and what the tests read of a worker's state
(:func:`state`, :func:`gradients`, :func:`digest`; through Ray: :func:`trainer_state`,
:func:`trainer_gradients`, :func:`trainer_digests`), kept out of the runtime."""
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


# ------------------------------------------------------------- a worker's state --
def _to_cpu(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):  # a DTensor (FSDP2): this rank's shard
            obj = obj.to_local()
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def state(w) -> dict:
    """CPU copies of worker ``w``'s model (gathered, compute dtype: a collective where
    sharded) and of its rank's optimizer state."""
    return {"model": w.core.full_state(), "optimizer": _to_cpu(w.core.optimizer.state_dict())}


def gradients(w) -> dict:
    """CPU copies of worker ``w``'s last step's (reduced, possibly clipped) gradients: the
    model's ``.grad`` (replicated: after the step, reduced and clipped)."""
    return {n: p.grad.detach().cpu().clone() for n, p in w.core.model.named_parameters()
            if p.grad is not None}


def digest(w) -> float:
    """One number of worker ``w``'s whole model (a collective where sharded)."""
    import torch

    with torch.no_grad():
        return float(sum(v.double().abs().sum() for v in w.core.full_state().values()))


# Through Ray (a Trainer's workers): each read runs inside the actors (Trainer.call); the
# functions are local ones, so Ray pickles them by value (the actors need not import tests).
def trainer_state(trainer, rank: int) -> dict:
    """Rank ``rank``'s :func:`state`; sharded, every worker is asked (the gather is a
    collective)."""
    def read(w):
        import torch

        def cpu(obj):
            if isinstance(obj, torch.Tensor):
                obj = obj.to_local() if hasattr(obj, "to_local") else obj
                return obj.detach().cpu().clone()
            if isinstance(obj, dict):
                return {k: cpu(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(cpu(v) for v in obj)
            return obj

        return {"model": w.core.full_state(), "optimizer": cpu(w.core.optimizer.state_dict())}

    ranks = "all" if trainer.sharded else [rank]
    states = trainer.call(f"reading worker {rank}'s state", read, ranks)
    return states[rank] if trainer.sharded else states[0]


def trainer_gradients(trainer, rank: int) -> dict:
    def read(w):  # local: pickled by value, as gradients() reads them
        return {n: p.grad.detach().cpu().clone() for n, p in w.core.model.named_parameters()
                if p.grad is not None}

    return trainer.call(f"reading worker {rank}'s gradients", read, [rank])[0]


def trainer_digests(trainer) -> list[float]:
    """Every worker's :func:`digest` (a collective where sharded)."""
    def read(w):
        import torch

        with torch.no_grad():
            return float(sum(v.double().abs().sum() for v in w.core.full_state().values()))

    return trainer.call("computing the state digests", read, "all")

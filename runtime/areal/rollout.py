"""The rollout side of AReaL's ``TrainEngine`` API (what ``DTATrainEngine``'s members call), as
``FSDPEngine`` does it (areal 1.0.4, ``engine/fsdp_engine.py:560-1690``):

* ``connect_engine(engine, meta)`` keeps the inference engine, builds AReaL's own
  ``DistRolloutCoordinator`` on it, and for ``meta.type == "xccl"`` sets up the weight-update
  process group with the inference servers;
* ``rollout_batch`` / ``prepare_batch`` go through the coordinator: the data-parallel head runs
  the rollout on the inference engine, the trajectories are redistributed over the ranks;
* ``update_weights(meta)``:
  - ``disk``: pause generation, ask the inference engine to load ``meta.path``, save the
    weights there in HF format (compute dtype, with the tokenizer), then publish AReaL's
    name-resolve record ``names.update_weights_from_disk(experiment, trial, version)`` — the
    "weights ready" signal AReaL's SGLang/vLLM clients wait for — wait for the load, continue;
  - ``xccl``: pause generation, broadcast the parameters bucket by bucket
    (``meta.weight_chunked_mem_mb``) over the NCCL weight-update group, each bucket announced
    to the inference engine with its ``ParamSpec`` list first, then continue;
* ``set_version`` / ``get_version``: the weight version, a plain int (PPOTrainer sets it to
  ``global_step + 1`` after each update).

Weight tensors leave in the compute dtype (``config.dtype``), never as fp32 masters: the
engine core's whole weights (``EngineCore.named_full_tensors``; sharded, gathered on every
rank: FSDP's all-gathers), broadcast by rank 0 (``runtime.engine.comm``).
"""
from __future__ import annotations

from datetime import datetime

import torch
from areal.api.io_struct import ParamSpec, SaveLoadMeta, WeightUpdateMeta

from runtime.engine import comm

__all__ = ["WEIGHT_UPDATES", "broadcast_bucket", "param_buckets", "init_weight_update_group",
           "update", "update_from_disk", "update_from_distributed"]

WEIGHT_UPDATES = ("disk", "xccl")

_GROUP_NAME = "update_weight_group"


def param_buckets(named_tensors, chunk_bytes: int):
    """Consecutive ``[(name, tensor), ...]`` buckets of at most ``chunk_bytes`` (a tensor
    larger than the limit is a bucket of its own), in parameter order."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > chunk_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def broadcast_bucket(tensors, group) -> None:
    """The collective of an xccl update: broadcast each tensor from rank 0 of the
    weight-update group (the trainer) to the inference servers."""
    for tensor in tensors:
        comm.broadcast(tensor, src=0, group=group)


def check_update_type(meta: WeightUpdateMeta) -> None:
    if meta.type not in WEIGHT_UPDATES:
        raise ValueError(f"weight update type {meta.type!r} is not supported by "
                         "DTATrainEngine; use 'disk' or 'xccl'")


def update(engine, meta: WeightUpdateMeta) -> None:
    """``engine.update_weights(meta)``: ``disk`` or ``xccl`` (see the module doc)."""
    check_update_type(meta)
    if meta.type == "disk":
        update_from_disk(engine.rollout_engine, meta, rank=engine.rank, save=engine.save,
                         tokenizer=engine.tokenizer, experiment=engine.config.experiment_name,
                         trial=engine.config.trial_name, version=engine.get_version(),
                         cpu_group=engine.groups.cpu)
        return
    if engine.weight_update_group is None and engine.rank == 0:
        raise RuntimeError("xccl weight update without a weight-update group: "
                           "connect_engine(engine, meta) with an xccl meta first")
    update_from_distributed(engine.core, engine.rollout_engine, meta, rank=engine.rank,
                            group=engine.weight_update_group,
                            address=engine._weight_update_address, cpu_group=engine.groups.cpu,
                            use_lora=engine.use_lora)


def update_from_disk(rollout_engine, meta: WeightUpdateMeta, *, rank: int, save, tokenizer,
                     experiment: str, trial: str, version: int, cpu_group) -> None:
    """``disk``: the inference engine loads ``meta.path`` while ``save`` (the engine's own,
    ``hf``) writes it; rank 0 publishes AReaL's name-resolve record (see the module doc)."""
    from areal.utils import name_resolve, names

    if meta.path is None:
        raise ValueError("a disk weight update needs WeightUpdateMeta.path")
    main = rank == 0
    fut = None
    if main:
        rollout_engine.pause_generation()
        fut = rollout_engine.update_weights_from_disk(meta)
    save(SaveLoadMeta(path=meta.path, weight_format="hf", with_optim=False,
                      tokenizer=tokenizer))
    if main:
        key = names.update_weights_from_disk(experiment, trial, version)
        # replace: a resumed run publishes the version of the run it resumes again
        name_resolve.add(key, str(datetime.now().timestamp()), keepalive_ttl=120,
                         replace=True)
        fut.result()
        rollout_engine.continue_generation()
    comm.barrier(cpu_group)


def init_weight_update_group(rollout_engine, meta: WeightUpdateMeta, *, rank: int):
    """The NCCL group {trainer rank 0} ∪ inference workers, as FSDPEngine builds it (one
    group; inference pipeline parallelism is refused): ``(group or None, (address, port))``."""
    from areal.engine.core.distributed import init_custom_process_group
    from areal.infra.platforms import current_platform
    from areal.utils.constants import DIST_GROUP_DEFAULT_TIMEOUT
    from areal.utils.network import find_free_ports, format_host_for_url, gethostip

    alloc = meta.gen_allocation
    if alloc is None:
        raise ValueError("an xccl WeightUpdateMeta needs gen_allocation (the inference "
                         "engine's allocation): use WeightUpdateMeta.from_fsdp_xccl")
    if alloc.parallel.pp_size > 1:
        raise NotImplementedError(f"xccl weight update to an inference engine with "
                                  f"pipeline parallelism {alloc.parallel.pp_size} > 1")
    meta.nccl_master_address = gethostip()
    meta.nccl_master_port = find_free_ports(1)[0]
    meta.nccl_group_name = _GROUP_NAME
    address = (meta.nccl_master_address, meta.nccl_master_port)
    group = None
    if rank == 0:
        fut = rollout_engine.init_weights_update_group(meta)
        host = format_host_for_url(meta.nccl_master_address)
        group = init_custom_process_group(
            backend=current_platform.communication_backend,
            world_size=alloc.parallel.world_size + 1,
            init_method=f"tcp://{host}:{meta.nccl_master_port}", rank=0,
            group_name=_GROUP_NAME, timeout=DIST_GROUP_DEFAULT_TIMEOUT)
        fut.result()
    return group, address


def update_from_distributed(core, rollout_engine, meta: WeightUpdateMeta, *, rank: int, group,
                            address, cpu_group, use_lora: bool) -> None:
    """``xccl``: the whole weights (sharded: gathered, every rank takes part) broadcast by
    rank 0 bucket by bucket, each announced with its ``ParamSpec`` list first."""
    if use_lora:
        raise NotImplementedError("DTATrainEngine with use_lora=True updates the inference "
                                  "engine's adapter by disk (weight_update_mode=disk)")
    main = rank == 0
    meta.nccl_master_address, meta.nccl_master_port = address
    meta.nccl_group_name = _GROUP_NAME
    if main:
        rollout_engine.pause_generation()
    comm.barrier(cpu_group)
    named = ((n, export_tensor(t)) for n, t in core.named_full_tensors())
    if main:
        for bucket in param_buckets(named, meta.weight_chunked_mem_mb * 1024 * 1024):
            specs = [ParamSpec(name=n, shape=tuple(t.shape),
                               dtype=str(t.dtype).split("torch.")[1]) for n, t in bucket]
            fut = rollout_engine.update_weights_from_distributed(meta, specs)
            broadcast_bucket([t for _, t in bucket], group)
            fut.result()
    else:
        for _ in named:  # the gathers rank 0 makes
            pass
    comm.barrier(cpu_group)
    if main:
        rollout_engine.continue_generation()


def export_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor (the compute dtype) as the inference engine receives it: on the
    accelerator the collective runs on."""
    from areal.infra.platforms import current_platform

    if tensor.device.type == "cpu" and torch.cuda.is_available():
        tensor = tensor.to(current_platform.device_type)
    return tensor

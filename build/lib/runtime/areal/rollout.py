"""The rollout side of AReaL's ``TrainEngine`` API on ``DTATrainEngine``, as ``FSDPEngine``
does it (areal 1.0.4, ``engine/fsdp_engine.py:560-1690``):

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

__all__ = ["RolloutMixin", "broadcast_bucket", "param_buckets"]

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


class RolloutMixin:
    """``connect_engine``, ``update_weights``, ``rollout_batch``, ``prepare_batch``,
    ``set_version`` / ``get_version`` (needs ``core``, ``groups``, ``rank``, ``config``,
    ``tokenizer``, ``save``, ``_require_model``, ``_offload_aware``)."""

    _version = 0
    rollout_engine = None
    rollout_coordinator = None
    weight_update_group = None

    # ------------------------------------------------------------------ connection --
    def connect_engine(self, engine, meta: WeightUpdateMeta):
        """Connect the inference engine the rollouts run on and the weights go to."""
        from areal.infra.dist_rollout import DistRolloutCoordinator

        if meta.type not in ("disk", "xccl"):
            raise ValueError(f"weight update type {meta.type!r} is not supported by "
                             "DTATrainEngine; use 'disk' or 'xccl'")
        self._ensure_groups()  # the coordinator's barriers need process groups
        self.rollout_engine = engine
        self.rollout_coordinator = DistRolloutCoordinator(rollout_engine=engine, train_engine=self)
        if meta.type == "xccl" and self.weight_update_group is None:
            self._init_weight_update_group(meta)
        comm.barrier(self.groups.cpu)

    def _check_connected(self):
        if self.rollout_engine is None or self.rollout_coordinator is None:
            raise RuntimeError("no inference engine connected: call connect_engine(engine, "
                               "meta) before rollout_batch / prepare_batch / update_weights")

    def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size: int = 1):
        """AReaL's synchronous rollout of ``data`` on the connected inference engine."""
        self._check_connected()
        return self.rollout_coordinator.rollout_batch(
            data, workflow=workflow, workflow_kwargs=workflow_kwargs, group_size=group_size)

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None,
                      group_size: int = 1, dynamic_bs: bool = False):
        """The next training batch from the connected inference engine (AReaL's
        staleness-controlled ``prepare_batch``)."""
        self._check_connected()
        return self.rollout_coordinator.prepare_batch(
            dataloader, workflow=workflow, workflow_kwargs=workflow_kwargs,
            should_accept_fn=should_accept_fn, group_size=group_size, dynamic_bs=dynamic_bs)

    # ----------------------------------------------------------------- weight update --
    def update_weights(self, meta: WeightUpdateMeta):
        """Push the current weights to the connected inference engine (``disk`` or
        ``xccl``, see the module doc)."""
        self._check_connected()
        self._require_model()
        with self._offload_aware():
            if meta.type == "disk":
                self._update_weights_from_disk(meta)
            elif meta.type == "xccl":
                if self.weight_update_group is None and self.rank == 0:
                    raise RuntimeError("xccl weight update without a weight-update group: "
                                       "connect_engine(engine, meta) with an xccl meta first")
                self._update_weights_from_distributed(meta)
            else:
                raise ValueError(f"weight update type {meta.type!r} is not supported by "
                                 "DTATrainEngine; use 'disk' or 'xccl'")

    def _update_weights_from_disk(self, meta: WeightUpdateMeta):
        from areal.utils import name_resolve, names

        if meta.path is None:
            raise ValueError("a disk weight update needs WeightUpdateMeta.path")
        main = self.rank == 0
        fut = None
        if main:
            self.rollout_engine.pause_generation()
            fut = self.rollout_engine.update_weights_from_disk(meta)
        self.save(SaveLoadMeta(path=meta.path, weight_format="hf", with_optim=False,
                               tokenizer=self.tokenizer))
        if main:
            key = names.update_weights_from_disk(self.config.experiment_name,
                                                 self.config.trial_name, self.get_version())
            # replace: a resumed run publishes the version of the run it resumes again
            name_resolve.add(key, str(datetime.now().timestamp()), keepalive_ttl=120,
                             replace=True)
            fut.result()
            self.rollout_engine.continue_generation()
        comm.barrier(self.groups.cpu)

    def _init_weight_update_group(self, meta: WeightUpdateMeta):
        """The NCCL group {trainer rank 0} ∪ inference workers, as FSDPEngine builds it
        (one group; inference pipeline parallelism is refused)."""
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
        self._weight_update_address = (meta.nccl_master_address, meta.nccl_master_port)
        if self.rank == 0:
            fut = self.rollout_engine.init_weights_update_group(meta)
            host = format_host_for_url(meta.nccl_master_address)
            self.weight_update_group = init_custom_process_group(
                backend=current_platform.communication_backend,
                world_size=alloc.parallel.world_size + 1,
                init_method=f"tcp://{host}:{meta.nccl_master_port}", rank=0,
                group_name=_GROUP_NAME, timeout=DIST_GROUP_DEFAULT_TIMEOUT)
            fut.result()

    def _update_weights_from_distributed(self, meta: WeightUpdateMeta):
        if self.use_lora:
            raise NotImplementedError("DTATrainEngine with use_lora=True updates the inference "
                                      "engine's adapter by disk (weight_update_mode=disk)")
        main = self.rank == 0
        meta.nccl_master_address, meta.nccl_master_port = self._weight_update_address
        meta.nccl_group_name = _GROUP_NAME
        if main:
            self.rollout_engine.pause_generation()
        comm.barrier(self.groups.cpu)
        # whole tensors (sharded: gathered, every rank takes part); rank 0 sends
        named = ((n, self._export_tensor(t)) for n, t in self.core.named_full_tensors())
        if main:
            for bucket in param_buckets(named, meta.weight_chunked_mem_mb * 1024 * 1024):
                specs = [ParamSpec(name=n, shape=tuple(t.shape),
                                   dtype=str(t.dtype).split("torch.")[1]) for n, t in bucket]
                fut = self.rollout_engine.update_weights_from_distributed(meta, specs)
                broadcast_bucket([t for _, t in bucket], self.weight_update_group)
                fut.result()
        else:
            for _ in named:  # the gathers rank 0 makes
                pass
        comm.barrier(self.groups.cpu)
        if main:
            self.rollout_engine.continue_generation()

    def _export_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A whole tensor (the compute dtype) as the inference engine receives it: on the
        accelerator the collective runs on."""
        from areal.infra.platforms import current_platform

        if tensor.device.type == "cpu" and torch.cuda.is_available():
            tensor = tensor.to(current_platform.device_type)
        return tensor

    # ----------------------------------------------------------------------- versions --
    def set_version(self, version: int):
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

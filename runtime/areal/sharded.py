"""Sharded layouts of ``DTATrainEngine``: ``zero1`` and ``fsdp`` through ``runtime.sharding``.

AReaL's ``fsdp:dN`` backend means FSDP2 sharding over the N data-parallel ranks. The engine
shards the same way: ``fsdp`` by default whenever there is more than one rank, or what
``actor.dta.sharding`` (:class:`~runtime.areal.options.DTAOptions`) says
(:func:`resolve_sharding`); the runtime's modes (``runtime.sharding.make_mode``) do all the communication around the
walk, which never knows it is distributed:

- ``zero1``: the compute-dtype parameters are gathered once per step and kept for the walk;
  after it, one reduce-scatter (fp32), the clip by the global norm and AdamW on this rank's
  slice of fp32 master weights (optimizer state sharded), one all-gather of the new weights;
- ``fsdp``: FSDP2 ``fully_shard`` per decoder layer (fp32 ``Shard(0)`` DTensors gathered per
  call in the compute dtype, gradients reduce-scattered in fp32); the embedding and LM head
  as zero1-style flat shards; the ranks' decoder calls matched by ``runtime.sharding.lockstep``
  under both memory policies (under ``retain`` the mode asks the walker for one LM-head flush
  per pack: :attr:`ShardedLayout.walk_options`).

The runtime's modes SUM the ranks' gradients, where FSDPEngine averages them after scaling
each rank's loss by the data-parallel size: ``train_batch`` then scales by
``loss_weight_fn(mb) / Σ loss_weight_fn`` without the ``× DP size`` — the same gradient.

What the engine needs beyond the step is here: the whole weights gathered in the compute
dtype (HF export on rank 0, disk and xccl weight updates), an HF folder loaded into the
shards (fp32 masters included), and the sharded state DCP writes (``runtime/areal/dcp.py``).
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from runtime.engine.layout import ParallelLayout, reduction_of
from runtime.engine.step import optimizer_step
from runtime.sharding import make_mode, master_dtype_for, mode_class

__all__ = ["ShardedLayout", "resolve_sharding"]

logger = logging.getLogger("DTATrainEngine")


def resolve_sharding(option: str | None, world_size: int, *, trains: bool = True) -> str:
    """The layout of an engine: ``replicate`` on one rank (nothing to shard) and for an
    inference-only engine left unset; else the ``actor.dta.sharding`` option, or — unset —
    what AReaL's ``fsdp:dN`` means: ``fsdp``. Raises ValueError naming the key for a sharded
    mode without an optimizer."""
    if world_size <= 1:
        return "replicate"
    if option is None:
        return "fsdp" if trains else "replicate"
    if option != "replicate" and not trains:
        raise ValueError(f"actor.dta.sharding={option} needs an optimizer: an engine with "
                         "optimizer=None is inference only and runs replicated "
                         "(leave actor.dta.sharding unset)")
    return option


class ShardedLayout:
    """A ``runtime.sharding`` strategy (``zero1`` / ``fsdp``) over the data-parallel group,
    with what ``DTATrainEngine`` needs of it. ``model`` must be built in the master dtype
    (fp32 for 16-bit compute); it is cast / sharded in place."""

    def __init__(self, mode: str, model, make_optimizer, *, compute_dtype: torch.dtype,
                 policy: str, group=None, context_parallel: int = 1):
        if not mode_class(mode).sharded:
            raise ValueError(f"ShardedLayout shards zero1 or fsdp, not {mode!r}")
        built = next(model.parameters()).dtype
        if built != master_dtype_for(compute_dtype):
            raise ValueError(f"sharding={mode}: the model must be built in "
                             f"{master_dtype_for(compute_dtype)} (the master dtype of "
                             f"{compute_dtype}), got {built}")
        self.mode, self.compute_dtype, self.group = mode, compute_dtype, group
        self.policy = policy
        # who reduces what (runtime.engine.layout.reduction_of: the model's context-parallel
        # contract, read there): partial gradients are summed over the world; copies of one
        # gradient are counted once (fsdp divides its in-backward sum by C, the group's
        # other ranks drop what is reduced after the walk)
        layout = ParallelLayout(world=dist.get_world_size() if dist.is_initialized() else 1,
                                context_parallel=context_parallel, sharding=mode,
                                rank=dist.get_rank() if dist.is_initialized() else 0)
        self.reduction = reduction_of(layout, model)
        self.strategy = make_mode(mode, model, make_optimizer, group=group,
                                  compute_dtype=compute_dtype, policy=policy,
                                  divide_factor=self.reduction.divide_factor)
        self.model = self.strategy.model
        self.optimizer = self.strategy.optimizer
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        logger.info("sharding=%s over %d ranks (compute %s, masters %s)", mode,
                    dist.get_world_size(group), compute_dtype, built)

    @property
    def walk_options(self) -> dict:
        """Walker options the mode needs (``dta.walk.Walker`` keyword arguments)."""
        return dict(mode_class(self.mode).walk_needs(self.policy))

    # ------------------------------------------------------------------- the step --
    def zero_grad(self) -> None:
        """Clear the gradients (under fsdp this also opens the step's matched-call session,
        closed by :meth:`step`)."""
        self.strategy.zero_grad()

    def step(self, max_grad_norm) -> tuple[float, bool]:
        """Reduce (SUM) the gradients, clip by the global norm, step; on a non-finite norm
        nothing is updated. Returns ``(grad_norm, updated)``."""
        return optimizer_step(self.strategy, self.reduction, max_grad_norm)

    @contextlib.contextmanager
    def walk_session(self):
        """Around a walk outside ``train_batch`` (forward / eval): under fsdp the ranks'
        decoder calls are matched for its duration (each rank walks its own sequences)."""
        sync = getattr(self.strategy, "sync", None)
        if sync is None or sync.active:
            yield
            return
        sync.begin()
        try:
            yield
        except BaseException:
            sync.active = False
            raise
        sync.end()

    # ----------------------------------------------------------- gathered weights --
    def _full(self, p: torch.Tensor) -> torch.Tensor:
        t = p.detach()
        if hasattr(t, "full_tensor"):  # an FSDP2 DTensor: all-gather (a collective)
            t = t.full_tensor()
        if t.is_floating_point() and t.dtype != self.compute_dtype:
            t = t.to(self.compute_dtype)
        return t

    def named_full_tensors(self):
        """``(name, whole tensor in the compute dtype)`` for each parameter, in the model's
        order. Under fsdp each sharded parameter is an all-gather: every rank iterates."""
        for name, p in self.model.named_parameters():
            yield name, self._full(p)

    def full_state_dict(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """The model's state dict with whole tensors in the compute dtype (tied weights
        under both names), on CPU. Every rank calls it; ``keep=False`` takes part in the
        gathers without holding the result (returns ``{}``)."""
        by_id: dict[int, torch.Tensor] = {}
        full: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in by_id:
                t = self._full(p)
                by_id[id(p)] = t.cpu().clone() if keep else None
            full[name] = by_id[id(p)]
        if not keep:
            return {}
        for name, b in self.model.named_buffers():
            full[name] = b.detach().cpu().clone()
        return {k: full[k] for k in self.model.state_dict() if k in full}

    @torch.no_grad()
    def load_full_state(self, state: dict[str, torch.Tensor], *, what: str) -> None:
        """Whole tensors (an HF folder read on every rank) into the layout: the compute
        parameters, FSDP's shards and the fp32 master slices. Every parameter must be in
        ``state`` (``what`` names the source in the error)."""
        named = list(self.model.named_parameters())
        missing = [n for n, _ in named if n not in state]
        if missing:
            raise ValueError(f"{what} does not match the model: missing {missing[:5]}"
                             f"{' …' if len(missing) > 5 else ''}")
        for name, p in named:
            src = state[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{what}: {name} has shape {tuple(src.shape)}, the model "
                                 f"{tuple(p.shape)}")
            if hasattr(p, "device_mesh"):  # FSDP2: this rank's shard of the whole tensor
                from torch.distributed.tensor import distribute_tensor

                p.copy_(distribute_tensor(src.to(device=p.device, dtype=p.dtype),
                                          p.device_mesh, p.placements, src_data_rank=None))
            else:
                p.copy_(src.to(device=p.device, dtype=p.dtype))
        for name, b in self.model.named_buffers():
            if name in state:
                b.copy_(state[name].to(device=b.device, dtype=b.dtype))
        flat = getattr(self.strategy, "shards", None) or getattr(self.strategy, "vocab")
        _masters_from_parameters(flat, state)

    # --------------------------------------------------------------- checkpoints --
    def dcp_state(self) -> dict:
        """The sharded state (``runtime.sharding``'s DCP views: masters, optimizer state,
        step counts; written and loaded in place by ``runtime.dcp``)."""
        return self.strategy.sharded_state()

    def param_norm(self) -> float:
        """L2 norm of all parameters (the masters; a collective)."""
        return self.strategy.param_norm()

    def state_bytes(self) -> dict:
        """This rank's ``{params, grads, optimizer}`` bytes (the last step's peak)."""
        return self.strategy.state_bytes()


def _masters_from_parameters(flat, state: dict[str, torch.Tensor]) -> None:
    """A flat shard's fp32 master slice from whole tensors (``state``, by the shard's
    parameter names), so the next step starts from the loaded weights."""
    for pc in flat.pieces:
        src = state[flat.names[pc.index]].reshape(-1)[pc.start:pc.stop]
        flat.master[pc.offset:pc.offset + pc.stop - pc.start].copy_(
            src.to(device=flat.master.device, dtype=flat.master.dtype))

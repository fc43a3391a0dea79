"""A sharding mode is built from parts: one part per kind of trained state.

The kinds are the decoder layers (every dense parameter, for the modes that do not tell them
apart), the vocabulary-sized weights (embedding and LM head) and the expert slices. What a
mode does with each kind is the choice of one :class:`Part` class:

- :class:`~runtime.sharding.replicate.ReplicaPart` (``replicate``): every rank holds the part
  whole, its gradients are all-reduced over its group;
- :class:`FlatPart` (``zero1``, fsdp's vocabulary, every sharded mode's expert slices): flat
  shards (:mod:`.flat`), one reduce-scatter per step;
- :class:`~runtime.sharding.fsdp.LayerPart` (``fsdp``, ``zero2``): FSDP2 units, the
  gradients reduce-scattered per call.

Each part owns its group (its state split, or its gradients summed, over it) and
``replicas`` (HSDP: the ranks holding the same shards, summed once per step by the mode:
:meth:`runtime.sharding.base.Sharding.reduce_gradients`), where its masters and optimizer
state live (``offload``: on the host), what the optimizer steps for it (``stepped``), its
norm contribution (``grad_squared`` / ``param_squared``: Σ over its group; an ``expert``
part's is summed over the expert-parallel group once, by the mode), its bytes and
``held()`` for the logical checkpoint view (:mod:`.logical`). The mode
(:class:`~runtime.sharding.base.Sharding`) loops over its parts.

What every mode asks alike is answered here, once: whether its parts offload
(:func:`offloaded`, :func:`sums_on_host`), which parameters are expert slices (:func:`split_experts`) and the
sharded modes' one choice for them (:func:`expert_flat_parts`); tests/test_sharding_parts.py
holds the modes to it.
"""
from __future__ import annotations

import torch

from runtime.sharding.common import tensor_bytes
from runtime.sharding.experts import ExpertPart
from runtime.sharding.flat import FlatShards

__all__ = ["Part", "FlatPart", "offloaded", "sums_on_host", "split_experts",
           "expert_flat_parts"]


def offloaded(layout) -> bool:
    """Whether the layout keeps the parts' masters and optimizer state on the host
    (``train.offload=optimizer`` or ``gradients``, :mod:`.offload`); no layout: on the
    device."""
    return layout is not None and layout.offload != "none"


def sums_on_host(layout) -> bool:
    """Whether the layers' per-call fp32 gradient sum lives on the host too
    (``train.offload=gradients``: fsdp's and zero2's, :mod:`.layers`)."""
    return layout is not None and layout.offload == "gradients"


def split_experts(model, groups, named) -> tuple:
    """``(experts, dense, slices)``: the model's :class:`~runtime.sharding.experts.ExpertPart`
    (None without expert parallelism) and ``named``'s ``(name, parameter)`` pairs split into
    the dense ones and the expert slices (none without expert parallelism), in order."""
    named = list(named)
    experts = ExpertPart.of(model, groups)
    if experts is None:
        return None, named, []
    return (experts, *experts.split(named))


def expert_flat_parts(experts, slices, **flat) -> list:
    """The sharded modes' part for the expert slices: the trained ones as flat shards over
    their replicas (ZeRO-1 of the slices, ``flat``: :class:`FlatPart`'s compute dtype and
    offload); none where no slice is trained."""
    trained = [(n, p) for n, p in slices if p.requires_grad]
    return [FlatPart(trained, group=experts.replicas, experts=experts, **flat)] \
        if trained else []


class Part:
    """One kind of trained state under one choice (module doc)."""

    stepped: list  # what the optimizer steps for this part
    offload: bool = False  # masters and optimizer state on the host
    expert: bool = False  # expert slices: the norm adds the expert-parallel group's
    replicas = None  # HSDP: the group holding the same shards (summed once per step)
    grad_bytes: int = 0  # the gradients it held at its peak this step

    # ------------------------------------------------------------------ the step --
    def zero_grad(self) -> None:
        raise NotImplementedError

    def reduce(self) -> None:
        """Its step's reduction inside its group (after the walk)."""

    def replica_terms(self) -> tuple[list, list, list]:
        """(flat shards, gradients, their like) for the step's one cross-replica sum."""
        return [], [], []

    def replica_summed(self, grads: list) -> None:
        """The gradients of :meth:`replica_terms` summed over the replicas."""

    def held_gradients(self) -> int:
        """Bytes of gradients it holds after the reduction (its peak: ``grad_bytes``)."""
        return self.grad_bytes

    def grad_squared(self) -> float:
        raise NotImplementedError

    def param_squared(self) -> float:
        raise NotImplementedError

    def scale(self, coef: float) -> None:
        raise NotImplementedError

    def to_optimizer(self) -> None:
        """Hand the reduced (clipped) gradients to what the optimizer steps."""

    def after_step(self) -> None:
        """After the optimizer's step: the model's weights from what it stepped."""
        self.discard()
        self.masters_loaded()

    def discard(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ the masters --
    def load_masters(self, state: dict) -> None:
        raise NotImplementedError

    def masters_loaded(self) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- reporting --
    def held(self) -> list:
        raise NotImplementedError

    def bytes(self) -> dict:
        """``params`` (device) and ``host`` bytes of the weights it keeps; the optimizer's
        state is counted by the mode (:meth:`optimizer_bytes`)."""
        raise NotImplementedError

    def optimizer_bytes(self, optimizer) -> int:
        """The optimizer state of what it steps."""
        return int(sum(tensor_bytes(v) for s in self.stepped
                       for v in optimizer.state.get(s, {}).values() if torch.is_tensor(v)))


class FlatPart(Part):
    """Flat shards of ``named`` over ``group`` (:class:`~runtime.sharding.flat.FlatShards`):
    the compute copy gathered once per step, one reduce-scatter per step. ``experts``: the
    expert slices' :class:`~runtime.sharding.experts.ExpertPart` (their checkpoint view is
    their whole tensors' flat ranges)."""

    def __init__(self, named, *, group=None, replicas=None, compute_dtype=None,
                 offload=False, experts=None):
        self.flat = FlatShards(list(named), group=group, compute_dtype=compute_dtype,
                               offload=offload)
        self.replicas, self.offload = replicas, bool(offload)
        self.experts, self.expert = experts, experts is not None
        self.stepped = self.flat.master_params
        self._compute_grads = 0

    def zero_grad(self) -> None:
        for p in self.flat.params:
            p.grad = None
        self.flat.zero_master_grads()

    def reduce(self) -> None:
        self._compute_grads = self.flat.bytes()["compute_grads"]
        self.flat.reduce_gradients()

    def replica_terms(self):
        return [self.flat], [], []

    def held_gradients(self) -> int:
        """The whole compute gradients before the reduction, or the reduced slice."""
        return max(self._compute_grads, self.flat.bytes()["grad_shard"])

    def grad_squared(self) -> float:
        return self.flat.grad_norm_squared()

    @torch.no_grad()
    def param_squared(self) -> float:
        f = self.flat  # over the flat's group (HSDP's replicas hold the same)
        return float(f._all_reduce(f.master.double().pow(2).sum().to(f.device)))

    def scale(self, coef: float) -> None:
        self.flat.scale_gradients(coef)

    def to_optimizer(self) -> None:
        self.flat.step_gradients()

    def discard(self) -> None:
        self.flat.zero_master_grads()

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        self.flat.load_masters(state)

    def masters_loaded(self) -> None:
        self.flat.gather_parameters()

    def held(self) -> list:
        return self.experts.held_flat(self.flat) if self.expert else self.flat.held()

    def bytes(self) -> dict:
        b = self.flat.bytes()
        return {"params": b["compute_params"] + b["master"], "host": b["host"]}

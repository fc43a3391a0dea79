"""The one interface of a sharding mode, and the registry that names them.

A mode is a registered class (``@register``, as verl's ``EngineRegistry``): the names are
:data:`dta.planning.memory.SHARDINGS` -- the modes the memory model prices, the one list the
config, the planner and the runtimes read -- and a registered class for a name the planner
does not price (or a priced name left without a class) is refused when this package is
imported. The engine core (:mod:`runtime.engine`) is the only caller of the step's pieces:

1. ``zero_grad()`` before the walk (fsdp also opens its matched-call session);
2. the walk accumulates this rank's share into the model's ``.grad``;
3. ``reduce_gradients()``: the mode's collective, a SUM over its group (all-reduce,
   reduce-scatter);
4. ``grad_norm()`` (global; a collective where sharded), then the engine's one clip rule
   (``scale_gradients(coef)``) and ``apply_update()``, or ``discard_gradients()`` on a
   non-finite norm.

``matched_calls``: whether the mode gathers inside the decoder calls (fsdp), so the ranks'
calls must be kept matched (``runtime.engine.lockstep``, run by the engine core; what that
asks of the walk is the layout's: ``ParallelLayout.walk_needs``). ``forward_steps(inner)``:
the collectives one decoder forward makes, in order, as calls that make them without a
forward -- the mode's own (fsdp's unshard / reshard per unit) around ``inner`` (per decoder
layer index, the model's own: expert parallelism's exchanges).

What the optimizer steps -- the *masters*: zero1's / fsdp's fp32 slices, replicate's masters
where kept, or, offloaded, host copies of the trained weights -- is loaded two ways:
``load_masters(state)`` from whole tensors (after the model's own weights were set), and
``masters_loaded()`` after a checkpoint filled the masters in place (the model's weights are
refreshed from them).

Every mode takes the layout's HSDP shard size (:mod:`.hsdp`) and offload choice
(:mod:`.offload`) from the ``layout`` and ``groups`` it is built with.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch

import runtime.sharding.residence as residence
from dta.planning.memory import SHARDINGS as PRICED
from runtime.errors import ShardingRefused
from runtime.sharding.common import tensor_bytes

__all__ = ["Sharding", "register", "sharding_class", "registered"]

_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator: the sharding mode ``name`` (one of the priced modes, once)."""
    def add(cls):
        if name not in PRICED:
            raise ValueError(f"sharding mode {name!r} is not priced by the memory model "
                             f"(dta.planning.memory.SHARDINGS: {PRICED})")
        if name in _REGISTRY:
            raise ValueError(f"sharding mode {name!r} is registered twice "
                             f"({_REGISTRY[name].__name__}, {cls.__name__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return add


def registered() -> tuple[str, ...]:
    """The registered modes, in the planner's order (least communication first)."""
    return tuple(m for m in PRICED if m in _REGISTRY)


def sharding_class(name: str) -> type:
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown sharding mode {name!r}; choose one of {registered()}")
    return cls


def master_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """fp32 master weights under 16-bit compute; otherwise the compute dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class Sharding:
    """What every mode provides (see the module doc). Built on the model in
    :meth:`storage_dtype`; ``make_optimizer(params)`` builds the optimizer over what the mode
    steps."""

    name: ClassVar[str]
    sharded: ClassVar[bool] = True  # state split over the ranks: DCP checkpoints
    holds_frozen: ClassVar[bool] = True  # can hold weights it does not train (a LoRA base)

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    @classmethod
    def storage_dtype(cls, compute: torch.dtype, masters: torch.dtype | None = None
                      ) -> torch.dtype:
        """The dtype the model is built in: its master weights' (a sharded mode keeps
        ``master_dtype_for(compute)``; ``masters``, when given, must be that). ``replicate``
        keeps masters only when asked (:mod:`.replicate`)."""
        kept = master_dtype_for(compute) if cls.sharded else compute
        if masters is not None and masters != kept:
            raise ShardingRefused(f"sharding={cls.name} keeps {kept} master weights for "
                             f"{compute} compute, not {masters}")
        return kept

    matched_calls: ClassVar[bool] = False  # gathers inside decoder calls (fsdp)
    holds_experts: ClassVar[bool] = False  # handles expert slices (runtime.sharding.experts)
    experts = None  # its runtime.sharding.experts.ExpertPart under expert parallelism

    def forward_steps(self, inner: dict) -> list:
        """The collectives of one decoder forward, in order (see the module doc): here the
        model's own, ``inner`` (decoder layer index -> calls), in layer order."""
        return [step for i in sorted(inner) for step in inner[i]]

    # ------------------------------------------------------------------ the step --
    # A mode is built from parts (:mod:`.parts`): ``self.parts``, the optimizer over their
    # ``stepped``, ``self.device`` (where the norms are summed) and ``self.frozen`` (weights
    # held in the compute dtype, not trained). The step loops over the parts.
    parts: list
    frozen: list = []
    _grad_bytes: int = 0

    def release_gathered(self) -> None:
        """After a walk with matched calls: free what the mode keeps gathered (fsdp's units)."""

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def reduce_gradients(self) -> None:
        """Each part's reduction inside its group, then HSDP's one sum across the replicas
        (every part replicated over them, in one bucketed all-reduce)."""
        from runtime.sharding.hsdp import sum_step_over_replicas

        for part in self.parts:
            part.reduce()
        across = [p for p in self.parts if p.replicas is not None]
        if across:
            flats, grads, like, spans = [], [], [], []
            for part in across:
                f, g, lk = part.replica_terms()
                flats += f
                spans.append((len(grads), len(g)))
                grads += g
                like += lk
            out = sum_step_over_replicas(across[0].replicas, flats, grads, like)
            for part, (at, n) in zip(across, spans):
                if n:
                    part.replica_summed(out[at:at + n])
        self._grad_bytes = sum(p.held_gradients() for p in self.parts)

    @property
    def expert_shards(self):
        """The expert slices' flat shards (:class:`~runtime.sharding.flat.FlatShards`), if a
        part holds them so."""
        return next((getattr(p, "flat", None) for p in self.parts if p.expert), None)

    def _norm(self, squared) -> float:
        """√(Σ over the dense parts + the expert parts' Σ summed over the expert group)."""
        dense = sum(squared(p) for p in self.parts if not p.expert)
        experts = [squared(p) for p in self.parts if p.expert]
        return math.sqrt(dense + (self._experts_squared(sum(experts)) if experts else 0.0))

    def _experts_squared(self, value: float) -> float:
        """The expert slices' Σ² (over their replicas), summed over the expert group."""
        return self.experts.group_sum(value, self.device)

    def grad_norm(self) -> float:
        return self._norm(lambda p: p.grad_squared())

    def scale_gradients(self, coef: float) -> None:
        for part in self.parts:
            part.scale(coef)

    @torch.no_grad()
    def apply_update(self) -> None:
        for part in self.parts:
            part.to_optimizer()
        self.optimizer.step()
        for part in self.parts:
            part.after_step()

    def discard_gradients(self) -> None:
        for part in self.parts:
            part.discard()

    # ------------------------------------------------------------ the masters --
    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """Whole tensors (by parameter name; those absent: from the model's parameters) into
        what the optimizer steps, after the model's weights were set from them."""
        for part in self.parts:
            part.load_masters(state)

    @torch.no_grad()
    def masters_loaded(self) -> None:
        """The masters were loaded in place (a checkpoint): the model's weights from them."""
        for part in self.parts:
            part.masters_loaded()

    # ------------------------------------------------------------------ residence --
    def to(self, where: str, *, fresh: bool = False) -> None:
        """``"host"``: every tensor the mode holds on an accelerator -- parameters, gradients,
        masters, optimizer state, flat shards, FSDP2's shards -- to host memory (a colocated
        rollout takes the accelerator); ``"device"``: what went, back where it was. Views stay
        views, every layout alike (:mod:`.residence`). ``fresh``: copy every storage, even
        one already in place (a CPU-only machine's host is its device)."""
        if where not in ("host", "device"):
            raise ValueError(f"Sharding.to({where!r}): 'host' or 'device'")
        parked = getattr(self, "_parked", None)
        if where == "host" and parked is None:
            self._parked = residence.offload(self, fresh=fresh)
        elif where == "device" and parked is not None:
            self._parked = None
            residence.onload(parked, fresh=fresh)

    # --------------------------------------------------------------- reporting --
    def state_bytes(self) -> dict:
        """Bytes this rank holds: ``params``, ``grads``, ``optimizer`` on the device and
        ``host`` (an offloaded part's masters, gradient buffers and optimizer state)."""
        out = {"params": sum(tensor_bytes(p) for p in self.frozen), "grads": self._grad_bytes,
               "optimizer": 0, "host": 0}
        for part in self.parts:
            b = part.bytes()
            out["params"] += b["params"]
            out["host"] += b["host"]
            out["host" if part.offload else "optimizer"] += part.optimizer_bytes(self.optimizer)
        return out

    @torch.no_grad()
    def param_norm(self) -> float:
        return self._norm(lambda p: p.param_squared())

    @torch.no_grad()
    def full_state(self) -> dict:
        """The model's state dict on the host, whole: FSDP2's shards and the expert slices
        gathered (a collective: call it on every rank)."""
        ep = self.experts.ep if self.experts is not None else None
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            t = v.full_tensor() if hasattr(v, "full_tensor") else \
                ep.full_tensor(v) if ep is not None and id(v) in names and ep.is_expert(v) else v
            out[k] = t.detach().cpu().clone()
        return out

    def held(self) -> list:
        """This rank's pieces of the trained parameters (:class:`runtime.checkpoints.logical.
        Held`: a box or a flat range of the whole parameter, and what the optimizer steps
        for it), part by part."""
        return [h for part in self.parts for h in part.held()]

    # ------------------------------------------------------------- checkpoints --
    # One layout-independent view of the training state (runtime.checkpoints.logical): a mode
    # declares what this rank holds of each trained parameter; saving, loading under any
    # other layout and re-cutting are generic.
    def logical_shapes(self) -> list[tuple[str, tuple]]:
        """``(name, whole shape)`` of every trained parameter, in the model's order (a mode
        whose model holds a parameter's slice, e.g. experts, gives the whole shape)."""
        return [(n, self.experts.whole_shape(p) if self.experts is not None and
                 self.experts.holds(p) else tuple(p.shape))
                for n, p in self.model.named_parameters() if p.requires_grad]

    def vocab_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The trained embedding and LM-head weights (tied: once), in the model's order:
        what fsdp keeps as flat shards (and how its checkpoints before 2026-12-05 held them)."""
        m = self.model
        ids = {id(m.get_input_embeddings().weight), id(m.get_output_embeddings().weight)}
        return [(n, p) for n, p in m.named_parameters() if id(p) in ids and p.requires_grad]

    def logical_loaded(self) -> None:
        """After a load wrote this rank's pieces: derive the rest (gather the compute
        weights, cast the masters into the model)."""
        self.masters_loaded()

    def sharded_state(self) -> dict:
        """DCP's view (``runtime.checkpoints.sharded.save_sharded`` / ``load_sharded``): the logical state,
        loaded in place under any layout."""
        from runtime.checkpoints.logical import KEY, LogicalState

        return {KEY: LogicalState(self)}

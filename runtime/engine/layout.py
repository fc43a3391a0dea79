"""``ParallelLayout``: how one run is laid out over its ranks, decided once.

World size W, context-parallel size C (ranks per tree), data-parallel size W / C, the
sharding mode (a registered ``runtime.sharding`` mode, resolved: never ``auto``), the
expert-parallel size E, the shard size S (HSDP), the offload choice and this rank.

- Ranks ``[g·C, (g+1)·C)`` form context-parallel group g (they walk the same trees, their
  path K/V spread over the group); the ranks with the same place in their groups form a
  data-parallel group.
- Ranks ``[k·E, (k+1)·E)`` form expert-parallel group k: each holds 1/E of every MoE layer's
  routed experts (rank r the slice ``r mod E``); the ranks with the same place in their
  expert groups hold the same experts (the *expert replicas*, W / E ranks), over which the
  experts' gradients are summed and their sharded state is split.
- Ranks ``[j·S, (j+1)·S)`` form shard group j (HSDP: a node): the sharded state (zero1 /
  fsdp) is split over them and replicated across the W / S groups (the ranks with the same
  place in their shard groups: the *replica* group). S = W (the default): plain sharding
  over the world.
- ``offload``: where the optimizer's state (and, ``gradients``, the layers' per-call
  gradient sum) lives (:data:`dta.planning.state.OFFLOADS`).
- ``node_resident`` (fsdp, S < W: ZeRO++'s hpZ) and ``prefetch`` (fsdp): how its layers are
  gathered (:mod:`runtime.sharding.fsdp`).

Built and validated once, from any front door's configuration (:meth:`ParallelLayout.make`,
naming the front door's keys in its errors): ``dta train``'s ``ray.num_workers`` /
``train.context_parallel`` / ``train.sharding`` (``runtime.engine.resolve``), AReaL's
``fsdp:dNcM`` + ``actor.dta.sharding``, verl's ``ulysses_sequence_parallel_size`` + its
sharding option; then passed unchanged (:meth:`at` gives each rank its copy).

After ``torch.distributed`` is up, :func:`build_groups` makes the layout's process groups once
(:class:`ProcessGroups`), and :func:`reporting_of` says who reduces what
(:class:`Reporting`), reading the model's context-parallel contract in one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from runtime.errors import LayoutError, ShardingRefused

__all__ = ["ParallelLayout", "LayoutError", "ProcessGroups", "Reporting", "build_groups",
           "reporting_of", "check_model_fit"]


KEYS = {"world": "world size", "context_parallel": "context-parallel size",
        "sharding": "sharding mode", "rank": "rank", "expert_parallel": "expert-parallel size",
        "shard_size": "shard size", "offload": "offload", "node_resident": "node_resident",
        "prefetch": "prefetch"}


@dataclass(frozen=True)
class ParallelLayout:
    world: int = 1
    context_parallel: int = 1
    sharding: str = "replicate"
    rank: int = 0
    expert_parallel: int = 1
    shard_size: int | None = None  # None: the world (plain sharding)
    offload: str = "none"
    node_resident: bool = False  # fsdp under HSDP: hpZ (runtime.sharding.fsdp)
    prefetch: bool = False  # fsdp: the next layer's all-gather before the current computes
    # (field, the front door's key) pairs: how its errors name a setting (make's spelling)
    keys: tuple = dataclasses.field(default=(), compare=False, repr=False)

    def __post_init__(self):
        from dta.planning.state import OFFLOADS, offload_refusal
        from runtime.sharding import registered

        def bad(field, need):
            raise LayoutError(f"bad {KEYS[field]}: {getattr(self, field)!r} must be {need}")

        if self.shard_size is None:
            object.__setattr__(self, "shard_size", self.world)
        for field, low in (("world", 1), ("context_parallel", 1), ("rank", 0),
                           ("expert_parallel", 1), ("shard_size", 1)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                bad(field, f"an integer >= {low}")
        if self.world % self.context_parallel:
            bad("context_parallel", f"a divisor of the world size {self.world} (the "
                                    "data-parallel size is world / context parallel)")
        if self.rank >= self.world:
            bad("rank", f"below the world size {self.world}")
        if self.sharding not in registered():
            bad("sharding", f"one of {registered()} (auto is resolved before the layout)")
        if self.world == 1 and self.sharding != "replicate":
            bad("sharding", "replicate on one rank (nothing to shard): build the layout with "
                            "ParallelLayout.make")
        if self.world % self.expert_parallel:
            bad("expert_parallel", f"a divisor of the world size {self.world} (each group of "
                                   "that many ranks holds every expert once)")
        if self.world % self.shard_size:
            bad("shard_size", f"a divisor of the world size {self.world} (the state is "
                              "sharded over that many ranks, replicated across the groups)")
        if self.shard_size != self.world and not _mode_sharded(self.sharding):
            bad("shard_size", f"the world size {self.world} under sharding={self.sharding} "
                              "(it shards nothing: HSDP needs one of "
                              f"{tuple(m for m in registered() if _mode_sharded(m))})")
        if self.offload not in OFFLOADS:
            bad("offload", f"one of {OFFLOADS}")
        refused = offload_refusal(self.sharding, self.offload)
        if refused:
            bad("offload", f"none or optimizer: {refused}")
        for field in ("node_resident", "prefetch"):
            if not isinstance(getattr(self, field), bool):
                bad(field, "true or false")
        if self.node_resident and (self.sharding != "fsdp" or self.shard_size == self.world):
            bad("node_resident", f"false under sharding={self.sharding}, shard size "
                                 f"{self.shard_size} of {self.world} (it is fsdp's under "
                                 "HSDP: a shard size below the world, the node)")
        if self.prefetch and self.sharding != "fsdp":
            bad("prefetch", f"false under sharding={self.sharding} (fsdp gathers per layer)")

    @classmethod
    def make(cls, *, world: int, context_parallel: int = 1, sharding: str = "replicate",
             rank: int = 0, expert_parallel: int = 1, shard_size: int | None = None,
             offload: str = "none", node_resident: bool = False, prefetch: bool = False,
             spelling: Mapping[str, str] | None = None) -> "ParallelLayout":
        """The layout of a front door's settings (one rank: replicate, nothing to shard); an
        error names a setting as ``spelling`` says (field -> the front door's key)."""
        if world == 1 and sharding in _registered():
            sharding = "replicate"
        try:
            return cls(world=world, context_parallel=context_parallel, sharding=sharding,
                       rank=rank, expert_parallel=expert_parallel, shard_size=shard_size,
                       offload=offload, node_resident=node_resident, prefetch=prefetch,
                       keys=tuple((spelling or {}).items()))
        except LayoutError as exc:
            msg = str(exc)
            for field, key in (spelling or {}).items():
                msg = msg.replace(f"bad {KEYS[field]}:", f"bad value for {key}:", 1)
            raise LayoutError(msg) from None

    def check_model(self, config, *, frozen: bool = False) -> None:
        """This layout against the model (:func:`check_model_fit`), errors naming the front
        door's keys."""
        check_model_fit(config, expert_parallel=self.expert_parallel,
                        context_parallel=self.context_parallel, sharding=self.sharding,
                        frozen=frozen, keys=dict(self.keys))

    def at(self, rank: int) -> "ParallelLayout":
        """This layout as rank ``rank`` holds it."""
        return dataclasses.replace(self, rank=int(rank))

    # ------------------------------------------------------------------ derived --
    @property
    def data_parallel(self) -> int:
        return self.world // self.context_parallel

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group."""
        return self.rank % self.context_parallel

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group (the share of the batch it walks)."""
        return self.rank // self.context_parallel

    @property
    def head(self) -> int:
        """The first rank of this rank's context-parallel group."""
        return self.rank - self.cp_rank

    @property
    def is_head(self) -> bool:
        return self.rank == self.head

    @property
    def sharded(self) -> bool:
        """Whether the state is split over the ranks (DCP checkpoints; every rank takes part
        in gathering or saving it): a sharded mode, or expert slices (E > 1)."""
        return _mode_sharded(self.sharding) or self.expert_parallel > 1

    @property
    def replicas(self) -> int:
        """How many copies of the sharded state (HSDP: W / S; 1 under plain sharding)."""
        return self.world // self.shard_size

    @property
    def expert_rank(self) -> int:
        """Which slice of every MoE layer's experts this rank holds."""
        return self.rank % self.expert_parallel

    @property
    def experts_span_data(self) -> bool:
        """Whether an expert-parallel group spans data-parallel groups (ranks that walk
        different trees): E > 1 not dividing C."""
        return self.expert_parallel > 1 and self.context_parallel % self.expert_parallel != 0

    @property
    def matched_calls(self) -> bool:
        """Whether the ranks' decoder calls must be kept matched while each walks its own
        tree (``runtime.engine.lockstep``): the sharding mode gathers inside the calls
        (fsdp), or an expert-parallel group spans data-parallel groups."""
        from runtime.sharding import sharding_class

        return sharding_class(self.sharding).matched_calls or self.experts_span_data

    @property
    def lockstep_in_shard(self) -> bool:
        """Whether matched calls need matching only within HSDP's shard groups: S < W and
        every context- and expert-parallel group lies inside one (S a multiple of C and of
        E); the replicas then walk independently (their one sum is at the step)."""
        return (self.shard_size < self.world and self.shard_size % self.context_parallel == 0
                and self.shard_size % self.expert_parallel == 0)

    def walk_needs(self, policy: str) -> dict:
        """WalkOptions fields this layout needs under the memory ``policy``: with matched
        calls under retain, one backward per decoder call (the LM head flushed per pack,
        ``head_rows=0``)."""
        return {"head_rows": 0} if policy == "retain" and self.matched_calls else {}

    def matched_reason(self) -> str:
        """Why the calls are matched (for errors)."""
        from runtime.sharding import sharding_class

        why = [f"sharding={self.sharding}"] if sharding_class(self.sharding).matched_calls else []
        if self.experts_span_data:
            why.append(f"expert_parallel={self.expert_parallel} across data-parallel groups")
        return " and ".join(why) or "matched calls"

    def context_groups(self) -> list[list[int]]:
        C = self.context_parallel
        return [list(range(g * C, (g + 1) * C)) for g in range(self.data_parallel)]

    def data_groups(self) -> list[list[int]]:
        return [list(range(i, self.world, self.context_parallel))
                for i in range(self.context_parallel)]

    def expert_groups(self) -> list[list[int]]:
        E = self.expert_parallel
        return [list(range(k * E, (k + 1) * E)) for k in range(self.world // E)]

    def expert_replica_groups(self) -> list[list[int]]:
        return [list(range(i, self.world, self.expert_parallel))
                for i in range(self.expert_parallel)]

    def shard_groups(self) -> list[list[int]]:
        S = self.shard_size
        return [list(range(j * S, (j + 1) * S)) for j in range(self.replicas)]

    def replica_groups(self) -> list[list[int]]:
        return [list(range(i, self.world, self.shard_size)) for i in range(self.shard_size)]

    def record(self) -> dict:
        """JSON-ready (checkpoint metadata, reports)."""
        return {"world": self.world, "context_parallel": self.context_parallel,
                "data_parallel": self.data_parallel, "sharding": self.sharding,
                "expert_parallel": self.expert_parallel, "shard_size": self.shard_size,
                "offload": self.offload, "node_resident": self.node_resident,
                "prefetch": self.prefetch}


# ------------------------------------------------------------ against the model --
def check_model_fit(config, *, expert_parallel=1, context_parallel=1, sharding=None,
                    frozen: bool = False, keys: Mapping[str, str] | None = None) -> None:
    """The one rule of what a model can hold, read from its config (no weights): the driver
    calls it before Ray starts, every rank's engine core before it parallelizes. A setting
    that is not an integer yet (``auto``) or None is not checked. Raises
    :class:`LayoutError`, one line naming the key (``keys``: field -> the front door's key),
    its value and the model's number (``config`` None: no model known, nothing checked):

    - expert parallelism E > 1 needs routed experts, E dividing their number, and every
      weight trained (not a LoRA base);
    - context parallelism C > 1 needs the attention's query heads grouped evenly over its
      K/V heads and, on a hybrid model, at most a Gated DeltaNet layer's value heads (split
      over the group) grouped evenly over its key heads;
    - a sharding mode that holds no frozen weights (fsdp) refuses a LoRA base ("sharding=...":
      several keys choose the mode; the doors prefix theirs)."""
    from dta.planning.shapes import ModelShape, _get, text_config

    if config is None:
        return
    keys = dict(keys or {})

    def bad(field, value, why):
        name = keys.get(field)
        raise LayoutError(f"bad value for {name}: {value!r} {why}" if name else
                          f"bad {KEYS[field]} {value!r}: {why}")

    text = text_config(config)
    model = _get(config, "model_type") or type(config).__name__
    shape = ModelShape.of(config)
    E, C = expert_parallel, context_parallel
    if _given(E) and E > 1:
        if not shape.is_moe:
            bad("expert_parallel", E, f"needs routed experts: {model} has none (a dense "
                                      "model; expert parallelism divides a MoE's experts)")
        if shape.experts.count % E:
            bad("expert_parallel", E, f"does not divide {model}'s {shape.experts.count} "
                                      "experts")
        if frozen:
            bad("expert_parallel", E, "needs every weight trained; this model has frozen ones "
                                      "(a LoRA base): expert parallelism is tested on full "
                                      "training only")
    if _given(C) and C > 1:
        if shape.heads % shape.kv_heads:
            bad("context_parallel", C, f"splits heads by K/V head: {model}'s {shape.heads} "
                                       f"query heads are not grouped evenly over its "
                                       f"{shape.kv_heads} K/V heads")
        if shape.gdn_layers:
            hv = int(shape.gdn_heads)
            hk = int(_get(text, "linear_num_key_heads") or hv)
            if C > hv:
                bad("context_parallel", C, f"splits each Gated DeltaNet layer's value heads: "
                                           f"{model} has {hv}, at most {hv} ranks")
            if hv % hk:
                bad("context_parallel", C, f"splits Gated DeltaNet value heads by key head: "
                                           f"{model}'s {hv} value heads are not grouped "
                                           f"evenly over its {hk} key heads")
    if sharding is not None and frozen and sharding in _registered():
        from runtime.sharding import sharding_class

        if not sharding_class(sharding).holds_frozen:  # the doors prefix the keys choosing it
            raise ShardingRefused(f"sharding={sharding} trains every weight; this model has "
                              "frozen ones (a LoRA base): use replicate or zero1 (the "
                              "adapters' gradients and optimizer state are small)")


def _given(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mode_sharded(name: str) -> bool:
    from runtime.sharding import sharding_class

    return sharding_class(name).sharded


def _registered() -> tuple[str, ...]:
    from runtime.sharding import registered

    return registered()


# --------------------------------------------------------------- process groups --
@dataclass
class ProcessGroups:
    """The layout's groups on this rank (None where torch.distributed is not up: one rank).
    ``context``: this rank's context-parallel group (its C ranks; one rank when C = 1, the
    model-parallel group AReaL asks for); ``data``: its data-parallel group (the world when
    C = 1); ``cpu``: a gloo group over the world (the world itself when it is gloo);
    ``expert``: this rank's expert-parallel group (None when E = 1); ``expert_replicas``: the
    ranks holding this rank's experts (the world when E = 1); ``shard``: the ranks its
    sharded state is split over (the world unless HSDP); ``replicas``: the ranks holding the
    same shard as this one (None unless HSDP)."""

    world: object = None
    context: object = None
    data: object = None
    cpu: object = None
    expert: object = None
    expert_replicas: object = None
    shard: object = None
    replicas: object = None


def build_groups(layout: ParallelLayout) -> ProcessGroups:
    """Make the layout's groups (a collective: every rank calls it, in the same order)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if layout.world != 1:
            raise LayoutError(f"a layout of {layout.world} ranks needs torch.distributed "
                              "initialized first")
        return ProcessGroups()
    if dist.get_world_size() != layout.world or dist.get_rank() != layout.rank:
        raise LayoutError(f"the layout says rank {layout.rank} of {layout.world}; "
                          f"torch.distributed runs rank {dist.get_rank()} of "
                          f"{dist.get_world_size()}")
    world = dist.group.WORLD
    gloo = dist.get_backend() == "gloo"
    cpu = world if gloo else dist.new_group(backend="gloo")
    context = data = None
    for ranks in layout.context_groups():  # every rank creates every group
        group = dist.new_group(ranks)
        if layout.rank in ranks:
            context = group

    def mine(groups):  # every rank creates every group, in the same order
        found = None
        for ranks in groups:
            group = dist.new_group(ranks)
            if layout.rank in ranks:
                found = group
        return found

    data = world if layout.context_parallel == 1 else mine(layout.data_groups())
    expert = replicas = None
    expert_replicas = shard = world
    if layout.expert_parallel > 1:
        expert = mine(layout.expert_groups())
        expert_replicas = mine(layout.expert_replica_groups())
    if layout.shard_size < layout.world:
        shard, replicas = mine(layout.shard_groups()), mine(layout.replica_groups())
    return ProcessGroups(world=world, context=context, data=data, cpu=cpu, expert=expert,
                         expert_replicas=expert_replicas, shard=shard, replicas=replicas)


# ------------------------------------------------------------ who reduces what --
@dataclass(frozen=True)
class Reporting:
    """Who reduces what, on one rank (:func:`reporting_of`). The gradient is always the
    world's SUM: every rank's gradient is its share of the global batch's loss, and a
    context-parallel rank's is its rows' and heads' part of its group's.

    counts_loss / counts_tree: this rank's loss / tree figures enter the run's sums (a
    context-parallel group's head alone: every rank of a group holds the group's loss and
    walked the group's tree).
    """

    counts_loss: bool = True
    counts_tree: bool = True


def reporting_of(layout: ParallelLayout, model) -> Reporting:
    """The one place the model's context-parallel contract is read: with C > 1 the model
    must walk on its group with partial gradients
    (``context_parallel_of(model).partial_gradients``), which the world's SUM adds up; the
    group's loss and tree are reported by its head."""
    from dta.model.context_parallel import context_parallel_of

    if layout.context_parallel == 1:
        return Reporting()
    cp = context_parallel_of(model)
    if cp is None or not bool(getattr(cp, "partial_gradients", False)):
        raise LayoutError(f"context_parallel={layout.context_parallel}: the model does not walk "
                          "on its context-parallel group with partial gradients "
                          "(dta.model.context_parallel.parallelize_context was not applied)")
    return Reporting(counts_loss=layout.is_head, counts_tree=layout.is_head)

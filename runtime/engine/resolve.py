"""The one resolution of a run's settings: ``auto`` decided, the walk made whole, once.

A front door's configuration goes in; :class:`RunSettings` comes out -- the
:class:`~runtime.engine.layout.ParallelLayout` (world, context parallel, sharding mode) and
the one :class:`~dta.options.WalkOptions` every rank walks with -- and travels unchanged to
every rank: the ranks never rebuild or patch them (the engine core refuses a walk that lacks
what its layout needs: :func:`check_walk`).

Decided here, and nowhere else:

- ``auto`` (``train.sharding``, ``walker.block_tokens``, ``train.context_parallel``) by the
  memory model (:mod:`.auto`, ``dta plan --memory``'s choice for the same batch), with
  context parallelism priced: at the configured C, or for ``train.context_parallel=auto``
  over 1, 2, 4, 8 dividing the world;
- what the layout needs of the walk (matched calls -- fsdp, or expert parallelism across
  data-parallel groups -- under retain: one LM-head flush per pack, ``head_rows=0``) --
  :func:`walk_for_layout`;
- the memory policy a front door leaves unset: :func:`policy_of` (``recompute`` under
  gradient checkpointing, else the walker's default), the one rule of AReaL's
  ``gradient_checkpointing`` and verl's ``enable_gradient_checkpointing``.

:func:`resolve_run_config` is ``dta train``'s translation (its driver calls it on the first
batch); AReaL's and verl's adapters build their layout and walk and finish with
:func:`settle`.
"""
from __future__ import annotations

from dataclasses import dataclass

from dta.config.walk import walk_options
from dta.options import AUTO, WalkOptions
from runtime.engine.layout import LayoutError, ParallelLayout, check_model_fit
from runtime.errors import ShardingRefused

__all__ = ["RunSettings", "policy_of", "walk_for_layout", "check_walk", "settle",
           "needs_budget", "resolve_run_config", "check_run_config", "RUN_CONFIG_KEYS"]

# ParallelLayout field -> the dta train config key that sets it
RUN_CONFIG_KEYS = {"world": "config key 'ray.num_workers'",
                   "context_parallel": "config key 'train.context_parallel'",
                   "sharding": "config key 'train.sharding'",
                   "expert_parallel": "config key 'train.expert_parallel'",
                   "shard_size": "config key 'train.shard_size'",
                   "offload": "config key 'train.offload'",
                   "node_resident": "config key 'train.node_resident'",
                   "prefetch": "config key 'train.prefetch'"}


@dataclass(frozen=True)
class RunSettings:
    """What every rank of a run receives, resolved: ``layout`` (as rank 0 holds it; rank r
    takes ``layout.at(r)``), ``walk`` and the memory model's ``report`` when it chose."""

    layout: ParallelLayout
    walk: WalkOptions
    report: dict | None = None

    def record(self) -> dict:
        """JSON-ready, for checkpoint metadata and reports."""
        walk = {k: v for k, v in self.walk.as_dict().items() if k != "pack_cost"}
        out = {**self.layout.record(), "walk": walk}
        if self.layout.prefetch:  # which calls' gathers it overlaps (the planner's passes)
            from runtime.sharding.prefetch import describe
            out["prefetch_overlaps"] = describe(self.walk.policy)
        return out


def policy_of(policy: str | None, gradient_checkpointing: bool = False) -> str:
    """The memory policy: the one given; unset, ``recompute`` under gradient checkpointing
    (the front door asked to trade a forward for memory), else the walker's default."""
    if policy is not None:
        return policy
    return "recompute" if gradient_checkpointing else WalkOptions.default("policy")


def walk_for_layout(walk: WalkOptions, layout: ParallelLayout) -> WalkOptions:
    """``walk`` with what ``layout`` needs of it (the same object when it has it already)."""
    needs = layout.walk_needs(walk.policy)
    changes = {k: v for k, v in needs.items() if getattr(walk, k) != v}
    return walk.replace(**changes) if changes else walk


def check_walk(walk: WalkOptions, layout: ParallelLayout) -> None:
    """Refuse a walk that was not resolved for ``layout`` (see the module doc)."""
    if not isinstance(walk, WalkOptions):
        raise TypeError(f"the walk settings must be a dta.options.WalkOptions, got "
                        f"{type(walk).__name__}")
    needs = layout.walk_needs(walk.policy)
    missing = {k: v for k, v in needs.items() if getattr(walk, k) != v}
    if missing:
        raise LayoutError(f"{layout.matched_reason()} under policy={walk.policy} walks with "
                          f"{missing}, the walk settings have "
                          f"{ {k: getattr(walk, k) for k in missing} }: resolve them once "
                          "(runtime.engine.resolve.settle), not on the ranks")


def settle(walk: WalkOptions, layout: ParallelLayout, report: dict | None = None) -> RunSettings:
    """The run's settings from a front door's resolved walk and layout."""
    return RunSettings(layout, walk_for_layout(walk, layout), report)


# ------------------------------------------------------------------- dta train --
def needs_budget(cfg) -> bool:
    """Whether the memory model decides something: an ``auto`` mode, context-parallel size,
    expert-parallel size, shard size or offload, or an ``auto`` block with a budget given."""
    t = cfg.train
    return AUTO in (str(t.sharding), t.context_parallel, t.expert_parallel, t.shard_size,
                    str(t.offload), t.node_resident, t.prefetch) or (
        cfg.walker.block_tokens == AUTO and t.memory_budget_gib is not None)


def _candidates(cfg, hf_config, W: int) -> dict:
    """What the memory model tries for each layout knob: the configured value, or for
    ``auto`` every value the world (and the model's experts, the node size) allows -- the
    one list, ``dta.planning.state.layout_choices``."""
    from dta.planning.memory import CONTEXT_PARALLEL
    from dta.planning.shapes import ModelShape
    from dta.planning.state import layout_choices
    from dta.planning.timing import Hardware

    t = cfg.train
    C, E, S, O = t.context_parallel, t.expert_parallel, t.shard_size, str(t.offload)

    def flag(v):  # auto: both; true / false: pinned
        return None if v == AUTO else (bool(v),)

    choices = layout_choices(
        ModelShape.of(hf_config), W, Hardware().gpus_per_node,
        expert_parallel=None if E == AUTO else (int(E),),
        shard_size=None if S == AUTO else (None if S is None or int(S) == W else int(S),),
        offload=None if O == AUTO else (O,),
        node_resident=flag(t.node_resident), prefetch=flag(t.prefetch))
    return dict(context_parallel=tuple(c for c in CONTEXT_PARALLEL if W % c == 0)
                if C == AUTO else (int(C),), **choices)


def check_run_config(cfg, hf_config) -> None:
    """``dta train``'s parallel settings against the model's config (no weights, before Ray
    starts): :func:`~runtime.engine.layout.check_model_fit` on the values given (``auto``
    ones are chosen among those that fit); raises LayoutError naming the config key (the
    one check of a mode against the model: fsdp refuses a LoRA base here, not in the config's
    validation)."""
    t = cfg.train
    try:
        check_model_fit(hf_config, expert_parallel=t.expert_parallel,
                        context_parallel=t.context_parallel, sharding=str(t.sharding),
                        frozen=int(cfg.model.lora.r) > 0, keys=RUN_CONFIG_KEYS)
    except ShardingRefused as exc:  # the mode's refusal, with the key that chose it
        raise ShardingRefused(f"bad value for {RUN_CONFIG_KEYS['sharding']}: {exc}") from None


def resolve_run_config(cfg, hf_config, tree=None) -> RunSettings:
    """``dta train``'s settings: ``ray.num_workers`` / ``train.context_parallel`` /
    ``train.sharding`` and the ``walker.*`` keys of a validated config; ``auto`` priced by the
    memory model on ``tree`` (the first batch's prefix tree; None: no batch yet). Raises
    ValueError naming the keys when nothing fits."""
    from dta.planning.memory import GIB, SHARDINGS
    from runtime.engine.auto import default_budget_bytes, price

    t = cfg.train
    W, C = int(cfg.ray.num_workers), t.context_parallel
    mode, block = str(t.sharding), cfg.walker.block_tokens
    E, S, offload = t.expert_parallel, t.shard_size, str(t.offload)
    check_run_config(cfg, hf_config)  # a setting the model cannot hold: before pricing
    walk, report = walk_options(cfg), None  # an auto block: the default, unless priced
    # node_resident / prefetch: as configured, or where priced true (runtime.sharding's)
    extras = {k: True for k in ("node_resident", "prefetch") if getattr(t, k) is True}
    if needs_budget(cfg):
        budget = cfg.train.memory_budget_gib
        budget = float(budget) * GIB if budget is not None else default_budget_bytes(W)
        host = cfg.train.host_memory_budget_gib
        lora = cfg.model.lora
        try:
            priced = price(hf_config, world=W, budget_bytes=budget, tree=tree, walk=walk,
                           shardings=SHARDINGS if mode == AUTO else (mode,),
                           **_candidates(cfg, hf_config, W),
                           blocks=None if block == AUTO and tree is not None else
                           (walk.block_tokens,), compute_dtype=str(cfg.model.dtype),
                           host_budget_bytes=None if host is None else float(host) * GIB,
                           lora=(int(lora.r), list(lora.target_modules)) if int(lora.r) else None)
        except ValueError as exc:
            what = "no mode fits" if mode == AUTO else f"train.sharding={mode} does not fit"
            raise ValueError(f"train.sharding={mode}, walker.block_tokens={block}, "
                             f"train.context_parallel={C}, train.expert_parallel={E}, "
                             f"train.shard_size={S}, train.offload={offload}: {what} "
                             f"train.memory_budget_gib / train.host_memory_budget_gib "
                             f"({exc})") from None
        mode, C, report = priced.sharding, priced.context_parallel, priced.report
        E, S, offload = priced.expert_parallel, priced.shard_size, priced.offload
        extras = {k: v for k, v in (("node_resident", priced.node_resident),
                                    ("prefetch", priced.prefetch)) if v}
        if block == AUTO and priced.block_tokens != walk.block_tokens:
            walk = walk.replace(block_tokens=priced.block_tokens)  # the memory model's block
    layout = ParallelLayout.make(world=W, context_parallel=int(C), sharding=mode,
                                 expert_parallel=int(E),
                                 shard_size=None if S is None else int(S),
                                 offload=offload, spelling=RUN_CONFIG_KEYS, **extras)
    layout.check_model(hf_config, frozen=int(cfg.model.lora.r) > 0)  # what auto chose too
    return settle(walk, layout, report)

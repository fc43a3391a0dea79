"""``DTAOptions``: the walker's options, beside AReaL's ``TrainEngineConfig``.

An OmegaConf-structured block of AReaL's config (``actor.dta``), so plain fields; their
defaults are :class:`dta.options.WalkOptions`' and :meth:`DTAOptions.walk_options` turns them
into the walk's settings, validated there (errors name ``actor.dta.<field>``)."""
from __future__ import annotations

import dataclasses

from dta.options import WalkOptions
from dta.planning.memory import SHARDINGS

__all__ = ["DTAOptions"]

_WALK = WalkOptions()  # the defaults, written once in dta/options.py
# WalkOptions field -> how an AReaL config spells it
SPELLING = {"policy": "actor.dta.policy", "logits_chunk": "actor.dta.logits_chunk",
            "min_shared": "actor.dta.min_shared", "block_tokens": "actor.dta.block_tokens",
            "temperature": "actor.temperature"}


@dataclasses.dataclass
class DTAOptions:
    """The walker's options, beside AReaL's ``TrainEngineConfig``.

    policy: ``retain`` keeps each node's graph along the current path; ``recompute`` keeps
        only K/V and re-forwards a node at pop (less memory, one more forward). Default:
        ``recompute`` when ``config.gradient_checkpointing`` is set, else ``retain``.
    logits_chunk: rows of ``[rows, vocab]`` logits materialized at a time.
    min_shared: the shortest prefix worth sharing in the tree.
    block_tokens: the longest piece of a node forwarded in one call (``dta.planning.blocks``):
        a longer node is walked as a chain of blocks, so under ``recompute`` one block's graph
        is alive at a time. Default: the walker's (AReaL-DTA's ``dta_block_size``); null or 0:
        nodes are never cut.
    dtype: the model's and the optimizer's dtype, overriding ``config.dtype`` and
        ``config.optimizer_dtype`` (e.g. ``float64`` for verification, which AReaL rejects).
    sharding: how the ranks hold the model (the engine core's modes):
        ``replicate`` (full replicas, gradients summed), ``zero1`` (compute parameters
        gathered once per step, fp32 masters and optimizer state sharded, one reduce-scatter
        per step) or ``fsdp`` (FSDP2 ``fully_shard`` per decoder layer: ZeRO-3, the layout of
        AReaL's FSDPEngine). Unset (default): ``fsdp:dN`` with N > 1 shards as AReaL's does,
        ``fsdp`` (:func:`runtime.areal.parallel.layout_of`). One rank has nothing to
        shard. The names are ``dta.planning.memory.SHARDINGS``, the one list.
    shard_size: HSDP (zero1 / fsdp): the state sharded within groups of this many ranks
        (a node) and replicated across them; the gradients are summed across the groups
        once per step. Unset: the whole world (AReaL's ``fsdp:dN`` shards over all N).
    offload: ``optimizer`` keeps the optimizer state (and the fp32 masters) in host memory
        and steps it there, on every mode; ``gradients`` (zero2 / fsdp) also sums the walk's
        per-call layer gradients on the host (``dta.planning.state.OFFLOADS``; default
        ``none``). AReaL's ``fsdp.offload_params`` (FSDP2's parameter offload) is refused.
    node_resident: fsdp under HSDP (``shard_size`` below the world): ZeRO++'s hpZ -- the
        first gather of a step crosses the shard groups once into a copy held inside the
        group (the node), every later call of the step gathers inside it
        (``runtime.sharding.node_resident``; ``dta train``'s ``train.node_resident``).
    prefetch: fsdp: the next layer's all-gather issued before the current layer computes
        (FSDP2's explicit prefetch; ``train.prefetch``). AReaL's FSDPEngine has no such key.
    The last five are validated by the engine core's layout (errors name
    ``actor.dta.<field>``).
    """

    policy: str | None = None
    logits_chunk: int = _WALK.logits_chunk
    min_shared: int = _WALK.min_shared
    block_tokens: int | None = _WALK.block_tokens
    dtype: str | None = None
    sharding: str | None = None
    shard_size: int | None = None
    offload: str = "none"
    node_resident: bool = False
    prefetch: bool = False

    def __post_init__(self):
        if self.sharding is not None and self.sharding not in SHARDINGS:
            raise ValueError(f"unknown DTA sharding {self.sharding!r} (actor.dta.sharding); "
                             f"choose one of {tuple(SHARDINGS)} (or leave it unset: fsdp:dN "
                             "shards)")
        self.walk_options()  # the walk settings' validation, naming actor.dta.<field>

    @classmethod
    def of(cls, walk: WalkOptions, **others) -> "DTAOptions":
        """The block holding ``walk``'s settings (those AReaL's config has a key for)."""
        return cls(policy=walk.policy, logits_chunk=walk.logits_chunk,
                   min_shared=walk.min_shared, block_tokens=walk.block_tokens, **others)

    def layout_settings(self) -> dict:
        """The layout's settings this block holds (``runtime.areal.parallel.layout_of``'s
        keywords; ``sharding`` is its first argument)."""
        return {"shard_size": self.shard_size, "offload": self.offload,
                "node_resident": self.node_resident, "prefetch": self.prefetch}

    def walk_options(self, *, policy: str | None = None, **settings) -> WalkOptions:
        """The walk's settings: these fields, ``policy`` when this block leaves it unset (the
        engine's choice), and ``settings`` (e.g. AReaL's ``temperature``)."""
        values = dict(logits_chunk=self.logits_chunk, min_shared=self.min_shared,
                      block_tokens=self.block_tokens, **settings)
        if self.policy is not None or policy is not None:
            values["policy"] = self.policy if self.policy is not None else policy
        return WalkOptions.make(SPELLING, **values)

"""``DTAOptions``: the walker's options, beside AReaL's ``TrainEngineConfig``."""
from __future__ import annotations

import dataclasses

from dta.walk import POLICIES

__all__ = ["DTAOptions", "SHARDING_MODES"]

SHARDING_MODES = ("replicate", "zero1", "fsdp")


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
        is alive at a time. Default 2,048 (AReaL-DTA's ``dta_block_size``); null or 0: nodes
        are never cut.
    dtype: the model's and the optimizer's dtype, overriding ``config.dtype`` and
        ``config.optimizer_dtype`` (e.g. ``float64`` for verification, which AReaL rejects).
    sharding: how the data-parallel ranks hold the model (``runtime.sharding``):
        ``replicate`` (full replicas, gradients averaged), ``zero1`` (compute parameters
        gathered once per step, fp32 masters and optimizer state sharded, one reduce-scatter
        per step) or ``fsdp`` (FSDP2 ``fully_shard`` per decoder layer: ZeRO-3, the layout of
        AReaL's FSDPEngine). Unset (default): ``fsdp:dN`` with N > 1 shards as AReaL's does,
        ``fsdp`` (:func:`runtime.areal.sharded.resolve_sharding`). One rank has nothing to
        shard.
    """

    policy: str | None = None
    logits_chunk: int = 1024
    min_shared: int = 1
    block_tokens: int | None = 2048
    dtype: str | None = None
    sharding: str | None = None

    def __post_init__(self):
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"unknown DTA policy {self.policy!r}; choose one of {POLICIES}")
        if self.sharding is not None and self.sharding not in SHARDING_MODES:
            raise ValueError(f"unknown DTA sharding {self.sharding!r}; choose one of "
                             f"{SHARDING_MODES} (or leave it unset: fsdp:dN shards)")
        if self.block_tokens is not None and (isinstance(self.block_tokens, bool)
                                              or self.block_tokens < 0):
            raise ValueError(f"block_tokens must be >= 0 (0 or null: no cut), got "
                             f"{self.block_tokens!r}")
        if self.logits_chunk < 1 or self.min_shared < 1:
            raise ValueError("logits_chunk and min_shared must be >= 1")

"""THE list of training layouts the exactness and resume matrices run (tests/test_layout_matrix.py
through the three front doors with and without expert / context parallelism,
tests/test_resume_layouts.py's every-pair resume): one place, one line per layout.

A new layout -- issue 53's node-resident gathers (``train.node_resident=true``, fsdp under
HSDP) and prefetch (``train.prefetch=true``) -- is ONE line in :data:`LAYOUTS`, e.g.
``"fsdp-hsdp-hpz": Layout("fsdp", world=4, shard=2, extra=("train.node_resident=true",))``;
both matrices then train it, compare it with one process and resume it under every other
layout. A layout the runtime cannot build says so with ``refused=`` (a piece of the one-line
error expected before training) and the matrix checks that refusal instead.
"""
from __future__ import annotations

import dataclasses

__all__ = ["Layout", "LAYOUTS", "AXES"]


@dataclasses.dataclass(frozen=True)
class Layout:
    sharding: str  # train.sharding
    world: int = 2  # ranks (ray.num_workers)
    shard: int | None = None  # train.shard_size (HSDP); None: the world
    offload: str = "none"  # train.offload
    extra: tuple = ()  # further "key=value" overrides (a door must spell each one)
    refused: str | None = None  # the refusal expected, for a layout the runtime cannot do

    def overrides(self) -> list[str]:
        return [f"train.sharding={self.sharding}", f"ray.num_workers={self.world}",
                f"train.offload={self.offload}", *self.extra,
                *([f"train.shard_size={self.shard}"] if self.shard is not None else [])]


# Add new layouts here (one line each): the matrices read this dict and nothing else.
LAYOUTS = {
    "replicate": Layout("replicate"),
    "zero1": Layout("zero1"),
    "zero2": Layout("zero2"),
    "fsdp": Layout("fsdp"),
    "replicate-offload": Layout("replicate", offload="optimizer"),
    "zero1-offload": Layout("zero1", offload="optimizer"),
    "zero2-offload": Layout("zero2", offload="optimizer"),
    "fsdp-offload": Layout("fsdp", offload="optimizer"),
    "zero1-hsdp": Layout("zero1", world=4, shard=2),
    "zero2-hsdp": Layout("zero2", world=4, shard=2),
    "fsdp-hsdp": Layout("fsdp", world=4, shard=2),
    "zero2-hsdp-offload": Layout("zero2", world=4, shard=2, offload="optimizer"),
    "fsdp-hsdp-offload": Layout("fsdp", world=4, shard=2, offload="optimizer"),
    "fsdp-hsdp-hpz": Layout("fsdp", world=4, shard=2, extra=("train.node_resident=true",)),
    "fsdp-prefetch": Layout("fsdp", extra=("train.prefetch=true",)),
    "fsdp-hsdp-hpz-prefetch": Layout("fsdp", world=4, shard=2,
                                     extra=("train.node_resident=true", "train.prefetch=true")),
    # issue 53 item 4: the calls' fp32 gradient sum on the host too (offload=gradients)
    "zero2-gradients": Layout("zero2", offload="gradients"),
    "fsdp-gradients": Layout("fsdp", offload="gradients"),
    "fsdp-hsdp-gradients": Layout("fsdp", world=4, shard=2, offload="gradients"),
    "fsdp-hsdp-hpz-gradients": Layout("fsdp", world=4, shard=2, offload="gradients",
                                      extra=("train.node_resident=true",)),
    # what the runtime cannot do: refused in one line before training
    "zero1-gradients": Layout("zero1", offload="gradients",
                              refused="must be none or optimizer: sharding=zero1 keeps no "
                                      "per-call fp32 gradient sum"),
    "replicate-hsdp": Layout("replicate", world=4, shard=2,
                             refused="must be the world size 4 under "
                                     "sharding=replicate"),
    "zero2-node-resident": Layout("zero2", world=4, shard=2,
                                  extra=("train.node_resident=true",),
                                  refused="'train.node_resident': True must be false "
                                          "under sharding=zero2"),
    # (zero2 trains every weight; at E > 1 expert parallelism refuses a LoRA base first)
    "zero2-lora": Layout("zero2", extra=("model.lora.r=4",),
                         refused="this model has frozen ones (a LoRA base)"),
    "zero2-prefetch": Layout("zero2", extra=("train.prefetch=true",),
                             refused="'train.prefetch': True must be false under "
                                     "sharding=zero2"),
}

# The parallel axes every layout is crossed with: (context parallel C, expert parallel E,
# the MoE model, further overrides); E > 1 needs an MoE model (the tiny Qwen3-MoE). The last
# composes both on 2 ranks (E = C: one tree, each rank routing its own rows) under the
# walker's retain policy (a pack's backward long after its forward: the lockstep's rounds).
AXES = {"plain": (1, 1, False, ()), "cp2": (2, 1, False, ()), "ep2": (1, 2, True, ()),
        "cp2-ep2-retain": (2, 2, True, ("walker.policy=retain",))}

"""The model state one rank holds, by sharding mode, expert parallelism, shard group and offload.

The layout knobs the runtime takes, defined here once (``dta.planning.memory`` re-exports
them; the runtime imports them from there):

* ``expert_parallel`` = E: an EP group of E consecutive ranks holds 1/E of each sparse
  layer's routed experts (E divides the world and the experts); the dense part (attention,
  shared experts, routers, norms, embeddings) is as without EP. A rank's routed experts are
  replicated over the world / E *expert replicas* (the ranks holding the same experts).
* ``shard_size`` = S (HSDP): zero1's and fsdp's sharded state is split over S consecutive
  ranks (a node) and replicated across the world / S groups; S = the world is plain
  sharding (replicate: S = the world only). The dense part is sharded over the S ranks, a
  rank's routed experts over the S / E expert replicas inside the group (1 when E >= S: E
  and S divide one another).
* ``offload`` (:data:`OFFLOADS`): ``optimizer`` keeps the AdamW state and the weights it
  steps in host memory -- zero1's and fsdp's fp32 masters; replicate's parameters stay on
  the device and the host steps its own copy in the compute dtype -- and steps there.

With N_d the dense parameters, X / E a rank's routed experts (X all of them), N_l = N_d + X / E
the parameters a rank computes with, V the vocabulary-sized ones, s = N_d / S + X / (E s_x)
its shard (s_x = S / E, or 1), c / m the compute / master bytes (m = c under replicate):

==========  ===================================  =======================================  ==========
mode        params                               grads (peak)                             optimizer
==========  ===================================  =======================================  ==========
replicate   N_l m                                N_l m                                    2 N_l m
zero1       N_l c + s m                          N_l c + s m + S b m (a reduce bucket)    2 s m
fsdp        (s − V/S) m + V c + V m / S + layer  (s − V/S) m + V c + V m + layer (c)      2 s m
==========  ===================================  =======================================  ==========

(layer: the largest decoder layer, its experts divided by E, gathered in the compute dtype.)
Offload ``optimizer`` moves the optimizer column and the masters to ``host`` (replicate: the
optimizer and a copy of N_l c; zero1: s m of params; fsdp: its shard is kept on the device in
the compute dtype to gather from, (s − V/S) c, and the vocabulary's V m / S goes). The
gradients stay on the device until the step sends them to the host (dta.planning.timing).
Under E > 1 or S < the world a rank's shard s is the same N / S it is without experts: E
moves which parameters a rank owns, not how many.
"""
from __future__ import annotations

import math

from dta.planning.shapes import BUCKET_ELEMS, ModelShape

OFFLOADS = ("none", "optimizer")  # what the optimizer step keeps off the device


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_layout(shape: ModelShape, world: int, mode: str, expert_parallel=1, shard_size=None,
                 offload: str = "none") -> tuple[int, int]:
    """(E, S) of a layout, validated: E divides the world and the routed experts (1 for a
    dense model), S (None: the world) divides the world, E and S divide one another, and
    replicate shards nothing (S = the world)."""
    W = int(world)
    E = _count(expert_parallel, "expert_parallel")
    S = W if shard_size is None else _count(shard_size, "shard_size")
    if W % E:
        raise ValueError(f"expert_parallel={E} does not divide the world of {W} ranks")
    if E > 1 and not shape.is_moe:
        raise ValueError(f"expert_parallel={E}: the model has no routed experts")
    if E > 1 and shape.experts.count % E:
        raise ValueError(f"expert_parallel={E} does not divide the model's "
                         f"{shape.experts.count} experts")
    if W % S:
        raise ValueError(f"shard_size={S} does not divide the world of {W} ranks")
    if S % E and E % S:
        raise ValueError(f"shard_size={S} and expert_parallel={E} must divide one another")
    if mode == "replicate" and S != W:
        raise ValueError(f"shard_size={S}: replicate shards nothing (its shard size is the "
                         f"world, {W})")
    if offload not in OFFLOADS:
        raise ValueError(f"unknown offload {offload!r}; choose one of {OFFLOADS}")
    return E, S


def expert_shard(E: int, S: int) -> int:
    """s_x: the expert replicas inside a shard group of S (over which a rank's routed experts
    are sharded)."""
    return S // E if S % E == 0 else 1


def shards(shape: ModelShape, E: int, S: int) -> tuple[int, int, int]:
    """(dense shard, expert shard, vocabulary shard) of one rank, in elements."""
    return (math.ceil(shape.dense_params / S),
            math.ceil(shape.routed_params // E / expert_shard(E, S)),
            math.ceil(shape.vocab_params / S))


def model_state(shape: ModelShape, world: int, mode: str, *, compute_bytes: int,
                expert_parallel: int = 1, shard_size: int | None = None,
                offload: str = "none") -> dict:
    """One rank's ``params``, ``grads``, ``optimizer`` (device bytes) and ``host`` bytes
    (module doc), the layout validated by :func:`check_layout`."""
    W, c = int(world), compute_bytes
    E, S = check_layout(shape, W, mode, expert_parallel, shard_size, offload)
    m = max(c, 4)
    local = shape.rank_params(E)
    off = offload == "optimizer"
    if mode == "replicate" or W == 1:
        opt = 2 * local * c
        return dict(params=local * c, grads=local * c, optimizer=0 if off else opt,
                    host=opt + local * c if off else 0)
    dense, experts, vocab = shards(shape, E, S)
    s = dense + experts
    opt = 2 * s * m
    if mode == "zero1":
        grads = local * c + s * m + S * min(BUCKET_ELEMS, s) * m
        return dict(params=local * c + (0 if off else s * m), grads=grads,
                    optimizer=0 if off else opt, host=opt + s * m if off else 0)
    if mode != "fsdp":
        raise ValueError(f"unknown sharding mode {mode!r}")
    V, layer = shape.vocab_params, shape.layer_params_at(E) * c
    body = s - vocab  # the non-vocabulary shard
    params = body * (c if off else m) + V * c + (0 if off else vocab * m) + layer
    grads = body * m + V * c + V * m + layer
    return dict(params=params, grads=grads, optimizer=0 if off else opt,
                host=opt + s * m if off else 0)


def expert_parallel_sizes(shape: ModelShape, world: int, sizes=None) -> tuple[int, ...]:
    """The EP sizes the planner tries: those of ``sizes`` (default: every divisor of the
    world) dividing the world and the routed experts; (1,) for a dense model."""
    W = int(world)
    if not shape.is_moe:
        return (1,)
    pool = range(1, W + 1) if sizes is None else sizes
    return tuple(e for e in pool if W % e == 0 and shape.experts.count % e == 0)


def shard_sizes(world: int, gpus_per_node: int) -> tuple:
    """The shard sizes the planner tries: the world (None), and one node where it divides a
    world of several nodes."""
    W, n = int(world), int(gpus_per_node)
    return (None, n) if n < W and W % n == 0 else (None,)

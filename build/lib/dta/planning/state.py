"""The model state one rank holds, by sharding mode, expert parallelism, shard group and offload.

The layout knobs the runtime takes, defined here once (``dta.planning.memory`` re-exports
them; the runtime imports them from there):

* ``expert_parallel`` = E: an EP group of E consecutive ranks holds 1/E of each sparse
  layer's routed experts (E divides the world and the experts); the dense part (attention,
  shared experts, routers, norms, embeddings) is as without EP. A rank's routed experts are
  replicated over the R = world / E *expert replicas* (the ranks holding the same experts:
  every E-th rank, so they span the world's nodes).
* ``shard_size`` = S (HSDP): zero1's and fsdp's sharded state of the dense part is split
  over S consecutive ranks (a node) and replicated across the world / S groups; S = the
  world is plain sharding (replicate: S = the world only). Under E > 1 the expert slices
  are not the shard group's (``runtime.sharding.experts``): their state is split over
  their R replicas, whatever S.
* ``offload`` (:data:`OFFLOADS`): ``optimizer`` keeps the AdamW state and the weights it
  steps in host memory -- zero1's and fsdp's fp32 masters; replicate's parameters stay on
  the device and the host steps its own copy in the compute dtype -- and steps there.

What one rank holds, as ``runtime.sharding``'s ``state_bytes()`` counts it (the largest
rank's: chunks rounded up). N all the parameters, X the routed experts, V the
vocabulary-sized weights (embedding and LM head, once if tied), c / m the compute / master
bytes (m = fp32 under 16-bit compute; replicate keeps no masters: c throughout). The
*shard-group part* G is what S shards: every parameter under E = 1 (the experts are dense
parameters then), N − X under E > 1. A rank computes with N_l = G + X_E, X_E = X / E its
routed experts (0 under E = 1); g = G / S is its dense shard, v = V / S the vocabulary's
part of it, x = X_E / R = X / W its expert shard (0 under E = 1), s = g + x its whole shard
(its masters and what its optimizer steps), b = 2^24 elements (a reduce-scatter bucket):

==========  ===================================  =========================================  =======
mode        params                               grads (peak)                               optim.
==========  ===================================  =========================================  =======
replicate   N_l c                                N_l c                                      2 N_l c
zero1       N_l c + s m                          N_l c + s m + max(S min(b, g),             2 s m
                                                 R min(b, x)) m
fsdp        (g − v) m + (V + X_E) c              (g − v) m + (V + X_E) c + V m              2 s m
            + (v + x) m + layer c                + (x + R min(b, x)) m + layer c
==========  ===================================  =========================================  =======

* zero1 holds every compute parameter (N_l c, its slice X_E whole), accumulates their
  gradients whole (N_l c) and keeps the fp32 masters of its shard: the dense part's over
  the shard group (g), its expert slice's over the expert replicas (x; one reduce-scatter
  and one all-gather of X_E over R per step, ``dta.planning.timing``). The grads column
  adds the reduced shards (s m) and the larger part's reduce-scatter bucket.
* fsdp: the layer shards (g − v) in fp32 (FSDP2's sharded parameters, where the walk's
  per-call gradients accumulate, in fp32 too); the vocabulary weights and, under E > 1, the
  rank's expert slice held whole in the compute dtype (V + X_E: not FSDP's, flat shards of
  their own) with their fp32 masters (v over S, x over R); ``layer``: the largest decoder
  layer gathered in the compute dtype for a call (:func:`fsdp_layer_params`: under E > 1
  less its routed experts, which are never gathered). The grads column: the layer shards'
  fp32 gradients, the vocabulary's and the slice's whole compute-dtype gradients, the
  vocabulary's reduction (V m), the slice's reduced shard and bucket and a gathered layer's
  gradient.

Offload ``optimizer`` empties the optimizer column; the host keeps, per rank, the optimizer
state, the weights it steps and their gradient buffers (what the step copies the reduced
gradients into): replicate 2 N_l c + N_l c + N_l c; zero1 and fsdp 2 s m + s m + s m (the
masters move off the device: zero1's s m and fsdp's (v + x) m leave the params column;
fsdp's layer shards stay on the device in fp32, where each call gathers from and the walk
accumulates, the host stepping an fp32 copy). The gradients stay on the device until the
step sends them to the host (``dta.planning.timing``).

Not priced: AdamW's ``step`` counters (one 4-byte scalar per stepped tensor), FSDP2's
padding of a parameter whose first dimension S does not divide, collective buffers
outside the grads column.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Shards:
    """One rank's parts of the model state, in elements (module doc): the shard-group part
    (``group``: every trained parameter but the routed experts under E > 1, all of them under
    E = 1) and its shard ``dense`` over S, of which ``vocab`` is the vocabulary-sized
    weights' shard and ``body`` the rest's (fsdp's layer shards); under E > 1 the rank's
    routed experts ``experts`` (X / E, held whole) and their shard ``expert_shard`` over
    the ``replicas`` (W / E) ranks holding the same slice."""

    group: int
    dense: int
    vocab: int
    body: int
    experts: int = 0
    replicas: int = 1
    expert_shard: int = 0

    def shard(self, mode: str) -> int:
        """The rank's sharded elements, its masters and what its optimizer steps: zero1's
        flat shard of the group part, fsdp's layer shards and vocabulary shard, with the
        expert shard."""
        group = self.body + self.vocab if mode == "fsdp" else self.dense
        return group + self.expert_shard


def shards(shape: ModelShape, world: int, E: int, S: int) -> Shards:
    """One rank's :class:`Shards` of a layout (the largest rank's: ceil, as
    ``runtime.sharding.flat`` and FSDP2 cut them)."""
    W, X = int(world), shape.routed_params if E > 1 else 0
    group, V, R = shape.params - X, shape.vocab_params, W // E
    return Shards(group, math.ceil(group / S), math.ceil(V / S), math.ceil((group - V) / S),
                  X // E, R, math.ceil(X // E / R))


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
        opt = 2 * local * c  # host: the stepped copy, its gradient buffer, the states
        return dict(params=local * c, grads=local * c, optimizer=0 if off else opt,
                    host=opt + 2 * local * c if off else 0)
    if mode not in ("zero1", "fsdp"):
        raise ValueError(f"unknown sharding mode {mode!r}")
    sh = shards(shape, W, E, S)
    X, x, R = sh.experts, sh.expert_shard, sh.replicas
    s = sh.shard(mode)
    opt = 2 * s * m
    host = opt + 2 * s * m if off else 0  # + the masters and their gradient buffers
    buckets = max(S * min(BUCKET_ELEMS, sh.dense), R * min(BUCKET_ELEMS, x)) * m
    if mode == "zero1":
        return dict(params=local * c + (0 if off else s * m),
                    grads=local * c + s * m + buckets,
                    optimizer=0 if off else opt, host=host)
    V, layer = shape.vocab_params, fsdp_layer_params(shape, E) * c
    # the layer shards in fp32 (offloaded too: FSDP2 accumulates the calls' gradients in
    # them); the vocabulary and the expert slices whole in the compute dtype, their masters
    params = sh.body * m + (V + X) * c + (0 if off else (sh.vocab + x) * m) + layer
    grads = sh.body * m + (V + X) * c + V * m + (x * m + R * min(BUCKET_ELEMS, x) * m
                                                 if X else 0) + layer
    return dict(params=params, grads=grads, optimizer=0 if off else opt, host=host)


def fsdp_layer_params(shape: ModelShape, E: int) -> int:
    """The largest decoder layer fsdp gathers on one rank: all of it under E = 1; under
    E > 1 less its routed experts (not FSDP's: each rank holds its slice whole)."""
    return shape.layer_params_at(1, routed=E == 1)


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

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
  the device and the host steps its own copy in the compute dtype -- and steps there; the
  device keeps compute-dtype shards only (below). ``gradients`` (fsdp and zero2: the modes
  that sum the walk's per-call gradients in an fp32 shard, :data:`GRADIENT_SUMS`) does the
  same and keeps that fp32 **gradient sum on the host** too: each call's reduce-scattered
  layer gradients go device -> host and are added there, so the device holds no fp32 state
  of the layers at all (what lets Llama-70B's state sit in one node of 8).
* ``node_resident`` (fsdp, S < W: ZeRO++'s hpZ with the shard group as the node): the
  masters and optimizer state over all W ranks, a compute-dtype copy of the layers over the
  node, gathered across the nodes once a step (:data:`NODE_RESIDENT`).
* ``prefetch`` (fsdp): the next layer's all-gather issued before the current layer computes
  (forward; under recompute the re-forward and backward too): one more gathered layer held,
  the gathers priced as overlapping the compute (``dta.planning.timing``; :data:`PREFETCH`).

:func:`layout_choices` lists what the planner tries for each knob -- the one list ``dta plan
--memory``, ``train.sharding=auto`` (``runtime.engine.resolve``) and
``experiments.planning_table`` read.

What one rank holds, as ``runtime.sharding``'s ``state_bytes()`` counts it (the largest
rank's: chunks rounded up). N all the parameters, X the routed experts, V the
vocabulary-sized weights (embedding and LM head, once if tied), c / m the compute / master
bytes (m = fp32 under 16-bit compute; replicate keeps no masters: c throughout). The
*shard-group part* G is what S shards: every parameter under E = 1 (the experts are dense
parameters then), N − X under E > 1. A rank computes with N_l = G + X_E, X_E = X / E its
routed experts (0 under E = 1); g = G / S is its dense shard, v = V / S the vocabulary's
part of it, l = (G − V) / S its layer shards (fsdp: FSDP2's Shard(0), ceil rows), x = X_E / R
= X / W its expert shard (0 under E = 1), s its whole shard (its masters and what its
optimizer steps: zero1's g + x; fsdp's and zero2's l + v + x), b = 2^24 elements (a reduce-scatter bucket), L the largest decoder layer
(:func:`fsdp_layer_params`: under E > 1 less its routed experts, never gathered):

=============  ================================  =========================================  =======
mode           params                            grads (peak)                               optim.
=============  ================================  =========================================  =======
replicate      N_l c                             N_l c                                      2 N_l c
zero1          N_l c + s m                       N_l c + s m + B m                          2 s m
zero2          l m + (G − V − h) c               as fsdp's                                  2 s m
               + (V + X_E) c + (v + x) m
fsdp           l m + (V + X_E) c + (v + x) m     l m + (V + X_E) c + V m                    2 s m
               + L c (+ L c, prefetch)           + (x + R min(b, x)) m + L c
fsdp, node-    l c + (V + X_E) c + s_W m         l m + l_W m + (V + X_E) c + V m            2 s_W m
resident       + L c (+ L c, prefetch)           + (x + R min(b, x)) m + L c
=============  ================================  =========================================  =======

(B = max(S min(b, g), R min(b, x)): the larger part's reduce-scatter bucket; x's terms only
under E > 1.)

* zero1 holds every compute parameter (N_l c, its slice X_E whole), accumulates their
  gradients whole (N_l c) and keeps the fp32 masters of its shard: the dense part's over
  the shard group (g), its expert slice's over the expert replicas (x; one reduce-scatter
  and one all-gather of X_E over R per step, ``dta.planning.timing``). The grads column
  adds the reduced shards (s m) and the larger part's reduce-scatter bucket.
* zero2 (``runtime.sharding.zero2``: FSDP2 told to keep what it gathers) is fsdp with every
  decoder layer gathered once a step and kept for the whole walk: (G − V − h) c, all the
  layers' parameters (h: the final norm, the root unit's, not sampled), beside fsdp's
  fp32 layer shards (the masters) and its vocabulary and expert parts; each backward call
  reduce-scatters its layers' gradients into the fp32 gradient shard, one layer's at a
  time (the grads column is fsdp's). Per rank about 2 N + 16 N / S + 6 V bytes (bf16
  compute, E = 1) against zero1's 4 N + 16 N / S.
* fsdp: the layer shards (l) in fp32 (FSDP2's sharded parameters, where the walk's
  per-call gradients accumulate, in fp32 too); the vocabulary weights and, under E > 1, the
  rank's expert slice held whole in the compute dtype (V + X_E: not FSDP's, flat shards of
  their own) with their fp32 masters (v over S, x over R); L c: the layer gathered for a
  call, and with ``prefetch`` the next layer's too (its all-gather issued before the current
  layer computes). The grads column: the layer shards' fp32 gradients, the vocabulary's and
  the slice's whole compute-dtype gradients, the vocabulary's reduction (V m), the slice's
  reduced shard and bucket and a gathered layer's gradient.
* fsdp, ``node_resident`` (hpZ; S < W is the node): the fp32 masters and the optimizer
  state partitioned over all W ranks (s_W = l_W + v_W + x, l_W = (G − V) / W, v_W = V / W);
  the compute-dtype *secondary partition* of the layers over the node (l c), which the
  step's first gather fills across the nodes once and every call gathers from inside the
  node; the gradients reduce-scattered inside the node per call into an fp32 shard of the
  node partition (l m) and across the nodes once a step into the rank's W-shard (l_W m).

Offload ``optimizer`` empties the optimizer column and takes the masters off the device;
the device keeps **compute-dtype shards only**: fsdp's layer shards become l c (node-resident:
its secondary partition, already l c), zero1's and zero2's masters (s m) leave the params
column, fsdp's (v + x) m (node-resident: s_W m) too. The fp32 gradient shard (the sum of the
calls: fsdp's and zero2's l m) stays on the device, where the walk's gradients are summed,
until the step sends it to the host. The host keeps, per rank, the optimizer state, the
fp32 masters and their gradient buffers (what the step copies the reduced gradients into):
replicate 2 N_l c + N_l c + N_l c (a stepped copy in the compute dtype); the others
2 s m + s m + s m (node-resident: s_W).

Offload ``gradients`` also takes the fp32 gradient shard l m off the device's grads column:
the walk sums the calls' layer gradients on the host. That sum is the layers' gradient
buffer the host already keeps (host bytes unchanged), except under node residency, where
the host sums the node partition's gradients (l m, beside the W-slice's s_W m buffer). A
call's copy passes through one host temporary of the largest unit's shard (not priced).

``steps``: AdamW's ``step`` counters, one 4-byte fp32 scalar per tensor the optimizer steps
(torch keeps them on the host unless the optimizer is fused or capturable), priced as host
memory for every mode: 4 x the model's parameter tensors (:attr:`ModelShape.tensors`), a
bound on every mode (a flat shard steps one piece per tensor it overlaps; fsdp one shard per
parameter).

Not priced: FSDP2's padding of a parameter whose first dimension S does not divide,
collective buffers outside the grads column.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dta.planning.shapes import BUCKET_ELEMS, ModelShape

OFFLOADS = ("none", "optimizer", "gradients")  # what is kept off the device (module doc)
GRADIENT_SUMS = ("zero2", "fsdp")  # the modes summing the calls' gradients in an fp32 shard
NODE_RESIDENT = (False, True)  # fsdp's gathers from a node-resident copy (hpZ): S < W only
PREFETCH = (False, True)  # fsdp's next-layer all-gather overlapping the current layer
STEP_COUNTER_BYTES = 4  # AdamW's ``step``: one fp32 scalar per stepped tensor
GATHERED = ("fsdp",)  # the modes that gather layers per call (node_resident, prefetch)


def _count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_layout(shape: ModelShape, world: int, mode: str, expert_parallel=1, shard_size=None,
                 offload: str = "none", node_resident: bool = False,
                 prefetch: bool = False) -> tuple[int, int]:
    """(E, S) of a layout, validated: E divides the world and the routed experts (1 for a
    dense model), S (None: the world) divides the world, E and S divide one another,
    replicate shards nothing (S = the world), node_resident is fsdp's with S < W (the node
    inside the world), prefetch is fsdp's (the only mode that gathers per layer)."""
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
    refused = offload_refusal(mode, offload)
    if refused:
        raise ValueError(f"offload={offload}: {refused}; offload=optimizer is {mode}'s")
    for name, value in (("node_resident", node_resident), ("prefetch", prefetch)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        if value and mode not in GATHERED:
            raise ValueError(f"{name}: sharding={mode} gathers no layers (fsdp only)")
    if node_resident and S == W:
        raise ValueError(f"node_resident needs a shard size (the node) below the world of {W} "
                         f"ranks, got shard_size={S}")
    return E, S


def offload_refusal(mode: str, offload: str) -> str:
    """Why ``offload`` does not apply to sharding ``mode`` ('' where it does): ``gradients``
    is the modes' that keep a per-call fp32 gradient sum (:data:`GRADIENT_SUMS`); the
    others sum their gradients in the compute weights' own ``.grad`` and reduce once a step."""
    if offload == "gradients" and mode not in GRADIENT_SUMS:
        return (f"sharding={mode} keeps no per-call fp32 gradient sum to put on the host "
                f"({' and '.join(GRADIENT_SUMS)} do)")
    return ""


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
        flat shard of the group part, fsdp's and zero2's layer shards and vocabulary shard,
        with the expert shard."""
        group = self.body + self.vocab if mode in ("fsdp", "zero2") else self.dense
        return group + self.expert_shard


def shards(shape: ModelShape, world: int, E: int, S: int) -> Shards:
    """One rank's :class:`Shards` of a layout (the largest rank's: ceil, as
    ``runtime.sharding.flat`` and FSDP2 cut them)."""
    W, X = int(world), shape.routed_params if E > 1 else 0
    group, V, R = shape.params - X, shape.vocab_params, W // E
    return Shards(group, math.ceil(group / S), math.ceil(V / S), math.ceil((group - V) / S),
                  X // E, R, math.ceil(X // E / R))


def master_shards(shape: ModelShape, world: int, E: int, S: int,
                  node_resident: bool = False) -> Shards:
    """The :class:`Shards` the masters and the optimizer state are cut by: over the shard
    group, or under ``node_resident`` over all W ranks."""
    return shards(shape, world, E, int(world) if node_resident else S)


def model_state(shape: ModelShape, world: int, mode: str, *, compute_bytes: int,
                expert_parallel: int = 1, shard_size: int | None = None,
                offload: str = "none", node_resident: bool = False,
                prefetch: bool = False) -> dict:
    """One rank's ``params``, ``grads``, ``optimizer`` (device bytes), ``host`` bytes and
    ``steps`` (AdamW's step counters, host memory) (module doc), the layout validated by
    :func:`check_layout`."""
    W, c = int(world), compute_bytes
    E, S = check_layout(shape, W, mode, expert_parallel, shard_size, offload, node_resident,
                        prefetch)
    m = max(c, 4)
    local = shape.rank_params(E)
    off = offload != "none"
    on_host = offload == "gradients"  # the calls' fp32 gradient sum on the host
    steps = STEP_COUNTER_BYTES * shape.tensors
    if mode == "replicate" or W == 1:
        opt = 2 * local * c  # host: the stepped copy, its gradient buffer, the states
        return dict(params=local * c, grads=local * c, optimizer=0 if off else opt,
                    host=opt + 2 * local * c if off else 0, steps=steps)
    if mode not in ("zero1", "zero2", "fsdp"):
        raise ValueError(f"unknown sharding mode {mode!r}")
    sh = shards(shape, W, E, S)
    ms = master_shards(shape, W, E, S, node_resident)
    X, x, R = sh.experts, sh.expert_shard, sh.replicas
    s = ms.shard(mode)  # the masters, what the optimizer steps
    opt = 2 * s * m
    host = opt + 2 * s * m if off else 0  # + the masters and their gradient buffers
    buckets = max(S * min(BUCKET_ELEMS, sh.dense), R * min(BUCKET_ELEMS, x)) * m
    layer = fsdp_layer_params(shape, E) * c
    if mode == "zero1":
        return dict(params=local * c + (0 if off else s * m), grads=local * c + s * m + buckets,
                    optimizer=0 if off else opt, host=host, steps=steps)
    V = shape.vocab_params
    # the layer shards: fp32 (FSDP2 accumulates the calls' gradients in them), or compute-
    # dtype only (offloaded; node-resident: the secondary partition); the vocabulary and the
    # expert slices whole in the compute dtype; the masters; the gathered layer(s): fsdp's
    # one (two with prefetch), zero2's every decoder layer (all but the root's final norm)
    body = sh.body * (c if off or node_resident else m)
    gathered = (sh.group - V - shape.hidden) * c if mode == "zero2" else \
        layer * (2 if prefetch else 1)
    params = body + (V + X) * c + (0 if off else (s - sh.body * (not node_resident)) * m) \
        + gathered
    grads = (0 if on_host else sh.body * m) + (ms.body * m if node_resident else 0) \
        + (V + X) * c + V * m + (x * m + R * min(BUCKET_ELEMS, x) * m if X else 0) + layer
    if on_host and node_resident:  # the node partition's sum, beside the W-slice's buffer
        host += sh.body * m
    return dict(params=params, grads=grads, optimizer=0 if off else opt, host=host,
                steps=steps)


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


def layout_choices(shape: ModelShape, world: int, gpus_per_node: int, **pinned) -> dict:
    """What the planner tries for each layout knob, the one list (``dta plan --memory``,
    ``train.sharding=auto``, ``experiments.planning_table``): every E
    (:func:`expert_parallel_sizes`), S (:func:`shard_sizes`), offload (:data:`OFFLOADS`),
    node residency (:data:`NODE_RESIDENT`) and prefetch (:data:`PREFETCH`) the world allows,
    except the knobs ``pinned`` gives a value of (a tuple of candidates, or None: the knob's
    list). node_resident and prefetch apply to fsdp only (``plan_memory`` skips them
    elsewhere), node_resident only with S < W."""
    unknown = set(pinned) - set(LAYOUT_KNOBS)
    if unknown:
        raise ValueError(f"unknown layout knob(s) {sorted(unknown)}; the knobs are {LAYOUT_KNOBS}")
    W = int(world)
    every = dict(expert_parallel=expert_parallel_sizes(shape, W),
                 shard_size=shard_sizes(W, gpus_per_node), offload=OFFLOADS,
                 node_resident=NODE_RESIDENT if W > 1 else (False,), prefetch=PREFETCH)
    return {k: every[k] if pinned.get(k) is None else tuple(pinned[k]) for k in LAYOUT_KNOBS}


LAYOUT_KNOBS = ("expert_parallel", "shard_size", "offload", "node_resident", "prefetch")

"""Modeled step time of a layout: per-rank FLOPs, bytes sent and seconds, on the batch.

A model, not a measurement. For a candidate of :func:`dta.planning.memory.plan_memory`
(D data-parallel groups x C context-parallel ranks = W, a sharding mode, expert-parallel
size E, shard group S and offload (:mod:`dta.planning.state`), a memory policy, a block)
and the batch's prefix tree, :class:`Pricer` balances the tree over the D groups as the
runtime does (:mod:`dta.planning.work`) and prices one step:

    step = max over groups of (compute + context-parallel exchange + expert exchange)
           + sharding communication (inside the shard groups) + once a step across the
             world (the replicas' all-reduce, the expert slices' collectives)
           + the offloaded optimizer step (host transfers and host AdamW)
           - what prefetch hides of fsdp's all-gathers under compute
    compute = FLOPs of the group's most loaded rank / (peak FLOP/s x utilisation)
    a collective = bytes this rank sends / the link's bandwidth + a latency per collective

FLOPs and the group's exchange are :mod:`dta.planning.cp`'s (FLOPs from
:class:`~dta.planning.cost.CostModel`: forward + backward = 3 forwards, recompute 4; an MoE
layer's FLOPs are its ``top_k`` routed experts', its router's and its shared expert's). The
link is intra-node when the ranks of the collective sit in one node (a context-parallel
group is C consecutive ranks, an EP group E, a shard group S; the sharding collectives
without shard groups, the replicas' all-reduce and the expert replicas' collectives span
all W), inter-node otherwise; every estimate splits its bytes so (``intra_bytes``,
``inter_bytes``). Compute and communication do not overlap (the walk waits on each
all-to-all; replicate and zero1 reduce after the walk), except fsdp's all-gathers under
``prefetch`` (:func:`prefetched`: per call and overlapped pass max(compute, gathers) + the
first layer's gather). Sharding traffic per rank per step, P the trained parameters (N, or the LoRA
adapters), V the vocabulary-sized ones, c / m the compute / master bytes, f(n) = (n − 1) / n,
G the shard-group part (:mod:`dta.planning.state`: every parameter under E = 1, all but the
routed experts under E > 1), X_E = X / E a rank's routed experts (0 under E = 1):

==========  ============================================================================
replicate   ring all-reduce of the gradients in the compute dtype: 2 f(W) G c +
            2 f(W / E) X_E c (the experts over their replicas); LoRA: 2 f(W) P c
zero1       reduce-scatter in the master dtype, all-gather of the update, in the shard
            group: f(S) G (m + c)
zero2       fsdp's units gathered once a step and kept, each call's layer gradients
            reduce-scattered (master dtype) into the fp32 shards, in the shard group:
            f(S)(G − V)(calls m + c); the vocabulary weights once per step: f(S) V (m + c)
fsdp        per decoder call (the most calls of any group: the lockstep keeps them
            matched) every layer all-gathered for the forward, the re-forward (recompute)
            and the backward and its gradient reduce-scattered, in the shard group:
            f(S)(G − V)(g c + m), g = 3 or 2 (under E > 1 the routed experts are not
            FSDP's: never gathered); the vocabulary weights once per step: f(S) V (m + c)
            (node-resident: the per-call part inside the node of S; the vocabulary's
            over the world, below)
==========  ============================================================================

**Once a step across the world** (zero1, zero2 and fsdp; ``replica_bytes``, at the world's
link): with shard groups (HSDP, S < W) one all-reduce of the sharded gradients (master
dtype) across them, 2 f(W / S) (G / S) m; node-resident fsdp instead reduce-scatters its
node partition's gradient across the nodes and gathers the updated weights back into it,
f(W / S) l (m + c) with l = (G − V) / S, and the vocabulary's flat shards over the world,
f(W) V (m + c) -- whatever the number of calls; under E > 1 the expert slices' reduce-scatter (master
dtype) and all-gather (compute dtype) over their R = W / E replicas (every E-th rank:
across the nodes when the world spans several), f(R) X_E (m + c).

**Expert parallelism** (E > 1; routing assumed balanced): each MoE layer call sends the
rank's routed rows (its rows x top_k) to their experts' owners and takes them back:
dispatch and combine, forward and backward (and recompute's re-forward), all-to-alls inside
the EP group: passes x 2 x sparse layers x rows x top_k x (E − 1) / E x hidden x c. A
rank computes as many routed rows as it sends (balanced): E divides the experts' weights,
not their FLOPs (``expert_flops``: the routed experts' share of the rank's FLOPs).

**Offload** (``optimizer``): per step the rank's gradients go to the host and its updated
weights come back over the host link (:attr:`Hardware.host_link_gbs`), and the host
steps its parameters at :attr:`Hardware.host_adam_gparams` (zero1 / zero2 / fsdp: its
master shard, the gradient down in the master dtype, the weights back in the compute
dtype, the device keeping compute-dtype shards only; replicate: all it holds, in the
compute dtype). ``gradients`` (zero2 / fsdp, :mod:`dta.planning.state`): besides, every
call's layer gradients go down (l m, l the layers' shard over S: the node partition under
node residency) and the host adds them into its fp32 sum at
:attr:`Hardware.host_add_gelems`; the layers' part of the step's gradient is on the host
already, except that a cross-replica sum (HSDP: up and down, 2 l m) or node residency's
reduce-scatter (up, l m) runs on the device. Priced serially: the copies and the adds wait
for the call's backward and the next call waits for them (nothing overlaps them).

Not modeled: kernel efficiency falling with smaller calls or smaller row slices (one
utilisation for every matmul), a masked pack's dropped pairs (FLOPs are the tree's), LoRA's
skipped weight gradients (priced as full training), routing imbalance.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dta.planning import cp
from dta.planning.shapes import BUCKET_ELEMS, DTYPE_BYTES, ModelShape
from dta.planning.state import master_shards, shards
from dta.planning.work import Workload

# Dense peak FLOP/s of an H100 SXM (80 GB; the H200's are the same), by compute dtype:
# bf16/fp16 tensor cores; fp32 without TF32 (torch's matmul default) and fp64 tensor cores.
PEAK_TFLOPS = {"bfloat16": 989.0, "float16": 989.0, "float32": 67.0, "float64": 67.0}


@dataclass(frozen=True)
class Hardware:
    """The rates the time model assumes (defaults: an H100-class node of 8 GPUs)."""

    peak_tflops: float | None = None  # per GPU; None: PEAK_TFLOPS of the compute dtype
    utilization: float = 0.4  # the share of the peak the walk's matmuls reach
    intra_node_gbs: float = 450.0  # GB/s per GPU per direction: NVLink 4 (900 GB/s both ways)
    inter_node_gbs: float = 50.0  # GB/s per GPU: one 400 Gb/s NIC per GPU (InfiniBand NDR)
    gpus_per_node: int = 8  # the node: what a shard group (HSDP) spans
    latency_us: float = 10.0  # per collective call
    # GB/s a GPU moves to or from host memory (offload): PCIe Gen5 x16 peaks at 64 GB/s a
    # direction; about 25 effective with a node's GPUs sharing the host's links and DRAM
    host_link_gbs: float = 25.0
    # billions of parameters a second the host's AdamW steps for each GPU (offload): a CPU
    # AdamW step moves ~30 bytes a parameter (fp32 master, two states and the gradient read;
    # master, states and the 16-bit weight written), ~8 G/s for a node's 8 GPUs at ~240 GB/s
    # of a two-socket host's DRAM bandwidth
    host_adam_gparams: float = 1.0
    # billions of fp32 elements a second the host adds into its gradient sum for each GPU
    # (offload gradients): 12 bytes an element (the sum and the copy read, the sum written)
    # at the same ~30 GB/s share of the host's DRAM bandwidth as host_adam_gparams
    host_add_gelems: float = 2.5

    def __post_init__(self):
        for name in ("intra_node_gbs", "inter_node_gbs", "host_link_gbs", "host_adam_gparams",
                     "host_add_gelems"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"peak_tflops must be > 0, got {self.peak_tflops}")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {self.utilization}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) \
                or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        if not self.latency_us >= 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us}")

    def flop_rate(self, compute_dtype: str) -> float:
        """FLOP/s one GPU sustains: peak x utilisation."""
        return (self.peak_tflops or PEAK_TFLOPS[compute_dtype]) * 1e12 * self.utilization

    def bandwidth(self, ranks: int) -> float:
        """Bytes/s a rank sends at in a collective over ``ranks`` consecutive ranks."""
        return (self.intra_node_gbs if ranks <= self.gpus_per_node else self.inter_node_gbs) * 1e9

    def as_dict(self, compute_dtype: str) -> dict:
        return {**asdict(self), "peak_tflops": self.peak_tflops or PEAK_TFLOPS[compute_dtype],
                "compute_dtype": compute_dtype, "flop_rate": self.flop_rate(compute_dtype),
                "overlap": "prefetch: fsdp's all-gathers under compute (nothing else)"}


@dataclass
class TimeEstimate:
    """One step of one candidate, for its slowest data-parallel group's most loaded rank."""

    calls: int  # decoder calls of that group (node pieces at the block)
    tokens: int  # tokens its tree holds (unique)
    flops_per_rank: float
    flops_alone: float  # one rank walking the group's calls alone (C = 1, same policy)
    flops_undivided: float  # flops_per_rank - flops_alone / C: what C does not divide
    group_efficiency: float  # flops_alone / (C x flops_per_rank)
    cp_bytes: float  # sent inside its context-parallel group
    sharding_bytes: float  # sent by the sharding mode's collectives (inside the shard group)
    bytes_sent: float  # cp + sharding + ep + replica bytes (what goes over the GPUs' links)
    collectives: int
    compute_s: float
    cp_s: float
    sharding_s: float
    step_s: float
    tokens_per_s: float  # the batch's sequence tokens (what it trains) per modeled second
    expert_flops: float = 0.0  # of flops_per_rank, the routed experts' (its rows x top_k)
    ep_bytes: float = 0.0  # sent by the expert-parallel all-to-alls
    ep_s: float = 0.0
    replica_bytes: float = 0.0  # once a step across the world: HSDP's all-reduce, expert slices
    replica_s: float = 0.0
    host_bytes: float = 0.0  # over the host link (offload: gradients down, weights up)
    host_s: float = 0.0  # host transfers + host AdamW
    compute_share: float = 1.0  # compute_s / step_s
    intra_bytes: float = 0.0  # of bytes_sent, over links inside a node (NVLink)
    inter_bytes: float = 0.0  # of bytes_sent, over links across nodes
    overlap_s: float = 0.0  # fsdp's gathers hidden under compute by prefetch (step_s less it)
    overlapped: str = ""  # which calls' gathers prefetch was assumed to overlap


def _f(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def sharding_traffic(mode: str, world: int, shape: ModelShape, policy: str, calls: int,
                     compute_bytes: int, adapter_params: int = 0, *, expert_parallel: int = 1,
                     shard_size: int | None = None,
                     node_resident: bool = False) -> tuple[float, int]:
    """(bytes a rank sends, collectives) of a step's sharding communication inside its shard
    group (module doc; the replicas' all-reduce, node residency's crossings and the expert
    slices' collectives are :func:`replica_traffic`)."""
    W, c = int(world), compute_bytes
    if W == 1:
        return 0.0, 0
    E, S = int(expert_parallel), W if shard_size is None else int(shard_size)
    m = max(c, 4)
    Xe = shape.routed_params // E if E > 1 else 0
    G = shape.params - (shape.routed_params if E > 1 else 0)  # the shard-group part
    if adapter_params:
        G, Xe = int(adapter_params), 0
    if mode == "replicate":
        return 2 * (_f(W) * G + _f(W // E) * Xe) * c, math.ceil((G + Xe) / BUCKET_ELEMS)
    if mode == "zero1":
        return _f(S) * G * (m + c), math.ceil(math.ceil(G / S) / BUCKET_ELEMS) + 1
    if mode not in ("zero2", "fsdp"):
        raise ValueError(f"unknown sharding mode {mode!r}")
    V = shape.vocab_params
    vocab = 0.0 if node_resident else _f(S) * V * (m + c)  # node-resident: over the world
    if mode == "zero2":  # the layers gathered once a step, reduce-scattered per call
        return _f(S) * (G - V) * (calls * m + c) + vocab, \
            (calls + 1) * (shape.layers + 1) + 2
    per_call = gathers(policy) * gather_pass(S, G - V, c) + _f(S) * (G - V) * m
    return calls * per_call + vocab, \
        calls * (shape.layers + 1) * (gathers(policy) + 1) + 2 * (not node_resident)


def gathers(policy: str) -> int:
    """fsdp's all-gathers of every layer per call: forward, backward (and recompute's
    re-forward)."""
    return 3 if policy == "recompute" else 2


def gather_pass(S: int, gathered: int, compute_bytes: int) -> float:
    """Bytes a rank sends in one pass's all-gather of every decoder layer (``gathered``
    parameters) in a shard group of S: f(S) x gathered x the compute bytes."""
    return _f(S) * gathered * compute_bytes


def replica_traffic(mode: str, world: int, shape: ModelShape, compute_bytes: int, *,
                    expert_parallel: int = 1, shard_size: int | None = None,
                    node_resident: bool = False) -> tuple[float, int]:
    """(bytes a rank sends, collectives) of zero1's and fsdp's once-a-step collectives
    across the world (module doc): the all-reduce of the sharded gradients across the
    shard groups (HSDP, S < W) and, under E > 1, the expert slices' reduce-scatter and
    all-gather over their replicas; nothing for replicate."""
    W, E, c = int(world), int(expert_parallel), compute_bytes
    S = W if shard_size is None else int(shard_size)
    if mode == "replicate" or W == 1:
        return 0.0, 0
    m = max(c, 4)
    sh = shards(shape, W, E, S)
    sent, colls = 0.0, 0
    if node_resident:  # the node partition's gradient reduce-scattered across the nodes
        # (master dtype), the updated weights all-gathered back into it (compute dtype); the
        # vocabulary's flat shards over the world (reduce-scatter, all-gather)
        V = shape.vocab_params
        sent += _f(W // S) * sh.body * (m + c) + _f(W) * V * (m + c)
        colls += 2 * math.ceil(sh.body / BUCKET_ELEMS) + 2
    elif S < W:
        dense = sh.shard(mode) - sh.expert_shard
        sent += 2 * _f(W // S) * dense * m
        colls += math.ceil(dense / BUCKET_ELEMS)
    if sh.replicas > 1 and sh.experts:
        sent += _f(sh.replicas) * sh.experts * (m + c)
        colls += math.ceil(sh.expert_shard / BUCKET_ELEMS) + 2
    return sent, colls


def expert_exchange(shape: ModelShape, expert_parallel: int, policy: str, rows: int,
                    calls: int, compute_bytes: int) -> tuple[float, int]:
    """(bytes a rank sends, collectives) of the EP all-to-alls of one step: ``rows`` the
    rank's rows over its calls (module doc; proportional to the tokens routed)."""
    E = int(expert_parallel)
    if E == 1 or not shape.is_moe:
        return 0.0, 0
    passes = 3 if policy == "recompute" else 2  # forward, (re-forward,) backward
    routed = rows * shape.experts.top_k  # rows this rank routes (and, balanced, receives)
    sent = passes * 2 * shape.sparse_layers * routed * (E - 1) / E * shape.hidden * compute_bytes
    return float(sent), passes * 2 * shape.sparse_layers * calls


def offload_traffic(mode: str, world: int, shape: ModelShape, compute_bytes: int, *,
                    expert_parallel: int = 1, shard_size: int | None = None,
                    offload: str = "none", node_resident: bool = False,
                    calls: int = 1) -> tuple[float, int, int]:
    """(bytes over the host link, parameters the host steps, elements the host adds into
    its gradient sum) of one step of ``calls`` decoder calls (module doc)."""
    if offload == "none":
        return 0.0, 0, 0
    W, E, c = int(world), int(expert_parallel), compute_bytes
    if mode == "replicate" or W == 1:
        local = shape.rank_params(E)
        return 2.0 * local * c, local, 0  # gradients down, weights up, in the compute dtype
    m = max(c, 4)
    S = W if shard_size is None else int(shard_size)
    ms = master_shards(shape, W, E, S, node_resident)
    s = ms.shard(mode)
    if offload != "gradients":
        return float(s * (m + c)), s, 0  # master-dtype gradient down, compute weights up
    body = shards(shape, W, E, S).body  # the layers' shard the calls' gradients sum into
    # each call's layer gradients down; at the step the other parts' gradients down, the
    # layers' where the device sums them (HSDP: the sum up and down; node residency: up,
    # its W-slice down), the compute weights up
    step = (s - ms.body) * m + s * c + (2 * body * m if S < W and not node_resident else 0) \
        + ((body + ms.body) * m if node_resident else 0)
    return float(int(calls) * body * m + step), s, int(calls) * body


class Pricer:
    """Prices the candidates of :func:`dta.planning.memory.plan_memory` on one batch."""

    def __init__(self, config, tree, hardware: Hardware | None = None, *,
                 compute_dtype: str = "bfloat16", adapter_params: int = 0, walk):
        self.shape = ModelShape.of(config)
        self.work = Workload(tree, config, walk)
        self.hardware = hardware or Hardware()
        self.compute_dtype, self.adapter_params = compute_dtype, int(adapter_params)

    def hardware_dict(self) -> dict:
        return self.hardware.as_dict(self.compute_dtype)

    def price(self, est):
        """``est`` (a :class:`dta.planning.memory.MemoryEstimate`) with its
        :class:`TimeEstimate` set (``est.time``); returns ``est``."""
        hw, C, c = self.hardware, est.context_parallel, DTYPE_BYTES[self.compute_dtype]
        E, S, W = est.expert_parallel, est.shard_size, est.world
        rate, link, ep_link = hw.flop_rate(self.compute_dtype), hw.bandwidth(C), hw.bandwidth(E)
        lat = hw.latency_us * 1e-6
        kw = dict(expert_parallel=E, shard_size=S)
        resident = bool(getattr(est, "node_resident", False))
        ahead = bool(getattr(est, "prefetch", False)) and est.sharding == "fsdp"
        gathered = self.shape.params - (self.shape.routed_params if E > 1 else 0) \
            - self.shape.vocab_params
        gather_s = gather_pass(S, gathered, c) / hw.bandwidth(S)  # one pass, every layer
        worst = None
        groups = self.work.calls(est.data_parallel, est.block_tokens, est.policy)
        for calls in groups:
            rank, alone = cp.flops(self.work.cost, self.shape, est.cp_scheme, C, est.policy, calls)
            sent, colls = cp.exchange(self.shape, est.cp_scheme, C, est.policy, calls, c)
            rows = calls.tokens if est.cp_scheme == "replicated" else calls.rows(C)
            ep, ep_colls = expert_exchange(self.shape, E, est.policy, rows, calls.calls, c)
            seconds = (rank / rate, sent / link + colls * lat, ep / ep_link + ep_colls * lat)
            hidden = prefetched(calls, seconds[0], gather_s, est.policy, self.shape.layers) \
                if ahead else 0.0
            if worst is None or sum(seconds) - hidden > sum(worst[0]) - worst[-1]:
                worst = (seconds, calls, rank, alone, sent, colls, ep, ep_colls, rows, hidden)
        (compute_s, cp_s, ep_s), calls, rank, alone, sent, colls, ep, ep_colls, rows, hidden = \
            worst
        most_calls = max(g.calls for g in groups)  # fsdp: every rank runs as many calls
        sh_bytes, sh_colls = sharding_traffic(est.sharding, W, self.shape, est.policy, most_calls,
                                              c, self.adapter_params, node_resident=resident,
                                              **kw)
        sharding_s = sh_bytes / hw.bandwidth(S) + sh_colls * lat
        rep_bytes, rep_colls = replica_traffic(est.sharding, W, self.shape, c,
                                               node_resident=resident, **kw)
        replica_s = rep_bytes / hw.bandwidth(W) + rep_colls * lat
        host_bytes, host_params, host_adds = offload_traffic(
            est.sharding, W, self.shape, c, offload=est.offload, node_resident=resident,
            calls=most_calls, **kw)
        host_s = host_bytes / (hw.host_link_gbs * 1e9) \
            + host_params / (hw.host_adam_gparams * 1e9) + host_adds / (hw.host_add_gelems * 1e9)
        mult = cp.RECOMPUTE_FACTOR if est.policy == "recompute" else 1.0
        expert = mult * 6.0 * self.shape.experts.top_k * self.shape.expert_params \
            * self.shape.sparse_layers * rows
        step = compute_s + cp_s + ep_s + sharding_s + replica_s + host_s - hidden
        links = {}  # bytes by link class: in a node or across nodes
        for ranks, sent_bytes in ((C, sent), (E, ep), (S, sh_bytes), (W, rep_bytes)):
            where = "intra" if ranks <= hw.gpus_per_node else "inter"
            links[where] = links.get(where, 0.0) + sent_bytes
        passes = OVERLAPPED[est.policy] if ahead else ()
        est.time = TimeEstimate(
            calls.calls, calls.tokens, rank, alone, rank - alone / C, alone / (C * rank),
            sent, sh_bytes, sent + sh_bytes + ep + rep_bytes,
            colls + sh_colls + ep_colls + rep_colls, compute_s, cp_s, sharding_s, step,
            self.work.sequence_tokens / step, expert, ep, ep_s, rep_bytes, replica_s,
            host_bytes, host_s, compute_s / step, links.get("intra", 0.0),
            links.get("inter", 0.0), hidden,
            f"{' and '.join(passes)} all-gathers of {calls.calls} calls" if passes else "")
        return est


# fsdp's per-layer all-gathers prefetch overlaps with compute, by policy: under recompute a
# call's re-forward and backward follow it at its pop (the next layer's gather issued ahead,
# as in the forward); under retain the backward of a call comes later, not layer by layer
# after its forward: only the forward's gathers overlap. The gradients' reduce-scatters are
# not overlapped.
OVERLAPPED = {"recompute": ("forward", "re-forward", "backward"), "retain": ("forward",)}
PASS_SHARE = {"forward": 1.0, "re-forward": 1.0, "backward": 2.0}  # in forwards


def prefetched(calls, compute_s: float, gather_s: float, policy: str, layers: int) -> float:
    """Seconds of fsdp's all-gathers hidden under compute by prefetch on one group: per call
    and overlapped pass (:data:`OVERLAPPED`), with q its compute (the group's compute by the
    call's share of the rows and the pass's of the call: forward 1, backward 2, re-forward 1
    of 3 or 4 forwards) and g one pass's gathers, the pass takes max(q, g) + g / layers (the
    first layer's gather waits: nothing computes before it) instead of q + g: it hides
    max(0, min(q, g) - g / layers). Never more than min(compute, gathers): a prefetched step
    is never shorter than max(compute, communication)."""
    import numpy as np

    total = calls.tokens
    if not total or gather_s <= 0:
        return 0.0
    share = np.asarray(calls.lengths, dtype=np.float64) / total * compute_s
    forwards = 4.0 if policy == "recompute" else 3.0
    hidden = 0.0
    for name in OVERLAPPED[policy]:
        q = share * PASS_SHARE[name] / forwards
        hidden += float(np.maximum(0.0, np.minimum(q, gather_s) - gather_s / layers).sum())
    return hidden

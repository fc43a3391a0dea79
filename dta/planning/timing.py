"""Modeled step time of a layout: per-rank FLOPs, bytes sent and seconds, on the batch.

A model, not a measurement. For a candidate of :func:`dta.planning.memory.plan_memory`
(D data-parallel groups x C context-parallel ranks = W, a sharding mode, a memory policy, a
block) and the batch's prefix tree, :class:`Pricer` balances the tree over the D groups as the
runtime does (:mod:`dta.planning.work`) and prices one step:

    step = max over groups of (compute + context-parallel exchange) + sharding communication
    compute = FLOPs of the group's most loaded rank / (peak FLOP/s x utilisation)
    a collective = bytes this rank sends / the link's bandwidth + a latency per collective

FLOPs and the group's exchange are :mod:`dta.planning.cp`'s (FLOPs from
:class:`~dta.planning.cost.CostModel`: forward + backward = 3 forwards, recompute 4). The link
is intra-node when the ranks of the collective sit in one node (a context-parallel group is
C consecutive ranks; the sharding collectives span all W), inter-node otherwise. Compute and
communication do not overlap (the walk waits on each all-to-all; replicate and zero1 reduce
after the walk; FSDP's prefetch, which hides part of its gathers, is not modeled). Sharding
traffic per rank per step, P the trained parameters (N, or the LoRA adapters), V the
vocabulary-sized ones, c / m the compute / master bytes, f = (W − 1) / W:

==========  ============================================================================
replicate   ring all-reduce of the gradients in the compute dtype: 2 f P c
zero1       reduce-scatter in the master dtype, all-gather of the update: f P (m + c)
fsdp        per decoder call (the most calls of any group: the lockstep keeps them
            matched) every layer all-gathered for the forward, the re-forward (recompute)
            and the backward and its gradient reduce-scattered: f (N − V)(g c + m), g = 3
            or 2; the vocabulary weights once per step: f V (m + c)
==========  ============================================================================

Not modeled: kernel efficiency falling with smaller calls or smaller row slices (one
utilisation for every matmul), a masked pack's dropped pairs (FLOPs are the tree's), LoRA's
skipped weight gradients (priced as full training).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dta.planning import cp
from dta.planning.shapes import BUCKET_ELEMS, DTYPE_BYTES, ModelShape
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
    gpus_per_node: int = 8
    latency_us: float = 10.0  # per collective call

    def __post_init__(self):
        for name in ("intra_node_gbs", "inter_node_gbs"):
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
                "overlap": False}


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
    sharding_bytes: float  # sent by the sharding mode's collectives
    bytes_sent: float
    collectives: int
    compute_s: float
    cp_s: float
    sharding_s: float
    step_s: float
    tokens_per_s: float  # the batch's sequence tokens (what it trains) per modeled second


def sharding_traffic(mode: str, world: int, shape: ModelShape, policy: str, calls: int,
                     compute_bytes: int, adapter_params: int = 0) -> tuple[float, int]:
    """(bytes a rank sends, collectives) of a step's sharding communication (module doc)."""
    W, c = int(world), compute_bytes
    if W == 1:
        return 0.0, 0
    m, f = max(c, 4), (W - 1) / W
    P = int(adapter_params) or shape.params
    if mode == "replicate":
        return 2 * f * P * c, math.ceil(P / BUCKET_ELEMS)
    if mode == "zero1":
        return f * P * (m + c), math.ceil(math.ceil(P / W) / BUCKET_ELEMS) + 1
    if mode != "fsdp":
        raise ValueError(f"unknown sharding mode {mode!r}")
    g = 3 if policy == "recompute" else 2
    N, V = shape.params, shape.vocab_params
    return f * (calls * (N - V) * (g * c + m) + V * (m + c)), calls * (shape.layers + 1) * (g + 1) + 2


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
        rate, link = hw.flop_rate(self.compute_dtype), hw.bandwidth(C)
        lat = hw.latency_us * 1e-6
        worst = None
        groups = self.work.calls(est.data_parallel, est.block_tokens, est.policy)
        for calls in groups:
            rank, alone = cp.flops(self.work.cost, self.shape, est.cp_scheme, C, est.policy, calls)
            sent, colls = cp.exchange(self.shape, est.cp_scheme, C, est.policy, calls, c)
            seconds = (rank / rate, sent / link + colls * lat)
            if worst is None or sum(seconds) > sum(worst[0]):
                worst = (seconds, calls, rank, alone, sent, colls)
        (compute_s, cp_s), calls, rank, alone, sent, colls = worst
        most_calls = max(g.calls for g in groups)  # fsdp: every rank runs as many calls
        sh_bytes, sh_colls = sharding_traffic(est.mode, est.world, self.shape, est.policy,
                                              most_calls, c, self.adapter_params)
        sharding_s = sh_bytes / hw.bandwidth(est.world) + sh_colls * lat
        step = compute_s + cp_s + sharding_s
        est.time = TimeEstimate(
            calls.calls, calls.tokens, rank, alone, rank - alone / C, alone / (C * rank),
            sent, sh_bytes, sent + sh_bytes, colls + sh_colls, compute_s, cp_s, sharding_s,
            step, self.work.sequence_tokens / step)
        return est

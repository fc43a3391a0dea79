"""Per-rank memory of a training step, by sharding mode: a model in bytes, from a config.

For a model config (a Hugging Face config or dict), W ranks, a mode and the batch's longest
root-to-leaf path / largest call (node or pack), :func:`estimate` returns the bytes one rank
holds at its peak, split as ``params``, ``grads``, ``optimizer`` (AdamW: two states) and
``activations``. N = all parameters, V = the vocabulary-sized ones (input embedding and LM
head, once if tied), c = compute bytes, m = master bytes (fp32 under 16-bit compute):

==========  =====================================  ==========================================  ==========
mode        params                                 grads (peak)                                optimizer
==========  =====================================  ==========================================  ==========
replicate   N m                                    N m                                         2 N m
zero1       N c + N m / W                          N c + N m / W + W b m (a reduce bucket)     2 N m / W
fsdp        (N−V) m / W + V c + V m / W + 1 layer  (N−V) m / W + V c + V m + 1 layer (c)      2 N m / W
==========  =====================================  ==========================================  ==========

(b: the reduce-scatter bucket, 2^24 elements per rank. Replicate keeps its parameters and
AdamW state in the compute dtype, so c = m there: pure 16-bit AdamW under bfloat16; the
README table prices it in float32, the numerics zero1/fsdp keep with their fp32 masters.)
Activations (:func:`activation_split`), with B the block (``dta.planning.blocks``: no call is
longer than B; None: a call is a whole node, up to the largest):

* ``path_kv``: the ancestors' K/V along the longest path, held as leaves with their
  gradients (2 copies), plus the path K/V each live graph's attention saved (the cache it
  read: recompute, one call over the whole path; retain, every graph on the path over its
  own prefix, about path x (n + 1) / 2 for n graphs); a hybrid model's Gated DeltaNet
  layers hold no K/V but a (conv, recurrent) state per piece on the path (leaf and gradient);
* ``graphs``: the saved activations of the calls whose graphs are alive (retain: every
  piece on the path, the path's tokens; recompute: one call, min(largest call, B));
* ``head``: the LM head's chunk of fp32 logits (logits, softmax, gradient);
* ``cp_buffers`` (context parallel, C > 1 ranks per tree): one call's exchange buffers.

Context parallel (:mod:`dta.planning.cp`): the C ranks of a group walk one tree. Under the
``split`` scheme (the default) each rank stores its KV heads' share of the path's K/V with
their gradient accumulators (1/C: the path K/V divided by C) and holds its rows' share of
the live graphs and of the head's rows; ``cp_buffers`` is one attention call's all-to-all
(its rows' q/k/v sent, its heads' received). Under the ``replicated`` scheme (round 4) the
path's K/V are stored sliced by rows (retain: each graph on the path also keeps its own
pack's K/V whole) while the graphs and the head are those of one rank; ``cp_buffers`` is the
all-gathered (out, lse) and dQ of a call, its gathered K/V gradients and one piece's scores.
The model state is the same either way (fsdp and zero1 shard over the whole world,
W = data-parallel x C).

This mirrors what ``runtime.sharding`` allocates; the benchmark
``experiments/bench_sharding.py`` measures the state beside it, and
``experiments/bench_blocks.py`` the activations against the block. :func:`plan_memory`
chooses data-parallel x context-parallel x mode x policy x block for a budget: given the
batch's tree, the fastest modeled step that fits (:mod:`dta.planning.timing`); without one,
the first that fits in the memory order (least communication first, then retain before
recompute, then the largest block; blocks under 1,024 tokens only when nothing fits with a
longer one); or it says by how much the cheapest misses.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dta.planning import cp
from dta.planning.chunks import logits_rows  # the head's chunk rule (logits within LOGITS_BYTES)
from dta.planning.cp import CP_SCHEME, check_scheme
from dta.planning.shapes import BUCKET_ELEMS, DTYPE_BYTES, SHAPES, ModelShape  # noqa: F401

MODES = ("replicate", "zero1", "fsdp")  # cheapest communication first
# where the optimizer's state lives: on the device, or ("optimizer") the AdamW state and the
# fp32 master weights (where the mode keeps them) in host memory, stepped there
OFFLOADS = ("none", "optimizer")
GIB = 2 ** 30



@dataclass
class MemoryEstimate:
    mode: str
    world: int
    params: int
    grads: int
    optimizer: int
    activations: int
    policy: str = "recompute"
    block_tokens: int | None = None  # None: nodes are not cut
    split: dict = field(default_factory=dict)  # activations by part (activation_split)
    context_parallel: int = 1  # ranks per tree (world = data-parallel groups x this)
    cp_scheme: str = CP_SCHEME  # how a group divides its tree (dta.planning.cp; C > 1 only)
    time: object = None  # dta.planning.timing.TimeEstimate, when a workload was priced

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def state(self) -> int:
        """params + grads + optimizer (what the benchmark measures)."""
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {**asdict(self), "state": self.state, "total": self.total,
                "data_parallel": self.data_parallel, "label": self.label()}

    @property
    def data_parallel(self) -> int:
        return self.world // self.context_parallel

    def label(self) -> str:
        cp = f"/context parallel {self.context_parallel}" if self.context_parallel > 1 else ""
        if cp and self.cp_scheme != CP_SCHEME:
            cp += f" ({self.cp_scheme})"
        return f"{self.mode}/{self.policy}/block {self.block_tokens or 'none'}{cp}"


def activation_split(shape: ModelShape, *, path_tokens: int, call_tokens: int, policy: str,
                     compute_bytes: int, logits_chunk: int = 1024,
                     block_tokens: int | None = None, context_parallel: int = 1,
                     cp_scheme: str = CP_SCHEME) -> dict:
    """Activation bytes by part (module doc): ``path_kv``, ``graphs``, ``head`` (and
    ``cp_buffers`` with ``context_parallel`` > 1 ranks per tree, priced by ``cp_scheme``:
    :func:`dta.planning.cp.activations`)."""
    if policy not in ("retain", "recompute"):
        raise ValueError(f"unknown memory policy {policy!r}; choose retain or recompute")
    C = check_context_parallel(context_parallel)
    check_scheme(cp_scheme)
    c = compute_bytes
    call = min(call_tokens, block_tokens) if block_tokens else call_tokens
    path = max(int(path_tokens), 0)
    pieces = math.ceil(path / max(call, 1)) if path else 0  # graphs along the path (retain)
    if C > 1:
        return cp.activations(shape, cp_scheme, C, path=path, call=call, pieces=pieces,
                              policy=policy, compute_bytes=c, logits_chunk=logits_chunk)
    kv = 2 * shape.attention_layers * shape.kv_heads * shape.head_dim * c  # per token, K and V
    q = shape.heads * shape.head_dim
    # saved per token per layer: norms' inputs, q/k/v, attention out, MLP gate/up/act/down in
    saved = (4 * shape.hidden + q + 2 * shape.kv_heads * shape.head_dim + q
             + 4 * shape.intermediate) * c * shape.layers
    if policy == "retain":
        graph_tokens, read = path, path * (pieces + 1) / 2
    else:
        graph_tokens, read = min(call, path) if path else call, path
    states = 2 * pieces * shape.gdn_layers * shape.gdn_state * 4  # leaf + gradient, fp32
    head = 3 * min(logits_rows(logits_chunk, shape.vocab), max(call, 1)) * shape.vocab * 4
    return {"path_kv": int(kv * (2 * path + read) + states), "graphs": int(saved * graph_tokens),
            "head": int(head)}


# CP sizes `dta plan --memory` tries (those dividing the world); beyond a model's KV heads a
# split group shares each KV head's rows (dta.planning.cp.HeadSplit)
CONTEXT_PARALLEL = (1, 2, 4, 8, 16)


def check_context_parallel(size) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"context_parallel must be an integer >= 1 (ranks per tree), got "
                         f"{size!r}")
    return size


def estimate(config, world: int, mode: str, *, path_tokens: int, call_tokens: int,
             policy: str = "recompute", compute_dtype: str = "bfloat16",
             logits_chunk: int = 1024, block_tokens: int | None = None,
             adapter_params: int = 0, context_parallel: int = 1,
             cp_scheme: str = CP_SCHEME) -> MemoryEstimate:
    """Per-rank peak bytes of one step (see the module doc). adapter_params > 0: a LoRA run
    (:func:`with_lora`: the frozen base in the compute dtype, state for the adapters only).
    context_parallel: ranks per tree, dividing ``world`` (the data-parallel groups are
    ``world / context_parallel``; sharding still spans the whole world), dividing the tree
    by ``cp_scheme`` (:mod:`dta.planning.cp`)."""
    if mode not in MODES:
        raise ValueError(f"unknown sharding mode {mode!r}; choose one of {MODES}")
    if int(world) < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    C = check_context_parallel(context_parallel)
    if int(world) % C:
        raise ValueError(f"context_parallel={C} does not divide the world of {world} ranks")
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    c = DTYPE_BYTES[compute_dtype]
    m = max(c, 4)
    N, V = shape.params, shape.vocab_params
    W = int(world)
    layer_c = shape.layer_params * c
    if mode == "replicate" or W == 1:
        params, grads, opt = N * c, N * c, 2 * N * c
        mode = "replicate" if W == 1 else mode
    elif mode == "zero1":
        params = N * c + math.ceil(N / W) * m
        grads = N * c + math.ceil(N / W) * m + W * min(BUCKET_ELEMS, math.ceil(N / W)) * m
        opt = 2 * math.ceil(N / W) * m
    else:
        params = math.ceil((N - V) / W) * m + V * c + math.ceil(V / W) * m + layer_c
        grads = math.ceil((N - V) / W) * m + V * c + V * m + layer_c
        opt = 2 * math.ceil(N / W) * m
    split = activation_split(shape, path_tokens=path_tokens, call_tokens=call_tokens,
                             policy=policy, compute_bytes=c, logits_chunk=logits_chunk,
                             block_tokens=block_tokens, context_parallel=C,
                             cp_scheme=cp_scheme)
    est = MemoryEstimate(mode, W, int(params), int(grads), int(opt), sum(split.values()),
                         policy=policy, block_tokens=block_tokens or None, split=split,
                         context_parallel=C, cp_scheme=cp_scheme)
    return with_lora(est, shape, adapter_params, compute_dtype=compute_dtype) \
        if adapter_params else est


def pick_mode(config, world: int, budget_bytes: float, *, modes=MODES,
              **kw) -> tuple[str | None, list[MemoryEstimate]]:
    """The first mode (least communication) whose estimate fits ``budget_bytes``."""
    rows = [estimate(config, world, mode, **kw) for mode in modes]
    for r in rows:
        if r.total <= budget_bytes:
            return r.mode, rows
    return None, rows


HEADROOM = 0.1  # budget share left free: CUDA context, allocator fragmentation, comm buffers
BLOCKS = (None, 8192, 4096, 2048, 1024, 512)  # block candidates, largest first (None: no cut)
# blocks shorter than this cost step time (more, smaller calls): tried only when no mode
# fits with a longer one (experiments/bench_blocks.py measures the time against the block)
SHORT_BLOCK = 1024
POLICY_ORDER = ("retain", "recompute")  # retain first: no second forward


@dataclass
class MemoryPlan:
    """The choice of :func:`plan_memory`: ``chosen`` (the estimate that fits, or None) and
    ``cheapest`` (the smallest total tried: what misses the budget, and by how much).
    ``rule``: ``throughput`` (a batch was priced: the fastest modeled step that fits, each
    estimate's ``time`` set) or ``memory`` (the first that fits in the memory order)."""

    budget: float  # the usable bytes: the budget less the headroom
    chosen: MemoryEstimate | None
    cheapest: MemoryEstimate
    tried: list[MemoryEstimate]
    rule: str = "memory"
    hardware: dict | None = None  # the time model's rates (rule throughput)
    pricer: object = field(default=None, repr=False)  # prices more estimates on the same batch

    @property
    def shortfall(self) -> float:
        """Bytes the cheapest combination lacks (0 when one fits)."""
        return 0.0 if self.chosen is not None else self.cheapest.total - self.budget

    @property
    def block_tokens(self) -> int | None:
        return (self.chosen or self.cheapest).block_tokens

    def message(self) -> str:
        if self.chosen is not None:
            fast = (f", the fastest that fits ({self.chosen.time.step_s:.1f} s modeled step)"
                    if self.rule == "throughput" else "")
            return (f"{self.chosen.label()} fits: {self.chosen.total / GIB:.2f} GiB of "
                    f"{self.budget / GIB:.2f} GiB usable{fast}")
        return (f"nothing fits {self.budget / GIB:.2f} GiB usable: the cheapest, "
                f"{self.cheapest.label()}, needs {self.cheapest.total / GIB:.2f} GiB "
                f"({self.shortfall / GIB:.2f} GiB over)")


def plan_memory(config, world: int, budget_bytes: float, *, path_tokens: int | None = None,
                call_tokens: int | None = None, modes=MODES, policies=POLICY_ORDER,
                blocks=BLOCKS, compute_dtype: str = "bfloat16", logits_chunk: int = 1024,
                headroom: float = HEADROOM, adapter_params: int = 0,
                context_parallel=(1,), tree=None, hardware=None,
                cp_schemes=(CP_SCHEME,), walk=None) -> MemoryPlan:
    """Data-parallel x context-parallel x mode x policy x block for ``budget_bytes`` less the
    ``headroom`` share (a block no shorter than the largest call is the same as none:
    skipped). adapter_params > 0 prices a LoRA run (fsdp is not offered with adapters).
    context_parallel: the CP sizes to try (each must divide ``world``); cp_schemes: how a
    group of C > 1 divides its tree (:mod:`dta.planning.cp`).

    With ``tree`` (the batch's PrefixTree; path_tokens and call_tokens default to its
    :func:`batch_extent`): **by modeled throughput**. Every candidate is priced
    (:mod:`dta.planning.timing`, ``hardware`` a :class:`~dta.planning.timing.Hardware`,
    default an H100-class GPU; the figures on ``estimate.time``) and the shortest modeled
    step among those that fit is chosen (ties: the memory order below); blocks under
    SHORT_BLOCK only when nothing fits with a longer one. ``walk`` (needed with a tree): the
    run's :class:`dta.options.WalkOptions`, whose packing settings plan each group's calls as
    the walker will (:mod:`dta.planning.work`).

    Without a tree (nothing to price time on): the first that fits in the memory order --
    the smallest C first, modes by communication, retain before recompute, the largest
    block (blocks under SHORT_BLOCK only when nothing fits at that C with a longer one)."""
    if tree is not None:
        path, node = batch_extent(tree)
        path_tokens = path if path_tokens is None else path_tokens
        call_tokens = node if call_tokens is None else call_tokens
    if path_tokens is None or call_tokens is None:
        raise ValueError("plan_memory needs path_tokens and call_tokens, or the batch's tree")
    if tree is not None and walk is None:
        raise ValueError("plan_memory(tree=...) needs walk=, the run's dta.options.WalkOptions "
                         "(its packing settings plan each group's calls)")
    if adapter_params:
        modes = tuple(m for m in modes if m != "fsdp")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    schemes = tuple(check_scheme(s) for s in cp_schemes)
    if not schemes:
        raise ValueError("plan_memory: no context-parallel scheme to price")
    budget_bytes = budget_bytes * (1 - headroom)
    tiers = [t for t in ([b for b in blocks if b is None or b >= SHORT_BLOCK],
                         [b for b in blocks if b is not None and b < SHORT_BLOCK]) if t]
    sizes = sorted(check_context_parallel(c) for c in context_parallel)
    bad = [c for c in sizes if int(world) % c]
    if bad or not sizes:
        raise ValueError(f"context_parallel {bad or sizes} must divide the world of {world} ranks")

    def candidates(size, tier):  # one C and block tier, in the memory order
        for scheme in (schemes if size > 1 else schemes[:1]):
            for mode in modes:
                for policy in policies:
                    for block in tier:
                        if block is not None and 0 < call_tokens <= block and len(tier) > 1:
                            continue  # the same as no cut
                        yield estimate(config, world, mode, path_tokens=path_tokens,
                                       call_tokens=call_tokens, policy=policy,
                                       block_tokens=block, compute_dtype=compute_dtype,
                                       logits_chunk=logits_chunk, adapter_params=adapter_params,
                                       context_parallel=size, cp_scheme=scheme)

    tried = []
    if tree is None:
        for size in sizes:
            for tier in tiers:
                for est in candidates(size, tier):
                    tried.append(est)
                    if est.total <= budget_bytes:
                        return MemoryPlan(float(budget_bytes), est, est, tried)
    else:
        from dta.planning.timing import Pricer

        pricer = Pricer(config, tree, hardware, compute_dtype=compute_dtype,
                        adapter_params=adapter_params, walk=walk)
        for tier in tiers:
            tier_ests = [pricer.price(e) for size in sizes for e in candidates(size, tier)]
            tried += tier_ests
            fits = [e for e in tier_ests if e.total <= budget_bytes]
            if fits:
                best = min(fits, key=lambda e: e.time.step_s)  # the first of equals
                return MemoryPlan(float(budget_bytes), best, best, tried, "throughput",
                                  pricer.hardware_dict(), pricer)
    if not tried:
        raise ValueError("plan_memory: no mode, policy or block to try")
    if tree is None:
        return MemoryPlan(float(budget_bytes), None, min(tried, key=lambda e: e.total), tried)
    return MemoryPlan(float(budget_bytes), None, min(tried, key=lambda e: e.total), tried,
                      "throughput", pricer.hardware_dict(), pricer)


def batch_extent(tree) -> tuple[int, int]:
    """(longest root-to-leaf path, largest node) in tokens, of a PrefixTree."""
    import numpy as np

    lengths = np.asarray([len(s) for s in tree.sequences])
    nodes = [tree.length(u) for u in range(1, len(tree))]
    return int(lengths.max()) if len(lengths) else 0, int(max(nodes)) if nodes else 0


# ---------------------------------------------------------------------------- LoRA --
_LORA_SHAPES = {  # module -> (in, out) of its weight, by the shape's sizes
    "q_proj": lambda s: (s.hidden, s.heads * s.head_dim),
    "k_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "v_proj": lambda s: (s.hidden, s.kv_heads * s.head_dim),
    "o_proj": lambda s: (s.heads * s.head_dim, s.hidden),
    "gate_proj": lambda s: (s.hidden, s.intermediate),
    "up_proj": lambda s: (s.hidden, s.intermediate),
    "down_proj": lambda s: (s.intermediate, s.hidden),
}


def lora_params(config, r: int, targets) -> int:
    """Adapter parameters of rank-``r`` LoRA on ``targets`` (module names of a Llama/Qwen
    layer, or ``lm_head``): r (in + out) per adapted weight."""
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    total = 0
    for name in targets:
        if name == "lm_head":
            total += int(r) * (shape.hidden + shape.vocab)
        elif name in _LORA_SHAPES:
            total += shape.layers * int(r) * sum(_LORA_SHAPES[name](shape))
        else:
            raise ValueError(f"LoRA target {name!r} is not priced; choose from "
                             f"{', '.join(list(_LORA_SHAPES) + ['lm_head'])}")
    return total


def with_lora(est: MemoryEstimate, config, adapter_params: int, *,
              compute_dtype: str = "bfloat16") -> MemoryEstimate:
    """The estimate of a LoRA run in ``est``'s mode: the frozen base held whole in the compute
    dtype (no master, gradient or optimizer state), the adapters priced as ``estimate`` prices
    a model (replicate: all of them; zero1: fp32 masters and AdamW state sharded). fsdp is
    not offered with LoRA (dta.config.schema refuses it)."""
    if est.mode == "fsdp":
        raise ValueError("fsdp is not offered with LoRA; price replicate or zero1")
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    c = DTYPE_BYTES[compute_dtype]
    m = max(c, 4)
    A, W = int(adapter_params), est.world
    if est.mode == "replicate":
        params, grads, opt = A * c, A * c, 2 * A * c
    else:
        params = A * c + math.ceil(A / W) * m
        grads = A * c + math.ceil(A / W) * m + W * min(BUCKET_ELEMS, math.ceil(A / W)) * m
        opt = 2 * math.ceil(A / W) * m
    return MemoryEstimate(est.mode, W, int(shape.params * c + params), int(grads), int(opt),
                          est.activations, policy=est.policy, block_tokens=est.block_tokens,
                          split=est.split, context_parallel=est.context_parallel,
                          cp_scheme=est.cp_scheme)

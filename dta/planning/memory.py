"""Per-rank memory of a training step, by layout: a model in bytes, from a config.

For a model config (a Hugging Face config or dict), W ranks, a layout and the batch's
longest root-to-leaf path / largest call (node or pack), :func:`estimate` returns the bytes
one rank holds at its peak, split as ``params``, ``grads``, ``optimizer`` (AdamW: two
states) and ``activations``, and the ``host`` bytes an offloaded optimizer keeps in host
memory. The layout is a sharding mode (:data:`SHARDINGS`), an expert-parallel size E, a shard
group S (HSDP) and an offload (:data:`OFFLOADS`), defined and priced in
:mod:`dta.planning.state` (its module doc has the state by mode). Without experts, shard
groups or offload (E = 1, S = W, none), with N = all parameters, V = the vocabulary-sized
ones (input embedding and LM head, once if tied), c = compute bytes, m = master bytes (fp32
under 16-bit compute):

==========  =====================================  ==========================================  ==========
mode        params                                 grads (peak)                                optimizer
==========  =====================================  ==========================================  ==========
replicate   N m                                    N m                                         2 N m
zero1       N c + N m / W                          N c + N m / W + W b m (a reduce bucket)     2 N m / W
fsdp        (N−V) m / W + V c + V m / W + 1 layer  (N−V) m / W + V c + V m + 1 layer (c)      2 N m / W
==========  =====================================  ==========================================  ==========

(zero2, fsdp's node residency and prefetch, the offloaded layouts and AdamW's step counters:
:mod:`dta.planning.state`'s table. b: the reduce-scatter bucket, 2^24 elements per rank.
Replicate keeps its parameters and AdamW state in the compute dtype, so c = m there: pure
16-bit AdamW under bfloat16; the README table prices it in float32, the numerics zero1/fsdp
keep with their fp32 masters.)
Activations (:func:`activation_split`, :mod:`dta.planning.activations`), with B the block
(``dta.planning.blocks``: no call is longer than B; None: a call is a whole node, up to the
largest):

* ``path_kv``: the ancestors' K/V along the longest path, held as leaves with their
  gradients (2 copies), plus the path K/V each live graph's attention saved (the cache it
  read: recompute, one call over the whole path; retain, every graph on the path over its
  own prefix, about path x (n + 1) / 2 for n graphs); a hybrid model's Gated DeltaNet
  layers hold no K/V but a (conv, recurrent) state per piece on the path (leaf and gradient);
* ``graphs``: the saved activations of the calls whose graphs are alive (retain: every
  piece on the path, the path's tokens; recompute: one call, min(largest call, B)); MoE
  layers save their routed rows' (balanced routing: a rank's own rows x top_k, whatever E);
* ``head``: the LM head's chunk of fp32 logits (logits, softmax, gradient);
* ``cp_buffers`` (context parallel, C > 1 ranks per tree): one call's exchange buffers;
* ``ep_buffers`` (expert parallel, E > 1): one MoE layer call's dispatch buffers.

Context parallel (:mod:`dta.planning.cp`): the C ranks of a group walk one tree. Under the
``split`` scheme (the default) each rank stores its KV heads' share of the path's K/V with
their gradient accumulators (1/C: the path K/V divided by C) and holds its rows' share of
the live graphs and of the head's rows; ``cp_buffers`` is one attention call's all-to-all
(its rows' q/k/v sent, its heads' received). Under the ``replicated`` scheme (round 4) the
path's K/V are stored sliced by rows (retain: each graph on the path also keeps its own
pack's K/V whole) while the graphs and the head are those of one rank; ``cp_buffers`` is the
all-gathered (out, lse) and dQ of a call, its gathered K/V gradients and one piece's scores.
The model state is the same either way (fsdp and zero1 shard over the shard group, the
whole world W = data-parallel x C unless S is given).

This mirrors what ``runtime.sharding`` allocates; the benchmark
``experiments/bench_sharding.py`` measures the state beside it, and
``experiments/bench_blocks.py`` the activations against the block. :func:`plan_memory`
chooses data-parallel x context-parallel x layout x policy x block for a budget: given the
batch's tree, the fastest modeled step that fits (:mod:`dta.planning.timing`); without one,
the first that fits in the memory order (no offload first, then the smallest C, plain
sharding before shard groups, the smallest E, shardings by communication, retain before
recompute, the largest block; blocks under 1,024 tokens only when nothing fits with a longer
one); or it says by how much the cheapest misses. No candidate whose model state alone
exceeds the budget is ever chosen (the state is part of every total).
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from dta.planning.activations import (  # noqa: F401 (re-exported)
    CONTEXT_PARALLEL,
    activation_split,
    check_context_parallel,
)
from dta.planning.cp import CP_SCHEME, check_scheme
from dta.planning.lora import LORA_SHARDINGS, lora_params, with_lora  # noqa: F401
from dta.planning.shapes import BUCKET_ELEMS, DTYPE_BYTES, SHAPES, ModelShape  # noqa: F401
from dta.planning.state import GATHERED, OFFLOADS, check_layout, model_state, offload_refusal  # noqa: F401

# the sharding modes, cheapest communication first: the one list (the runtime registers a
# class for each, runtime.sharding; dta.planning.state has the layout knobs beside them)
SHARDINGS = ("replicate", "zero1", "zero2", "fsdp")
GIB = 2 ** 30


@dataclass
class MemoryEstimate:
    sharding: str  # the sharding mode's name (SHARDINGS)
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
    expert_parallel: int = 1  # E: ranks an MoE layer's routed experts are divided over
    shard_size: int | None = None  # S: ranks the sharded state spans (None: the world)
    offload: str = "none"  # OFFLOADS
    host: int = 0  # bytes this rank keeps in host memory (offloaded state, step counters)
    node_resident: bool = False  # fsdp gathers from a node-resident copy (dta.planning.state)
    prefetch: bool = False  # fsdp's next-layer all-gather overlaps the current layer
    steps: int = 0  # of host: AdamW's step counters
    refused: str = ""  # why a tried candidate does not fit (plan_memory): device or host

    def __post_init__(self):
        self.shard_size = self.world if self.shard_size is None else self.shard_size

    @property
    def total(self) -> int:
        """Device bytes: params + grads + optimizer + activations (``host`` apart)."""
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
        if self.expert_parallel > 1:
            cp += f"/expert parallel {self.expert_parallel}"
        if self.shard_size != self.world:
            cp += f"/shard {self.shard_size}"
        if self.node_resident:
            cp += "/node-resident"
        if self.prefetch:
            cp += "/prefetch"
        if self.offload != "none":
            cp += f"/offload {self.offload}"
        return f"{self.sharding}/{self.policy}/block {self.block_tokens or 'none'}{cp}"


def estimate(config, world: int, mode: str, *, path_tokens: int, call_tokens: int,
             policy: str = "recompute", compute_dtype: str = "bfloat16",
             logits_chunk: int = 1024, block_tokens: int | None = None,
             adapter_params: int = 0, context_parallel: int = 1,
             cp_scheme: str = CP_SCHEME, expert_parallel: int = 1,
             shard_size: int | None = None, offload: str = "none",
             node_resident: bool = False, prefetch: bool = False) -> MemoryEstimate:
    """Per-rank peak bytes of one step (see the module doc). adapter_params > 0: a LoRA run
    (:func:`with_lora`: the frozen base in the compute dtype, state for the adapters only).
    context_parallel: ranks per tree, dividing ``world`` (the data-parallel groups are
    ``world / context_parallel``; sharding still spans the shard group), dividing the tree
    by ``cp_scheme`` (:mod:`dta.planning.cp`). expert_parallel, shard_size, offload: the
    layout of :mod:`dta.planning.state` (checked there), with node_resident and prefetch
    (fsdp's)."""
    if mode not in SHARDINGS:
        raise ValueError(f"unknown sharding mode {mode!r}; choose one of {SHARDINGS}")
    if int(world) < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    C = check_context_parallel(context_parallel)
    if int(world) % C:
        raise ValueError(f"context_parallel={C} does not divide the world of {world} ranks")
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    W = int(world)
    mode = "replicate" if W == 1 else mode
    E, S = check_layout(shape, W, mode, expert_parallel, shard_size, offload, node_resident,
                        prefetch)
    if adapter_params and (E > 1 or S != W or offload != "none"):
        raise ValueError("a LoRA run is priced without expert parallelism, shard groups or "
                         "offload (expert_parallel=1, shard_size=world, offload=none)")
    c = DTYPE_BYTES[compute_dtype]
    st = model_state(shape, W, mode, compute_bytes=c, expert_parallel=E, shard_size=S,
                     offload=offload, node_resident=node_resident, prefetch=prefetch)
    split = activation_split(shape, path_tokens=path_tokens, call_tokens=call_tokens,
                             policy=policy, compute_bytes=c, logits_chunk=logits_chunk,
                             block_tokens=block_tokens, context_parallel=C,
                             cp_scheme=cp_scheme, expert_parallel=E)
    est = MemoryEstimate(mode, W, int(st["params"]), int(st["grads"]), int(st["optimizer"]),
                         sum(split.values()), policy=policy, block_tokens=block_tokens or None,
                         split=split, context_parallel=C, cp_scheme=cp_scheme,
                         expert_parallel=E, shard_size=S, offload=offload,
                         host=int(st["host"] + st["steps"]), node_resident=node_resident,
                         prefetch=prefetch, steps=int(st["steps"]))
    return with_lora(est, shape, adapter_params, compute_dtype=compute_dtype) \
        if adapter_params else est


def pick_sharding(config, world: int, budget_bytes: float, *, shardings=SHARDINGS,
              **kw) -> tuple[str | None, list[MemoryEstimate]]:
    """The first mode (least communication) whose estimate fits ``budget_bytes``."""
    rows = [estimate(config, world, mode, **kw) for mode in shardings]
    for r in rows:
        if r.total <= budget_bytes:
            return r.sharding, rows
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
    host_budget: float | None = None  # host bytes per rank (None: unbudgeted)

    @property
    def shortfall(self) -> float:
        """Bytes the cheapest combination lacks (0 when one fits)."""
        return 0.0 if self.chosen is not None else max(0.0, self.cheapest.total - self.budget)

    @property
    def block_tokens(self) -> int | None:
        return (self.chosen or self.cheapest).block_tokens

    def message(self) -> str:
        if self.chosen is not None:
            fast = (f", the fastest that fits ({self.chosen.time.step_s:.1f} s modeled step)"
                    if self.rule == "throughput" else "")
            return (f"{self.chosen.label()} fits: {self.chosen.total / GIB:.2f} GiB of "
                    f"{self.budget / GIB:.2f} GiB usable{fast}")
        host = "" if self.host_budget is None else \
            f" and {self.host_budget / GIB:.2f} GiB of host memory"
        return (f"nothing fits {self.budget / GIB:.2f} GiB usable{host}: the cheapest, "
                f"{self.cheapest.label()}, needs {self.cheapest.total / GIB:.2f} GiB "
                f"({self.cheapest.refused or f'{self.shortfall / GIB:.2f} GiB over'})")


def plan_memory(config, world: int, budget_bytes: float, *, path_tokens: int | None = None,
                call_tokens: int | None = None, shardings=SHARDINGS, policies=POLICY_ORDER,
                blocks=BLOCKS, compute_dtype: str = "bfloat16", logits_chunk: int = 1024,
                headroom: float = HEADROOM, adapter_params: int = 0,
                context_parallel=(1,), tree=None, hardware=None,
                cp_schemes=(CP_SCHEME,), walk=None, expert_parallel=(1,), shard_size=(None,),
                offload=("none",), node_resident=(False,), prefetch=(False,),
                host_budget_bytes: float | None = None) -> MemoryPlan:
    """Data-parallel x context-parallel x layout x policy x block for ``budget_bytes`` less
    the ``headroom`` share (a block no shorter than the largest call is the same as none:
    skipped). adapter_params > 0 prices a LoRA run (fsdp is not offered with adapters).
    context_parallel: the CP sizes to try (each must divide ``world``); cp_schemes: how a
    group of C > 1 divides its tree (:mod:`dta.planning.cp`); expert_parallel, shard_size
    (None: the world) and offload: the layouts of :mod:`dta.planning.state` to try (the
    defaults: none of them; :func:`dta.planning.state.expert_parallel_sizes` and
    :func:`~dta.planning.state.shard_sizes` list what a world allows; ``layout_choices``
    every knob's), node_resident and prefetch (tried with fsdp only; node_resident only with
    a shard size below the world). A shard size is tried with replicate only when it is the
    world. ``host_budget_bytes`` (None: unbudgeted): a candidate whose host bytes (offloaded
    state, AdamW's step counters) exceed it does not fit either; every candidate that does
    not fit says why (``refused``: device or host, by how much).

    With ``tree`` (the batch's PrefixTree; path_tokens and call_tokens default to its
    :func:`batch_extent`): **by modeled throughput**. Every candidate is priced
    (:mod:`dta.planning.timing`, ``hardware`` a :class:`~dta.planning.timing.Hardware`,
    default an H100-class GPU; the figures on ``estimate.time``) and the shortest modeled
    step among those that fit is chosen (ties: the memory order below); blocks under
    SHORT_BLOCK only when nothing fits with a longer one (short of the gradient sums on the
    host: where only those fit, the shorter blocks are priced too); an offloaded candidate only where
    the same candidate under the offload before it (:data:`OFFLOADS`' order: none,
    optimizer, gradients) does not fit (offload adds time, saves nothing else). ``walk`` (needed with a tree): the run's :class:`dta.options.WalkOptions`, whose
    packing settings plan each group's calls as the walker will (:mod:`dta.planning.work`).

    Without a tree (nothing to price time on): the first that fits in the memory order --
    no offload first, the smallest C, plain sharding before shard groups, the smallest E,
    shardings by communication, retain before recompute, the largest block (blocks under
    SHORT_BLOCK only when nothing fits at that C with a longer one)."""
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
        shardings = tuple(m for m in shardings if m in LORA_SHARDINGS)
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    schemes = tuple(check_scheme(s) for s in cp_schemes)
    if not schemes:
        raise ValueError("plan_memory: no context-parallel scheme to price")
    budget_bytes = budget_bytes * (1 - headroom)
    host_budget = float("inf") if host_budget_bytes is None else float(host_budget_bytes)
    if not host_budget > 0:
        raise ValueError(f"host_budget_bytes must be > 0 (or None), got {host_budget_bytes}")

    def fits(e: MemoryEstimate) -> bool:
        why = []
        if e.total > budget_bytes:
            why.append(f"device: {e.total / GIB:.2f} GiB, {(e.total - budget_bytes) / GIB:.2f} "
                       f"GiB over the {budget_bytes / GIB:.2f} usable")
        if e.host > host_budget:
            why.append(f"host: {e.host / GIB:.2f} GiB, {(e.host - host_budget) / GIB:.2f} GiB "
                       f"over the {host_budget / GIB:.2f} GiB host budget")
        e.refused = "; ".join(why)
        return not why
    tiers = [t for t in ([b for b in blocks if b is None or b >= SHORT_BLOCK],
                         [b for b in blocks if b is not None and b < SHORT_BLOCK]) if t]
    sizes = sorted(check_context_parallel(c) for c in context_parallel)
    bad = [c for c in sizes if int(world) % c]
    if bad or not sizes:
        raise ValueError(f"context_parallel {bad or sizes} must divide the world of {world} ranks")
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    W = int(world)
    # each size checked once, before anything is priced; the world first, then the smallest E
    groups = sorted({check_layout(shape, W, "zero1", 1, S, "none")[1] for S in shard_size},
                    key=lambda s: -s)
    eps = sorted({check_layout(shape, W, "zero1", E, None, "none")[0] for E in expert_parallel})
    for off in offload:
        check_layout(shape, W, "fsdp", 1, None, off)
    residencies = tuple(sorted({bool(r) for r in node_resident}))  # False first
    prefetches = tuple(sorted({bool(f) for f in prefetch}))
    if not (residencies and prefetches):
        raise ValueError("plan_memory: no node residency or prefetch choice to try")
    offloads = tuple(o for o in OFFLOADS if o in offload)  # none first
    pairs = [(S, E) for S in groups for E in eps if S % E == 0 or E % S == 0]
    if not (pairs and offloads):
        raise ValueError(f"plan_memory: no layout to try (shard sizes {groups} and "
                         f"expert-parallel sizes {eps} dividing one another, offload "
                         f"{tuple(offload)})")

    def candidates(size, tier, off):  # one C, block tier and offload, in the memory order
        for scheme, (S, E), mode in itertools.product(
                schemes if size > 1 else schemes[:1], pairs, shardings):
            if mode == "replicate" and S != W or offload_refusal(mode, off):
                continue  # replicate shards nothing; offload gradients is fsdp's and zero2's
            for resident, ahead, policy, block in itertools.product(
                    residencies, prefetches, policies, tier):
                if (resident or ahead) and mode not in GATHERED or resident and S == W:
                    continue  # fsdp's knobs; node residency needs the node below the world
                if block is not None and 0 < call_tokens <= block and len(tier) > 1:
                    continue  # the same as no cut
                yield estimate(shape, W, mode, path_tokens=path_tokens, call_tokens=call_tokens,
                               policy=policy, block_tokens=block, compute_dtype=compute_dtype,
                               logits_chunk=logits_chunk, adapter_params=adapter_params,
                               context_parallel=size, cp_scheme=scheme, expert_parallel=E,
                               shard_size=S, offload=off, node_resident=resident,
                               prefetch=ahead)

    tried = []
    if tree is None:
        for off in offloads:
            for size in sizes:
                for tier in tiers:
                    for est in candidates(size, tier, off):
                        tried.append(est)
                        if fits(est):
                            return MemoryPlan(float(budget_bytes), est, est, tried,
                                              host_budget=host_budget_bytes)
    else:
        from dta.planning.timing import Pricer

        pricer = Pricer(config, tree, hardware, compute_dtype=compute_dtype,
                        adapter_params=adapter_params, walk=walk)
        fitting = []
        for tier in tiers:
            tier_ests = prev = [pricer.price(e) for size in sizes for e in candidates(
                size, tier, offloads[0])]
            for off in offloads[1:]:  # offload more only where the offload before misses
                missed = {_key(e) for e in prev if e.total > budget_bytes}  # device
                prev = [pricer.price(e) for size in sizes for e in candidates(size, tier, off)
                        if _key(e) in missed]
                tier_ests += prev
            tried += tier_ests
            fitting += [e for e in tier_ests if fits(e)]
            # a tier where only the gradient sums on the host fit does not end the search:
            # the next (shorter) blocks may fit with less offload and run faster
            if any(e.offload != "gradients" for e in fitting):
                break
        if fitting:
            best = min(fitting, key=lambda e: e.time.step_s)  # the first of equals
            return MemoryPlan(float(budget_bytes), best, best, tried, "throughput",
                              pricer.hardware_dict(), pricer, host_budget_bytes)
    if not tried:
        raise ValueError("plan_memory: no mode, policy or block to try")
    cheapest = min(tried, key=_cheapest)
    if tree is None:
        return MemoryPlan(float(budget_bytes), None, cheapest, tried,
                          host_budget=host_budget_bytes)
    return MemoryPlan(float(budget_bytes), None, cheapest, tried, "throughput",
                      pricer.hardware_dict(), pricer, host_budget_bytes)


def _cheapest(e: MemoryEstimate) -> tuple:
    """What misses the budgets least: the smallest device total, then the smallest host."""
    return (e.total, e.host)


def _key(e: MemoryEstimate) -> tuple:
    """A candidate less its offload (its twin under another offload has the same key)."""
    return (e.sharding, e.policy, e.block_tokens, e.context_parallel, e.cp_scheme,
            e.expert_parallel, e.shard_size, e.node_resident, e.prefetch)


def batch_extent(tree) -> tuple[int, int]:
    """(longest root-to-leaf path, largest node) in tokens, of a PrefixTree."""
    import numpy as np

    lengths = np.asarray([len(s) for s in tree.sequences])
    nodes = [tree.length(u) for u in range(1, len(tree))]
    return int(lengths.max()) if len(lengths) else 0, int(max(nodes)) if nodes else 0

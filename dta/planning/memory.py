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
Activations: the ancestors' K/V along the longest path (leaves and their gradients), the
saved activations of the calls whose graphs are alive (retain: every node on the path;
recompute: one call), and the LM head's chunk of fp32 logits. This mirrors what
``runtime.sharding`` allocates; the benchmark ``experiments/bench_sharding.py`` measures the
first three beside it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("replicate", "zero1", "fsdp")  # cheapest communication first
GIB = 2 ** 30
BUCKET_ELEMS = 1 << 24  # runtime.sharding.flat's reduce-scatter bucket (elements per rank)

# Qwen3 dense shapes (from their Hugging Face configs): the README table's models.
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     vocab_size=151936, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, intermediate_size=17408,
                      vocab_size=151936, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, head_dim=128, intermediate_size=25600,
                      vocab_size=151936, tie_word_embeddings=False),
}
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def _get(config: Any, name: str, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config) -> "ModelShape":
        hidden = int(_get(config, "hidden_size"))
        heads = int(_get(config, "num_attention_heads"))
        return cls(hidden, int(_get(config, "num_hidden_layers")), heads,
                   int(_get(config, "num_key_value_heads", heads)),
                   int(_get(config, "head_dim", None) or hidden // heads),
                   int(_get(config, "intermediate_size")), int(_get(config, "vocab_size")),
                   bool(_get(config, "tie_word_embeddings", False)))

    @property
    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (2 * q + 2 * kv) + 2 * self.head_dim  # q,k,v,o + q/k norms
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden  # MLP + norms

    @property
    def vocab_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab_params + self.hidden


@dataclass
class MemoryEstimate:
    mode: str
    world: int
    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def state(self) -> int:
        """params + grads + optimizer (what the benchmark measures)."""
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {**asdict(self), "state": self.state, "total": self.total}


def activation_bytes(shape: ModelShape, *, path_tokens: int, call_tokens: int, policy: str,
                     compute_bytes: int, logits_chunk: int = 1024) -> int:
    """Ancestors' K/V on the longest path (leaf + gradient), live graphs, head logits."""
    c = compute_bytes
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * c  # per token, K and V
    q = shape.heads * shape.head_dim
    # saved per token per layer: norms' inputs, q/k/v, attention out, MLP gate/up/act/down in
    saved = (4 * shape.hidden + q + 2 * shape.kv_heads * shape.head_dim + q
             + 4 * shape.intermediate) * c * shape.layers
    graph_tokens = path_tokens if policy == "retain" else call_tokens
    head = 3 * min(logits_chunk, max(call_tokens, 1)) * shape.vocab * 4
    return int(2 * kv * path_tokens + saved * graph_tokens + head)


def estimate(config, world: int, mode: str, *, path_tokens: int, call_tokens: int,
             policy: str = "recompute", compute_dtype: str = "bfloat16",
             logits_chunk: int = 1024) -> MemoryEstimate:
    """Per-rank peak bytes of one step (see the module doc)."""
    if mode not in MODES:
        raise ValueError(f"unknown sharding mode {mode!r}; choose one of {MODES}")
    if int(world) < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
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
    act = activation_bytes(shape, path_tokens=path_tokens, call_tokens=call_tokens,
                           policy=policy, compute_bytes=c, logits_chunk=logits_chunk)
    return MemoryEstimate(mode, W, int(params), int(grads), int(opt), act)


def pick_mode(config, world: int, budget_bytes: float, *, modes=MODES,
              **kw) -> tuple[str | None, list[MemoryEstimate]]:
    """The first mode (least communication) whose estimate fits ``budget_bytes``."""
    rows = [estimate(config, world, mode, **kw) for mode in modes]
    for r in rows:
        if r.total <= budget_bytes:
            return r.mode, rows
    return None, rows


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
    not offered with LoRA (dta.config refuses it)."""
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
                          est.activations)

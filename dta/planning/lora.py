"""LoRA priced: the adapters' parameters of a target list, and a run's state with the base
frozen (``dta.planning.memory.estimate`` calls :func:`with_lora`; re-exported there)."""
from __future__ import annotations

import dataclasses
import math

from dta.planning.shapes import BUCKET_ELEMS, DTYPE_BYTES, ModelShape

LORA_SHARDINGS = ("replicate", "zero1")  # the modes a LoRA run is priced (and run) under

# ---------------------------------------------------------------------------- LoRA --
_LORA_SHAPES = {  # module -> (in, out) of its weight, by the shape's sizes (and an MLP's I)
    "q_proj": lambda s, i: (s.hidden, s.heads * s.head_dim),
    "k_proj": lambda s, i: (s.hidden, s.kv_heads * s.head_dim),
    "v_proj": lambda s, i: (s.hidden, s.kv_heads * s.head_dim),
    "o_proj": lambda s, i: (s.heads * s.head_dim, s.hidden),
    "gate_proj": lambda s, i: (s.hidden, i),
    "up_proj": lambda s, i: (s.hidden, i),
    "down_proj": lambda s, i: (i, s.hidden),
}
_MLP = ("gate_proj", "up_proj", "down_proj")


def lora_params(config, r: int, targets) -> int:
    """Adapter parameters of rank-``r`` LoRA on ``targets`` (module names of a Llama/Qwen
    layer, or ``lm_head``): r (in + out) per adapted weight. On an MoE model the MLP names
    are the dense layers' MLPs and the shared experts (the routed experts are not
    ``nn.Linear`` modules: LoRA does not adapt them)."""
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    total = 0
    for name in targets:
        if name == "lm_head":
            total += int(r) * (shape.hidden + shape.vocab)
        elif name in _MLP:
            shared = shape.experts.shared_inter
            total += int(r) * (shape.dense_layers * sum(_LORA_SHAPES[name](shape, shape.intermediate))
                               + (shape.sparse_layers * sum(_LORA_SHAPES[name](shape, shared))
                                  if shared else 0))
        elif name in _LORA_SHAPES:
            total += shape.layers * int(r) * sum(_LORA_SHAPES[name](shape, 0))
        else:
            raise ValueError(f"LoRA target {name!r} is not priced; choose from "
                             f"{', '.join(list(_LORA_SHAPES) + ['lm_head'])}")
    return total


def with_lora(est, config, adapter_params: int, *,
              compute_dtype: str = "bfloat16"):
    """The estimate of a LoRA run in ``est``'s mode: the frozen base held whole in the compute
    dtype (no master, gradient or optimizer state), the adapters priced as ``estimate`` prices
    a model (replicate: all of them; zero1: fp32 masters and AdamW state sharded). Only
    :data:`LORA_SHARDINGS` are offered with LoRA (dta.config.schema refuses fsdp)."""
    if est.sharding not in LORA_SHARDINGS:
        raise ValueError(f"sharding={est.sharding} is not offered with LoRA; price one of "
                         f"{LORA_SHARDINGS}")
    shape = config if isinstance(config, ModelShape) else ModelShape.of(config)
    c = DTYPE_BYTES[compute_dtype]
    m = max(c, 4)
    A, W = int(adapter_params), est.world
    if est.sharding == "replicate":
        params, grads, opt = A * c, A * c, 2 * A * c
    else:
        params = A * c + math.ceil(A / W) * m
        grads = A * c + math.ceil(A / W) * m + W * min(BUCKET_ELEMS, math.ceil(A / W)) * m
        opt = 2 * math.ceil(A / W) * m
    return dataclasses.replace(est, params=int(shape.params * c + params), grads=int(grads),
                               optimizer=int(opt))

"""A model's shape for the planner: the sizes the memory and time models read from a config.

:class:`ModelShape` is read once from a Hugging Face config (object or dict); ``SHAPES`` holds
the Qwen3 dense shapes of the docs' tables; ``DTYPE_BYTES`` and ``BUCKET_ELEMS`` the element
sizes both models count in. Integers only.
"""
from __future__ import annotations

from dataclasses import dataclass

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
BUCKET_ELEMS = 1 << 24  # runtime.sharding.flat's reduce-scatter bucket (elements per rank)


def _get(config, name: str, default=None):
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
    gdn_layers: int = 0  # Gated DeltaNet layers (hybrid models): no K/V, a state per piece
    gdn_state: int = 0  # elements of one GDN layer's (conv, recurrent) state
    gdn_heads: int = 0  # a GDN layer's value heads (what context parallelism splits)
    gdn_in: int = 0  # per token, a GDN layer's channels into its recurrence: conv (q, k, v), b, a
    gdn_out: int = 0  # per token, the recurrence's output channels (value heads x dim)

    @classmethod
    def of(cls, config) -> "ModelShape":
        hidden = int(_get(config, "hidden_size"))
        heads = int(_get(config, "num_attention_heads"))
        head_dim = int(_get(config, "head_dim", None) or hidden // heads)
        types = list(_get(config, "layer_types", None) or [])
        gdn = sum(t == "linear_attention" for t in types)
        state = vh = width_in = width_out = 0
        if gdn:
            kh = int(_get(config, "linear_num_key_heads", heads))
            vh = int(_get(config, "linear_num_value_heads", heads))
            dk = int(_get(config, "linear_key_head_dim", head_dim))
            dv = int(_get(config, "linear_value_head_dim", head_dim))
            kernel = int(_get(config, "linear_conv_kernel_dim", 4))
            state = (2 * kh * dk + vh * dv) * kernel + vh * dk * dv
            width_in, width_out = 2 * kh * dk + vh * dv + 2 * vh, vh * dv
        return cls(hidden, int(_get(config, "num_hidden_layers")), heads,
                   int(_get(config, "num_key_value_heads", heads)), head_dim,
                   int(_get(config, "intermediate_size")), int(_get(config, "vocab_size")),
                   bool(_get(config, "tie_word_embeddings", False)), gdn, state, vh,
                   width_in, width_out)

    @property
    def attention_layers(self) -> int:
        return self.layers - self.gdn_layers

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

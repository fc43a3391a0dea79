"""Models: random-init Hugging Face causal LMs from a family name and size, or a local path.

No weights are ever downloaded: ``build_model`` initializes from a config, ``load_model``
reads a local directory only. Families live in a registry so a new one is one entry.
"""
from __future__ import annotations

import os
import types
from dataclasses import dataclass

import torch

# Sizes are keyword overrides of the family's config. "tiny" is for tests, "small" for CPU
# benchmarks (hidden >= 256, >= 4 layers, 32K vocabulary), the Qwen3 shapes for the GPU script.
SIZES: dict[str, dict] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 max_position_embeddings=4096),
    "small": dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=32768),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM"),
}

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def build_config(family: str, size: str | dict = "tiny", **overrides):
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
        size = SIZES[size]
    kw = {**size, **overrides}
    if family == "qwen2":
        kw.pop("head_dim", None)  # Qwen2 derives head_dim from hidden / heads
    kw.setdefault("attention_dropout", 0.0)
    kw.setdefault("tie_word_embeddings", False)
    return getattr(transformers, FAMILIES[family].config_class)(**kw)


def build_model(family: str = "qwen3", size: str | dict = "tiny", *, dtype="float32", seed: int = 0,
                attn_implementation: str = "sdpa", **overrides):
    """A random-initialized model of `family` (llama | qwen2 | qwen3) in eval mode
    (no dropout: DFS and unpacked training must see the same deterministic forward)."""
    import transformers

    config = build_config(family, size, **overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    cls = getattr(transformers, FAMILIES[family].model_class)
    model = cls(config).to(resolve_dtype(dtype))
    return model.eval()


def load_model(path: str, *, dtype="float32", attn_implementation: str = "sdpa"):
    """Load a model from a local directory (never from a hub)."""
    import transformers

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a local directory "
                                "(DTA never downloads weights)")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype), local_files_only=True,
        attn_implementation=attn_implementation)
    return model.eval()


def make_truly_float64(model):
    """Make every norm compute in its input dtype, so a float64 model is float64 throughout.

    HF's RMSNorm upcasts to float32 and casts back, which caps DFS-vs-unpacked agreement near
    1e-7 even in float64. Verification needs a truly float64 model; training never uses this.
    """
    def rms_forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    patched = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_forward, module)
            patched += 1
    if model.config._attn_implementation == "eager":
        raise ValueError("eager attention runs softmax in float32; use sdpa for float64 checks")
    return patched

"""Models: random-init Hugging Face causal LMs from a family name and size, or a local path.

No weights are ever downloaded: ``build_model`` initializes from a config, ``load_model``
reads a local directory only. Families live in a registry so a new one is one entry.
"""
from __future__ import annotations

import contextlib
import os
import types

import torch

from dta.model import recurrent
from dta.model.families import FAMILIES, config_kwargs, refusal

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


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def build_config(family: str, size: str | dict = "tiny", *, matrix: bool = False, **overrides):
    """`family`'s config at `size`; with `matrix`, the configuration the family tests use
    (a sliding window shorter than the test sequences, logit scaling, soft-capping, ...)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    why = refusal(family)
    if why:
        raise ValueError(why)
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
        size = SIZES[size]
    cls = getattr(transformers, FAMILIES[family].config_class)
    return cls(**as_annotated(cls, config_kwargs(family, size, matrix, overrides)))


def as_annotated(cls, kw: dict) -> dict:
    """``kw`` with a bool given to a field ``cls`` annotates ``int`` passed as that int (same
    truth). transformers 5.4.0 annotates OLMoE's and OLMo2's ``tie_word_embeddings: int =
    False`` (5.5 says ``bool``), and its strict config dataclasses refuse ``False`` there:
    ``Field 'tie_word_embeddings' expected int, got bool``."""
    fields = getattr(cls, "__dataclass_fields__", {})
    return {k: int(v) if isinstance(v, bool) and k in fields and fields[k].type in (int, "int")
            else v for k, v in kw.items()}


def build_model(family: str = "qwen3", size: str | dict = "tiny", *, dtype="float32", seed: int = 0,
                attn_implementation: str | None = None, matrix: bool = False, **overrides):
    """A random-initialized model of `family` (see ``dta.model.families.FAMILIES``) in eval mode
    (no dropout: DFS and unpacked training must see the same deterministic forward).
    attn_implementation: default sdpa (eager where the family needs it, e.g. Gemma 2)."""
    import transformers

    config = build_config(family, size, matrix=matrix, **overrides)
    config._attn_implementation = attn_implementation or FAMILIES[family].attn_implementation
    if resolve_dtype(dtype) == torch.float64 and FAMILIES[family].moe:
        config._experts_implementation = "eager"  # torch's grouped_mm has no float64 kernel
    torch.manual_seed(seed)
    cls = getattr(transformers, FAMILIES[family].model_class)
    model = cls(config).to(resolve_dtype(dtype))
    if recurrent.is_hybrid(config):  # GDN decays in [0.01, 1]: see recurrent.init_decay
        recurrent.init_decay(model, seed)
    return model.eval()


def save_word_tokenizer(path: str, vocab_size: int) -> str:
    """A word-level tokenizer over tokens ``t0 .. t{vocab_size-1}`` (id i is ``t{i}``; ``t0`` pad
    and unknown, ``t1`` end of sequence) saved into the HF directory ``path``: what a framework
    that loads a tokenizer beside a random-init model needs, nothing downloaded."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                            eos_token="t1", pad_token="t0", unk_token="t0").save_pretrained(path)
    return path


def load_model(path: str, *, dtype="float32", attn_implementation: str = "sdpa"):
    """Load a model from a local directory (never from a hub)."""
    import transformers

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a local directory "
                                "(DTA never downloads weights)")
    kw = {}
    if resolve_dtype(dtype) == torch.float64:
        cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        if any((getattr(cfg, k, 0) or 0) > 1 for k in ("num_experts", "num_local_experts")):
            kw["experts_implementation"] = "eager"  # torch's grouped_mm has no float64 kernel
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype), local_files_only=True,
        attn_implementation=attn_implementation, **kw)
    return model.eval()


_LOWER_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _KeepFloat64(torch.overrides.TorchFunctionMode):
    """Inside a float64 model's forward, casts of float64 tensors down to float32 (``.float()``,
    ``.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``) are no-ops.

    HF norms (RMSNorm, Gemma's ``(1 + w)`` norm, Cohere's LayerNorm, OLMo 2's) and eager
    attention's softmax (Gemma 2) upcast to float32 and cast back (and RoPE of releases before
    5.19 casts integer positions to float32: a product of them with float64 frequencies is
    taken in float64 here), whatever their formula or
    their ``eps`` attribute's name; that rounding caps DFS-vs-unpacked agreement near 1e-7
    even in float64. Neutralizing the cast itself covers every such form at once."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16) and not kwargs \
                and len(args) == 1 and args[0].dtype == torch.float64:
            return args[0]
        if func in _MATMULS and len(args) == 2 and not kwargs \
                and all(isinstance(a, torch.Tensor) for a in args) \
                and {args[0].dtype, args[1].dtype} == {torch.float32, torch.float64}:
            # RoPE of transformers before 5.19: ``inv_freq.float() @ position_ids.float()``
            # meets float64 frequencies with float32 positions (integers, exact in both); a
            # float32 ``inv_freq`` (a host that re-initializes the buffer) keeps float32 @ float32
            return func(args[0].double(), args[1].double())
        if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:
            target = kwargs.get("dtype", args[1] if len(args) == 2 else None)
            if isinstance(target, torch.Tensor):
                target = target.dtype
            if target in _LOWER_FLOATS and (len(args) == 2) != ("dtype" in kwargs) \
                    and set(kwargs) <= {"dtype", "memory_format"}:
                # the GDN delta rule: .to(torch.float32, memory_format=contiguous_format)
                fmt = kwargs.get("memory_format")
                return args[0] if fmt is None else args[0].contiguous(memory_format=fmt)
        if func in (torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax,
                    torch.log_softmax, torch.nn.functional.log_softmax) \
                and kwargs.get("dtype") in _LOWER_FLOATS and args[0].dtype == torch.float64:
            kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
        return func(*args, **kwargs)


_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm)


def _float64_forward(self, *args, **kwargs):
    with _KeepFloat64():
        return type(self).forward(self, *args, **kwargs)


def make_truly_float64(model) -> int:
    """Make a float64 model compute in float64 throughout (verification only; training never
    uses this). The decoder's forward runs under ``_KeepFloat64``: every float32 upcast inside
    it (norms of any form, eager softmax, MoE router softmax) stays in float64 (tensors of
    other dtypes are untouched, so on a float32 model it changes nothing). Idempotent,
    and survives ``copy.deepcopy`` (the patch is a method bound to the module). Returns the
    number of modules patched. A float64 model's float32 buffers (RoPE's ``inv_freq``, which
    Hugging Face builds in float32 whatever the model's dtype) are raised to float64 with it:
    on transformers before 5.19 the dtype of ``inv_freq`` decides whether RoPE runs in float32
    (``inv_freq.float() @ positions.float()``): 2.3e-8 apart in log-probs on 5.10.4."""
    decoder = model.get_decoder()
    decoder.forward = types.MethodType(_float64_forward, decoder)
    if any(p.dtype == torch.float64 for p in model.parameters()):
        raise_buffers(model, torch.float64)
    return 1


def raise_buffers(model, compute: torch.dtype) -> int:
    """Cast every floating buffer of ``model`` narrower than ``compute`` to ``compute`` (none is
    lowered: under 16-bit compute float32 buffers stay float32, as Hugging Face leaves them);
    returns how many were cast. The engine core applies it in every sharding mode."""
    cast = 0
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != compute \
                    and torch.promote_types(b.dtype, compute) == compute:
                module._buffers[name] = b.to(compute)
                cast += 1
    return cast


@contextlib.contextmanager
def keep_float64():
    """The same no-downcast rule for code outside the decoder (the self-check's probe)."""
    with _KeepFloat64():
        yield

"""The family registry: which Hugging Face causal LMs DTA builds, and how it has tested them.

A family is one entry: its config and model classes, how the generic size keywords
(``dta.model.models.SIZES``, Llama names) map onto its config, its fixed overrides, and the
*matrix* overrides the family tests use (a sliding window shorter than the test sequences
where the family has one, logit scaling, soft-capping, experts). ``TESTED_MODEL_CLASSES``
is the set of model classes in the tested matrix: the self-check warns for any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 8  # the tests' sliding window: shorter than their ~40-token sequences


@dataclass(frozen=True)
class Family:
    config_class: str
    model_class: str
    rename: dict = field(default_factory=dict)  # generic size key -> this config's key
    drop: tuple = ()  # generic size keys this config has no use for
    fixed: dict = field(default_factory=dict)  # always applied (before user overrides)
    matrix: dict = field(default_factory=dict)  # the tested configuration's extras
    features: tuple = ()  # what the matrix entry exercises (for the support matrix)
    attn_implementation: str = "sdpa"  # the default attention for this family
    # the first transformers release DTA trains this family on (it brings the family, or what
    # the walk needs of it); older releases refuse the family in one line (``refusal``)
    since: str = "5.0.0"

    @property
    def moe(self) -> bool:
        return "MoE" in self.features


_MOE_SMALL = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GDN = "Gated DeltaNet (recurrent) layers"
_HYBRID_SINCE = "5.5.0"  # LinearAttentionLayer, the cache the walk forks GDN states through
_HYBRID_MATRIX = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention",
                                                        "linear_attention", "linear_attention"])

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", drop=("head_dim",),
                    # layer 0 full, layers >= 1 slide (max_window_layers)
                    matrix=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                    features=("window: layers >= max_window_layers",)),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM",
                    matrix=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
                    features=("window: all layers",)),
    "mistral": Family("MistralConfig", "MistralForCausalLM", matrix=dict(sliding_window=WINDOW),
                      features=("window: all layers",)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      fixed=dict(num_local_experts=4, num_experts_per_tok=2),
                      matrix=dict(sliding_window=WINDOW), features=("window: all layers", "MoE")),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", fixed=_MOE_SMALL,
                        matrix=dict(use_sliding_window=True, sliding_window=WINDOW),
                        features=("window: all layers", "MoE")),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", drop=("head_dim",),
                    fixed=dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2),
                    features=("MoE",)),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM", drop=("head_dim",),
                   fixed=dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                   matrix=dict(sliding_window=WINDOW),
                   features=("window: all layers",)),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM", fixed=dict(pad_token_id=0),
                    features=("scaled embeddings", "(1 + w) norms")),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", fixed=dict(pad_token_id=0),
                     # a small cap so that tanh is far from linear on the test logits
                     matrix=dict(sliding_window=WINDOW, final_logit_softcapping=3.0,
                                 attn_logit_softcapping=50.0),
                     features=("window: interleaved", "scaled embeddings", "soft-capping"),
                     attn_implementation="eager"),  # HF: sdpa cannot soft-cap attention
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", fixed=dict(pad_token_id=0),
                     matrix=dict(sliding_window=WINDOW, final_logit_softcapping=3.0,
                                 layer_types=["sliding_attention", "full_attention"]),
                     features=("window: interleaved", "scaled embeddings", "soft-capping")),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", drop=("head_dim",),
                      matrix=dict(logits_scaling=8.0, embedding_multiplier=12.0,
                                  residual_multiplier=0.5, attention_multiplier=0.1),
                      features=("logits_scaling 8", "embedding multiplier")),
    "cohere": Family("CohereConfig", "CohereForCausalLM", drop=("head_dim",),
                     fixed=dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                     matrix=dict(logit_scale=0.0625, tie_word_embeddings=True),
                     features=("logit_scale", "tied head")),
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", drop=("head_dim",),
                         fixed=dict(residual_dropout=0.0, embedding_dropout=0.0, bos_token_id=1,
                                    eos_token_id=2),
                         matrix=dict(sliding_window=WINDOW), features=("window: all layers",)),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", drop=("head_dim",),
                    fixed=dict(pad_token_id=0)),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel",
                   rename=dict(hidden_size="n_embd", num_hidden_layers="n_layer",
                               num_attention_heads="n_head", intermediate_size="n_inner",
                               max_position_embeddings="n_positions"),
                   drop=("head_dim", "num_key_value_heads", "attention_dropout"),
                   fixed=dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              bos_token_id=1, eos_token_id=2),
                   matrix=dict(tie_word_embeddings=True),
                   features=("learned positions", "tied head")),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM",
                       drop=("head_dim", "num_key_value_heads"),
                       fixed=dict(hidden_dropout=0.0, bos_token_id=1, eos_token_id=2),
                       features=("partial rotary", "parallel residual")),
    "opt": Family("OPTConfig", "OPTForCausalLM", rename=dict(intermediate_size="ffn_dim"),
                  drop=("head_dim", "num_key_value_heads"),
                  fixed=dict(dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2),
                  # a projected embedding (project_in / project_out) and a tied head
                  matrix=dict(word_embed_proj_dim=32, tie_word_embeddings=True),
                  features=("learned positions (offset 2)", "projected embedding", "tied head")),
    # Hybrid linear attention (dta/model/recurrent.py): Gated DeltaNet layers, whose (conv, recurrent)
    # state the walk forks, interleaved with gated full attention; GDN head sizes derive from
    # the generic size (recurrent.gdn_config_defaults). The matrix puts attention between GDN
    # layers (a GDN layer reads attention output and the other way round).
    "qwen3_5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", matrix=_HYBRID_MATRIX,
                      since=_HYBRID_SINCE, features=(_GDN, "gated attention", "(1 + w) norms")),
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", since=_HYBRID_SINCE,
                          fixed=dict(_MOE_SMALL, shared_expert_intermediate_size=32),
                          matrix=_HYBRID_MATRIX, features=(_GDN, "gated attention", "MoE")),
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM", since=_HYBRID_SINCE,
                         fixed=dict(_MOE_SMALL, shared_expert_intermediate_size=32),
                         matrix=_HYBRID_MATRIX, features=(_GDN, "gated attention", "MoE")),
}

TESTED_MODEL_CLASSES = frozenset(f.model_class for f in FAMILIES.values())


def refusal(family: str, installed: str | None = None) -> str | None:
    """Why the installed transformers cannot give ``family`` (one line naming the release that
    brings it), or None."""
    from packaging.version import Version

    if installed is None:
        import transformers

        installed = transformers.__version__
    since = FAMILIES[family].since
    if Version(Version(installed).base_version) < Version(since):
        return (f"model family {family!r} needs transformers >= {since} (installed: "
                f"transformers {installed}); see docs/versions.md")
    return None


def config_kwargs(family: str, size: dict, matrix: bool, overrides: dict) -> dict:
    """The keyword arguments of `family`'s config class for a generic `size`."""
    fam = FAMILIES[family]
    kw = {fam.rename.get(k, k): v for k, v in size.items() if k not in fam.drop}
    kw.update(fam.fixed)
    if matrix:
        kw.update(fam.matrix)
    for k, v in overrides.items():
        kw[fam.rename.get(k, k)] = v
    if _GDN in fam.features:
        from dta.model.recurrent import gdn_config_defaults

        for k, v in gdn_config_defaults(kw).items():
            kw.setdefault(k, v)
    if "attention_dropout" not in fam.drop:
        kw.setdefault("attention_dropout", 0.0)
    kw.setdefault("tie_word_embeddings", False)
    return kw

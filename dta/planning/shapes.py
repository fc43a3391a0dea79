"""A model's shape for the planner: the sizes the memory and time models read from a config.

:class:`ModelShape` is read once from a Hugging Face config (object or dict; a multimodal
config's ``text_config``); ``SHAPES`` holds the named shapes of the docs' tables;
``DTYPE_BYTES`` and ``BUCKET_ELEMS`` the element sizes both models count in. Integers only.

Mixture-of-experts configs (``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``olmoe``,
``qwen3_5_moe``, ``qwen3_next``; field names as transformers 5.25 spells them): a *sparse*
layer's MLP is ``num_experts`` (``num_local_experts``) routed experts of
``moe_intermediate_size`` (Mixtral, OLMoE: ``intermediate_size``), ``num_experts_per_tok`` of
them per token, a router (``num_experts x hidden``) and, where
``shared_expert_intermediate_size`` is given, a shared expert and its one-output gate. Layer
i is sparse unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
(the Qwen MoE rule; Mixtral, OLMoE and Qwen3.5-MoE have neither field: every layer); the
others are dense MLPs of ``intermediate_size``. :attr:`ModelShape.params` counts every
parameter, :attr:`~ModelShape.active_params` those one token uses (the ``top_k`` routed
experts, not all), :attr:`~ModelShape.routed_params` the routed experts' (what expert
parallelism divides).
"""
from __future__ import annotations

from dataclasses import dataclass

# Named shapes, written from the models' published Hugging Face config.json files (from
# memory: this machine has no internet; tests/test_planning_moe.py pins their totals against
# the published counts: Qwen3-8B 8.19B, 14B 14.8B, 32B 32.8B, Qwen3-30B-A3B 30.5B (3.3B
# active), Qwen3-235B-A22B 235B (22B active), Llama-3.1-70B 70.6B, Mixtral-8x7B 46.7B
# (12.9B active)).
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
    "llama-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80,  # Llama-3.1
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                      intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
                          vocab_size=151936, tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            intermediate_size=12288, moe_intermediate_size=1536,
                            num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                            mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, tie_word_embeddings=False),
}
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
BUCKET_ELEMS = 1 << 24  # runtime.sharding.flat's reduce-scatter bucket (elements per rank)


def _get(config, name: str, default=None):
    if isinstance(config, dict):
        value = config.get(name, default)
    else:
        value = getattr(config, name, default)
    return default if value is None else value


def text_config(config):
    """The decoder's config: ``config`` itself, or its ``text_config`` where it has no
    ``hidden_size`` of its own (a multimodal config.json such as Qwen3.5's)."""
    if _get(config, "hidden_size") is None and _get(config, "text_config") is not None:
        return _get(config, "text_config")
    return config


def _int(config, name: str) -> int:
    value = _get(config, name)
    if value is None:
        raise ValueError(f"model config has no {name!r}")
    return int(value)


@dataclass(frozen=True)
class Experts:
    """A config's routed experts (``count`` 0: a dense model), read by :meth:`of`."""

    count: int = 0  # routed experts per sparse layer
    top_k: int = 0  # experts a token is routed to
    inter: int = 0  # one expert's intermediate size
    shared_inter: int = 0  # the shared expert's (0: none)
    sparse_layers: int = 0  # layers whose MLP is the experts (the others: dense MLPs)

    @classmethod
    def of(cls, config, layers: int) -> "Experts":
        config = text_config(config)
        count = int(_get(config, "num_experts", 0) or _get(config, "num_local_experts", 0))
        if count <= 0:
            return cls()
        top_k = int(_get(config, "num_experts_per_tok", 0))
        if not 0 < top_k <= count:
            raise ValueError(f"model config: num_experts_per_tok must be in [1, {count}] "
                             f"(its experts), got {_get(config, 'num_experts_per_tok')!r}")
        inter = int(_get(config, "moe_intermediate_size", 0) or _int(config, "intermediate_size"))
        only = set(int(i) for i in _get(config, "mlp_only_layers", []))
        step = int(_get(config, "decoder_sparse_step", 1))
        if step < 1:
            raise ValueError(f"model config: decoder_sparse_step must be >= 1, got {step}")
        sparse = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
        return cls(count, top_k, inter, int(_get(config, "shared_expert_intermediate_size", 0)),
                   sparse)


def gdn_layer(config, hidden: int) -> dict:
    """One Gated DeltaNet layer's sizes: ``params`` (in_proj_qkvz, in_proj_ba, conv, out_proj,
    decays, norm),
    ``state`` (elements of its (conv, recurrent) state), ``heads`` (value heads), ``in`` and
    ``out`` (per token, the channels into and out of the recurrence), and the delta rule's
    ``k_heads``, ``dk``, ``dv``."""
    kh, vh = _int(config, "linear_num_key_heads"), _int(config, "linear_num_value_heads")
    dk, dv = _int(config, "linear_key_head_dim"), _int(config, "linear_value_head_dim")
    kernel = int(_get(config, "linear_conv_kernel_dim", 4))
    conv = 2 * kh * dk + vh * dv
    params = (hidden * (conv + vh * dv + 2 * vh) + vh * dv * hidden + conv * kernel
              + 2 * vh + dv)  # + A_log, dt_bias, the gated norm
    return dict(params=params, state=conv * kernel + vh * dk * dv, heads=vh,
                **{"in": conv + 2 * vh, "out": vh * dv}, k_heads=kh, dk=dk, dv=dv)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # a dense MLP layer's (0: every layer is sparse)
    vocab: int
    tied: bool
    gdn_layers: int = 0  # Gated DeltaNet layers (hybrid models): no K/V, a state per piece
    gdn_state: int = 0  # elements of one GDN layer's (conv, recurrent) state
    gdn_heads: int = 0  # a GDN layer's value heads (what context parallelism splits)
    gdn_in: int = 0  # per token, a GDN layer's channels into its recurrence: conv (q, k, v), b, a
    gdn_out: int = 0  # per token, the recurrence's output channels (value heads x dim)
    gdn_params: int = 0  # one GDN layer's parameters
    gated_q: bool = False  # hybrid models' attention: q_proj also yields the output gate
    experts: Experts = Experts()

    @classmethod
    def of(cls, config) -> "ModelShape":
        config = text_config(config)
        hidden = _int(config, "hidden_size")
        layers = _int(config, "num_hidden_layers")
        heads = _int(config, "num_attention_heads")
        head_dim = int(_get(config, "head_dim", 0) or hidden // heads)
        types = list(_get(config, "layer_types", []))
        gdn_n = sum(t == "linear_attention" for t in types)
        gdn = gdn_layer(config, hidden) if gdn_n else {}
        experts = Experts.of(config, layers)
        dense = layers - experts.sparse_layers
        inter = _int(config, "intermediate_size") if dense else \
            int(_get(config, "intermediate_size", 0))
        return cls(hidden, layers, heads, int(_get(config, "num_key_value_heads", heads)),
                   head_dim, inter, _int(config, "vocab_size"),
                   bool(_get(config, "tie_word_embeddings", False)), gdn_n,
                   gdn.get("state", 0), gdn.get("heads", 0), gdn.get("in", 0),
                   gdn.get("out", 0), gdn.get("params", 0), bool(gdn_n), experts)

    # ------------------------------------------------------------------ layers --
    @property
    def attention_layers(self) -> int:
        return self.layers - self.gdn_layers

    @property
    def sparse_layers(self) -> int:
        return self.experts.sparse_layers

    @property
    def dense_layers(self) -> int:
        return self.layers - self.experts.sparse_layers

    @property
    def is_moe(self) -> bool:
        return self.experts.sparse_layers > 0

    @property
    def attention_params(self) -> int:
        """One full-attention layer: q (x 2 with the output gate), k, v, o, q/k norms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q * (2 if self.gated_q else 1) + q + 2 * kv) + 2 * self.head_dim

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden * self.experts.inter

    @property
    def sparse_fixed_params(self) -> int:
        """A sparse layer's MLP less its routed experts: the router, the shared expert and
        its gate."""
        e = self.experts
        return e.count * self.hidden + (3 * self.hidden * e.shared_inter + self.hidden
                                        if e.shared_inter else 0)

    def layer_params_at(self, expert_parallel: int = 1, routed: bool = True) -> int:
        """The largest decoder layer's parameters on one rank when each holds
        1/``expert_parallel`` of the routed experts; ``routed=False``: less its routed
        experts (what fsdp gathers under expert parallelism, which leaves them out)."""
        mixer = max(self.attention_params if self.attention_layers else 0,
                    self.gdn_params if self.gdn_layers else 0)
        E = int(expert_parallel)
        experts = -(-self.experts.count // E) * self.expert_params if routed else 0
        mlp = max(self.dense_mlp_params if self.dense_layers else 0,
                  self.sparse_fixed_params + experts if self.sparse_layers else 0)
        return mixer + mlp + 2 * self.hidden  # + the two norms

    @property
    def layer_params(self) -> int:
        return self.layer_params_at(1)

    # ------------------------------------------------------------------- totals --
    @property
    def vocab_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def routed_params(self) -> int:
        """Every routed expert of every sparse layer (what expert parallelism divides)."""
        return self.sparse_layers * self.experts.count * self.expert_params

    @property
    def params(self) -> int:
        return (self.attention_layers * self.attention_params + self.gdn_layers * self.gdn_params
                + self.dense_layers * self.dense_mlp_params
                + self.sparse_layers * self.sparse_fixed_params + self.routed_params
                + 2 * self.hidden * self.layers + self.vocab_params + self.hidden)

    @property
    def dense_params(self) -> int:
        """Everything but the routed experts (attention, shared experts, routers, norms,
        embeddings): what every rank holds whatever the expert parallelism."""
        return self.params - self.routed_params

    @property
    def active_params(self) -> int:
        """The parameters one token uses: its ``top_k`` routed experts, not all of them."""
        return self.dense_params + self.sparse_layers * self.experts.top_k * self.expert_params

    @property
    def tensors(self) -> int:
        """Parameter tensors, a bound (what AdamW keeps a ``step`` counter for, one per
        stepped tensor): per attention layer q, k, v, o, their biases and the q/k norms (9);
        per Gated DeltaNet layer 8; a dense MLP 3; a sparse layer its router, its routed
        experts as separate modules (3 per expert: more than the fused two) and a shared
        expert with its gate; two norms a layer; the embedding, the final norm and an untied
        LM head."""
        e = self.experts
        sparse = 1 + 3 * e.count + (4 if e.shared_inter else 0)
        return (9 * self.attention_layers + 8 * self.gdn_layers + 3 * self.dense_layers
                + sparse * self.sparse_layers + 2 * self.layers + 2 + (0 if self.tied else 1))

    def rank_params(self, expert_parallel: int = 1) -> int:
        """The parameters one rank computes with when each holds 1/``expert_parallel`` of
        the routed experts (the dense part whole)."""
        return self.dense_params + self.routed_params // int(expert_parallel)

    # ------------------------------------------------------------- activations --
    @property
    def mlp_saved(self) -> int:
        """Elements one token's MLPs save for the backward, summed over the layers: a dense
        MLP its gate, up, activation and down input (4 I); a sparse layer per routed row its
        gathered input and expert output (2 h) and the expert's 4 I, plus the router's
        logits and probabilities (2 x experts) and the shared expert's 4 I."""
        e = self.experts
        sparse = e.top_k * (2 * self.hidden + 4 * e.inter) + 2 * e.count + 4 * e.shared_inter
        return self.dense_layers * 4 * self.intermediate + self.sparse_layers * sparse


def mlp_active_params(config, layers: int, hidden: int, dense_inter: int, mats: int) -> int:
    """The MLP parameters one token uses, summed over the layers (the FLOP model's:
    :meth:`dta.planning.cost.CostModel.from_config`): a dense layer ``mats`` x hidden x its
    intermediate, a sparse layer its ``top_k`` routed experts, router and shared expert."""
    e = Experts.of(config, layers)
    sparse = (e.top_k * 3 * hidden * e.inter + e.count * hidden
              + (3 * hidden * e.shared_inter + hidden if e.shared_inter else 0))
    return (layers - e.sparse_layers) * mats * hidden * dense_inter + e.sparse_layers * sparse

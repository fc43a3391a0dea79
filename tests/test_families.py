"""Every family of the registry, in its tested configuration (``build_model(matrix=True)``:
a sliding window of 8 on ~40-token sequences where the family has one, logit scaling,
soft-capping, scaled embeddings, tied heads, experts), float64 on a truly float64 model:
DFS equals one-sequence-at-a-time training to <= 1e-10 on log-probs, loss, every gradient
and one AdamW update, under both memory policies; the forward-only walk's log-probs too.

Gradients that are zero in exact arithmetic (OPT's k_proj.bias) are compared against the
whole gradient's norm (``dta.verify`` docstring)."""
import numpy as np
import pytest
import torch

from dta.batch import Batch
from dta.losses import PPO
from dta.model.families import FAMILIES, WINDOW
from dta.model.models import build_model, make_truly_float64
from dta.reference import sequence_logprobs
from dta.train import accumulate_gradients, forward_logprobs
from dta.tree import PrefixTree
from dta.verify import verify
from tests.cases import hard_sequences, make_records

LOSS = PPO(eps_clip=0.2, dual_clip=3.0)
# The hybrid (Gated DeltaNet) families have their own, heavier tests: tests/test_hybrid.py.
ATTENTION_FAMILIES = sorted(f for f, fam in FAMILIES.items()
                            if not any("DeltaNet" in x for x in fam.features))
WINDOWED = [f for f in ATTENTION_FAMILIES if "sliding_window" in FAMILIES[f].matrix]


def window_sequences(vocab: int = 512, seed: int = 7) -> list[np.ndarray]:
    """A tree whose nodes are shorter and longer than the window, whose shared prefix is
    longer than the window and whose forks sit beyond it: root 5 tokens (< window), a
    14-token node (> window), forks at 19, 22 and 33, single-token and 10-token leaves,
    paths up to 45 tokens."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(3, vocab, n)

    root, mid = tok(5), tok(14)
    a = np.concatenate([root, mid])  # 19 tokens: shared by every sequence below
    b = np.concatenate([a, tok(3)])  # fork at 22
    c = np.concatenate([b, tok(11)])  # fork at 33
    return [np.concatenate([a, tok(1)]), np.concatenate([a, tok(10)]),
            np.concatenate([b, tok(1)]), np.concatenate([b, tok(6)]),
            np.concatenate([c, tok(12)]), np.concatenate([c, tok(4)]), c.copy(),
            np.concatenate([root, tok(30)])]  # shares only the root (shorter than the window)


def family_batch(model) -> Batch:
    """The window tree plus the hard batch (forks, duplicates, strict prefixes), with
    behaviour log-probs near the model's own so PPO ratios straddle the clip range."""
    seqs = window_sequences() + hard_sequences()
    lp = forward_logprobs(model, Batch.from_records([{"input_ids": s} for s in seqs])).logprobs
    return Batch.from_records(make_records(seqs, old_logprobs=[x.double().numpy() for x in lp]))


def test_every_family_in_the_issue_is_covered():
    assert set(ATTENTION_FAMILIES) >= {
        "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "phi3", "gemma", "gemma2",
        "gemma3", "granite", "cohere", "starcoder2", "olmo2", "gpt2", "gpt_neox", "opt", "olmoe"}


@pytest.fixture(scope="module", params=ATTENTION_FAMILIES)
def family_f64(request):
    model = build_model(request.param, "tiny", dtype="float64", seed=0, matrix=True)
    make_truly_float64(model)
    return request.param, model, family_batch(model)


def test_window_batch_shape():
    tree = PrefixTree(window_sequences())
    assert max(map(len, window_sequences())) > 4 * WINDOW
    lengths = [tree.length(u) for u in range(1, len(tree))]
    assert min(lengths) < WINDOW < max(lengths)
    forks = [int(tree.start[c]) for u in range(len(tree)) for c in tree.children[u]
             if len(tree.children[u]) > 1 and u > 0]
    assert sorted(set(forks)) == [5, 19, 22, 33]  # one inside the window, three beyond it


@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_family_float64_exact(family_f64, policy):
    family, model, batch = family_f64
    report = verify(model, batch, LOSS, policy=policy, logits_chunk=7)
    assert report.truly_float64
    for err in ("logprobs", "loss", "grad", "params", "update"):
        assert getattr(report, f"{err}_rel_err") <= 1e-10, (family, policy, report)
    assert report.max_rel_err() <= 1e-10


def test_family_forward_walk_logprobs(family_f64):
    family, model, batch = family_f64
    walk = forward_logprobs(model, batch, logits_chunk=5)
    with torch.no_grad():
        for i, ids in enumerate(batch.input_ids):
            ref, _ = sequence_logprobs(model, ids)
            assert float((walk.logprobs[i] - ref).abs().max()) <= 1e-10 * max(1.0, float(ref.abs().max())), family


@pytest.mark.parametrize("family", WINDOWED)
def test_window_is_active(family):
    """The tested window changes the model's log-probs (so the tests above exercise it):
    the same weights with a window longer than every sequence give different values."""
    seq = window_sequences()[4]
    lps = []
    for window in (WINDOW, 10_000):
        model = build_model(family, "tiny", dtype="float64", seed=0, matrix=True,
                            sliding_window=window)
        with torch.no_grad():
            lps.append(sequence_logprobs(model, seq)[0])
    assert torch.equal(lps[0][:WINDOW], lps[1][:WINDOW])  # inside the window: the same
    assert float((lps[0] - lps[1]).abs().max()) > 1e-3


def test_scaled_embedding_tied_head_exact():
    """Gemma's √hidden embedding scale with the head tied to it (the issue's 62-88 % case),
    and a temperature on top of soft-capping."""
    model = build_model("gemma3", "tiny", dtype="float64", seed=2, matrix=True,
                        tie_word_embeddings=True)
    make_truly_float64(model)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    report = verify(model, family_batch(model), LOSS, temperature=0.7, logits_chunk=5)
    assert report.max_rel_err() <= 1e-10, report


def test_softcap_float32():
    model = build_model("gemma2", "tiny", dtype="float32", seed=1, matrix=True)
    report = verify(model, family_batch(model), LOSS)
    for err in ("logprobs", "loss", "grad", "params"):
        assert getattr(report, f"{err}_rel_err") <= 1e-4, report


# ---------------------------------------------------------------------------- MoE --
def test_router_aux_loss_refused_then_excluded():
    model = build_model("olmoe", "tiny", dtype="float64", seed=0, output_router_logits=True,
                        router_aux_loss_coef=0.01)
    make_truly_float64(model)
    batch = family_batch(model)  # the forward-only walk is allowed
    with pytest.raises(ValueError, match="OlmoeForCausalLM.*router_aux_loss_coef=0.01.*exclude"):
        accumulate_gradients(model, batch, LOSS)
    assert all(p.grad is None for p in model.parameters())
    res = accumulate_gradients(model, batch, LOSS, router_aux_loss="exclude")
    assert res.walk.nodes > 0 and any(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------ float64 norms --
@pytest.mark.parametrize("family", ["gemma", "cohere", "olmo2", "gpt_neox", "gemma2"])
def test_truly_float64_norms(family):
    """Norms of every form (Gemma's (1 + w) RMSNorm, Cohere's bias-free LayerNorm with
    `variance_epsilon`, OLMo 2's, torch LayerNorm with bias) and Gemma 2's eager softmax
    compute in float64 once patched: the patched output matches a float64 recomputation of
    the norm formula to rounding, the unpatched one does not (it went through float32)."""
    model = build_model(family, "tiny", dtype="float64", seed=0, matrix=True)
    norm = next(m for n, m in model.named_modules() if "norm" in type(m).__name__.lower())
    x = torch.randn(3, 64, dtype=torch.float64) * 3 + 1
    w = norm.weight.detach() + torch.randn_like(norm.weight) * 0.1
    with torch.no_grad():
        norm.weight.copy_(w)
    eps = next(getattr(norm, a) for a in ("eps", "variance_epsilon") if hasattr(norm, a))
    if type(norm).__name__ == "GemmaRMSNorm" or "Gemma" in type(norm).__name__:
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)
    elif "Cohere" in type(norm).__name__ or isinstance(norm, torch.nn.LayerNorm):
        mu = x.mean(-1, keepdim=True)
        want = (x - mu) * torch.rsqrt((x - mu).pow(2).mean(-1, keepdim=True) + eps) * w
        if getattr(norm, "bias", None) is not None:
            want = want + norm.bias.detach()
    else:
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    from dta.model.models import keep_float64

    with torch.no_grad():
        plain = norm(x)
        with keep_float64():
            patched = norm(x)
    assert float((patched - want).abs().max()) < 1e-13
    if not isinstance(norm, torch.nn.LayerNorm):  # torch's LayerNorm is float64 already
        assert float((plain - want).abs().max()) > 1e-10
    assert make_truly_float64(model) == 1

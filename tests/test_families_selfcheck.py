"""The walker's self-check: a model the walker would train wrong is refused before training,
naming its class and the differing part, with nothing changed; a faithful one passes once
per model object; an architecture outside the tested matrix passes with a warning."""
import warnings

import numpy as np
import pytest
import torch

from dta import selfcheck
from dta.batch import Batch
from dta.losses import NLL
from dta.model.models import build_model, make_truly_float64
from dta.train import accumulate_gradients
from dta.verify import verify
from tests.cases import hard_batch


class ScaledHead(torch.nn.Linear):
    """A linear head with an extra output scale: the walker reads only its weight."""

    def forward(self, x):
        return super().forward(x) * 1.5


def altered_model(dtype="float32"):
    model = build_model("qwen3", "tiny", dtype=dtype, seed=0)
    old = model.lm_head
    head = ScaledHead(old.in_features, old.out_features, bias=False).to(old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight)
    model.lm_head = head
    return model


def batch_for(model):
    rng = np.random.default_rng(0)
    return Batch.from_records([{"input_ids": rng.integers(3, 500, 20)} for _ in range(3)])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_altered_head_is_refused_untouched(dtype):
    model = altered_model(dtype)
    model.train()  # the mode is restored too
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    # a pre-existing gradient on one tensor must come back as the very same object
    g0 = torch.ones_like(model.model.norm.weight)
    model.model.norm.weight.grad = g0
    with pytest.raises(selfcheck.SelfCheckError) as err:
        accumulate_gradients(model, batch_for(model), NLL())
    msg = str(err.value)
    assert "Qwen3ForCausalLM" in msg and "head (logit transform)" in msg, msg
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        if p is model.model.norm.weight:
            assert p.grad is g0 and bool((g0 == 1).all())
        else:
            assert p.grad is None, n
    assert model.training
    # refused again from the cache, without a new probe
    with pytest.raises(selfcheck.SelfCheckError):
        accumulate_gradients(model, batch_for(model), NLL())


def test_self_check_off_trains_the_altered_model_wrong():
    """What the check prevents: without it, the walker trains the altered model silently wrong."""
    model = altered_model("float64")
    make_truly_float64(model)
    batch = batch_for(model)
    dfs = accumulate_gradients(model, batch, NLL(), self_check=False)
    from dta.reference import unpacked_gradients

    model.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model, batch, NLL())
    assert abs(dfs.loss - ref.loss) / abs(ref.loss) > 1e-5  # vs <= 1e-10 when exact


def test_faithful_model_probed_once(monkeypatch):
    calls = []
    original = selfcheck._compare
    monkeypatch.setattr(selfcheck, "_compare", lambda *a: (calls.append(1), original(*a))[1])
    model = build_model("qwen3", "tiny", seed=0)
    for _ in range(3):
        accumulate_gradients(model, batch_for(model), NLL())
    assert len(calls) == 1
    report = selfcheck._CACHE[model]
    assert report.passed and report.tested_class
    assert set(report.errors) == {"head (logit transform)", "cache/positions (hidden states after the path)",
                                  "embedding gradient", "LM head gradient (hand-derived)", "body gradients"}
    print("self-check on tiny qwen3 float32:", f"{report.seconds:.3f}s", report.errors)


def test_unknown_architecture_is_probed_and_warned():
    from transformers import Qwen3ForCausalLM

    class MyLM(Qwen3ForCausalLM):
        pass

    ref = build_model("qwen3", "tiny", seed=0)
    model = MyLM(ref.config).eval()
    with pytest.warns(UserWarning, match="MyLM is not in DTA's tested model matrix"):
        accumulate_gradients(model, batch_for(model), NLL())


class DoubledEmbedding(torch.nn.Embedding):
    """Not a plain lookup and no known scale: the walker must differentiate it by autograd."""

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight) * 2.0 + 0.01


def test_unknown_embedding_falls_back_to_autograd():
    model = build_model("llama", "tiny", dtype="float64", seed=4, tie_word_embeddings=True)
    old = model.get_input_embeddings()
    emb = DoubledEmbedding(old.num_embeddings, old.embedding_dim).double()
    emb.weight = old.weight  # still tied to the head
    model.set_input_embeddings(emb)
    make_truly_float64(model)
    from dta.model.modeling import EmbeddingInput

    assert not EmbeddingInput(model).as_leaf
    report = verify(model, hard_batch(model), NLL())
    assert report.max_rel_err() <= 1e-10, report


def test_self_check_in_model_dtypes_passes_for_the_matrix():
    """bf16 and float64 (norms not patched) stay within their tolerances."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tested classes: no warning
        for family, dtype in (("gemma3", "bfloat16"), ("granite", "float64"), ("opt", "float32")):
            model = build_model(family, "tiny", dtype=dtype, seed=0, matrix=True)
            report = selfcheck.self_check(model)
            assert report.passed, report


def test_self_check_runs_inside_no_grad():
    """A forward-only step built under no_grad (as AReaL's engines do) still probes."""
    model = build_model("qwen3", "tiny", seed=5)
    from dta.train import forward_logprobs

    with torch.no_grad():
        res = forward_logprobs(model, batch_for(model))
    assert res.nodes == 3 and selfcheck._CACHE[model].passed
    assert all(p.grad is None for p in model.parameters())

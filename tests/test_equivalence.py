"""DFS training equals one-sequence-at-a-time training: log-probs, loss, every gradient and
one AdamW update. float64 on a truly float64 model: <= 1e-10; float32: <= 1e-4."""
import numpy as np
import pytest
import torch

from dta.batch import Batch
from dta.losses import NLL, PPO
from dta.model.models import build_model, make_truly_float64
from dta.tree import PrefixTree
from dta.verify import verify
from tests.cases import SEQUENCE_LOSS, hard_batch, hard_sequences

FAMILIES = ["llama", "qwen2", "qwen3"]
LOSSES = {
    "nll": NLL(),
    "ppo-dual-clip": PPO(eps_clip=0.2, dual_clip=3.0),
    "ppo-decoupled": PPO(eps_clip=0.2, eps_clip_high=0.28, decoupled=True, behav_imp_weight_cap=5.0),
    "sequence-loss": SEQUENCE_LOSS,
}


@pytest.fixture(scope="module", params=FAMILIES)
def f64(request):
    model = build_model(request.param, "tiny", dtype="float64", seed=0)
    make_truly_float64(model)
    return model, hard_batch(model)


def test_hard_batch_covers_every_case():
    seqs = hard_sequences()
    tree = PrefixTree(seqs)
    stats = tree.stats()
    assert stats.depth >= 6
    assert len(tree.children[0]) == 3  # three unrelated trees
    assert any(len(e) >= 3 for e in tree.ending)  # triplicated sequence
    internal_ending = [u for u in range(1, len(tree)) if len(tree.ending[u]) and tree.children[u]]
    assert internal_ending  # a sequence that is a strict prefix of others
    assert any(tree.length(u) == 1 and not tree.children[u] for u in range(1, len(tree)))
    assert len(set(map(len, seqs))) > 5  # unequal lengths


@pytest.mark.parametrize("policy", ["retain", "recompute"])
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean", "sum"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_float64_equivalence(f64, loss, reduction, policy):
    model, batch = f64
    report = verify(model, batch, LOSSES[loss], reduction=reduction, policy=policy,
                    logits_chunk=7)  # a small chunk: many chunks per node, fork rows split
    assert report.truly_float64
    assert report.logprobs_rel_err <= 1e-10
    assert report.loss_rel_err <= 1e-10, (report.loss_dfs, report.loss_ref)
    assert report.grad_rel_err <= 1e-10
    assert report.update_rel_err <= 1e-10


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_float32_equivalence(family, policy):
    model = build_model(family, "tiny", dtype="float32", seed=1)
    batch = hard_batch(model)
    for loss in (LOSSES["nll"], LOSSES["ppo-decoupled"]):
        report = verify(model, batch, loss, policy=policy)
        # not update_rel_err: see dta/verify.py (Adam's first step is ~lr*sign(g));
        # params after the step with AdamW eps 1e-5, the verify() default outside float64
        assert report.adam_eps == 1e-5
        for err in ("logprobs", "loss", "grad", "params"):
            assert getattr(report, f"{err}_rel_err") <= 1e-4, report


def test_ppo_batch_has_clipped_and_unclipped_tokens(f64):
    """Guards the PPO cases above against testing only the flat (clipped) region."""
    model, batch = f64
    from dta.train import forward_logprobs

    lp = forward_logprobs(model, batch).logprobs
    ratios = np.concatenate([np.exp(l.numpy() - o)[m > 0] for l, o, m in zip(
        lp, batch.fields["old_logprobs"], batch.fields["loss_mask"])])
    assert (np.abs(ratios - 1) < 0.2).any() and (np.abs(ratios - 1) > 0.2).any()


def test_padded_input_equals_unpadded(f64):
    model, batch = f64
    S = int(batch.lengths.max()) + 3
    ids = np.zeros((len(batch), S), np.int64)
    att = np.zeros_like(ids)
    fields = {k: np.full((len(batch), S), 7.0) for k in ("loss_mask", "advantages", "old_logprobs")}
    for i, s in enumerate(batch.input_ids):
        ids[i, :len(s)], att[i, :len(s)] = s, 1
        ids[i, len(s):] = 1  # padding token ids: must be cut, not trained
        for k in fields:
            fields[k][i, :len(s)] = batch.fields[k][i]
    padded = Batch.from_padded(torch.as_tensor(ids), torch.as_tensor(att), **fields)
    assert [len(s) for s in padded.input_ids] == list(batch.lengths)
    report = verify(model, padded, LOSSES["ppo-dual-clip"])
    assert report.max_rel_err() <= 1e-10
    unpadded = verify(model, batch, LOSSES["ppo-dual-clip"])
    assert report.loss_dfs == pytest.approx(unpadded.loss_dfs, rel=1e-12)


def test_shared_trainable_tokens_keep_their_own_advantages(f64):
    """Two identical sequences with opposite advantages: their PPO gradients cancel exactly
    only if each occurrence keeps its own advantage (averaging first would not)."""
    model, _ = f64
    s = np.arange(3, 30)
    recs = [dict(input_ids=s, loss_mask=np.r_[0, np.ones(26)], advantages=np.full(27, a),
                 old_logprobs=np.full(27, -6.0)) for a in (1.0, -1.0, 0.5)]
    report = verify(model, Batch.from_records(recs), PPO(eps_clip=0.2))
    assert report.max_rel_err() <= 1e-10


@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_tied_embeddings_and_temperature(policy):
    """The head and the embedding share one weight: both deferred gradients land in it."""
    model = build_model("qwen3", "tiny", dtype="float64", seed=3, tie_word_embeddings=True)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    batch = hard_batch(model)
    for loss in (LOSSES["ppo-decoupled"], SEQUENCE_LOSS):
        report = verify(model, batch, loss, policy=policy, temperature=0.7, logits_chunk=5)
        assert report.max_rel_err() <= 1e-10, report

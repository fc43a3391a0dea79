"""Batches that exercise every structural case of the prefix tree (shared by several tests)."""
from __future__ import annotations

import numpy as np
import torch

from dta.batch import Batch
from dta.losses import SequenceLoss

EOS = 2


def hard_sequences(vocab: int = 512, seed: int = 0) -> list[np.ndarray]:
    """Forks, a chain of depth >= 7, single-token branches, a strict prefix, duplicates,
    EOS endings, unequal lengths and three unrelated trees."""
    rng = np.random.default_rng(seed)

    def tok(n):
        return rng.integers(3, vocab, int(n))

    root = tok(12)
    chain, seqs = [root], []
    for _ in range(7):  # each level: the chain goes on, and a sibling forks off it
        chain.append(np.concatenate([chain[-1], tok(rng.integers(1, 4))]))
        seqs.append(np.concatenate([chain[-2], tok(rng.integers(1, 5)), [EOS]]))
    seqs.append(np.concatenate([chain[-1], tok(3), [EOS]]))
    seqs += [np.concatenate([root, [5]]), np.concatenate([root, [6]])]  # single-token branches
    seqs.append(chain[3].copy())  # a strict prefix of several others
    seqs += [seqs[0].copy(), seqs[0].copy()]  # duplicates
    other = tok(9)  # an unrelated tree
    seqs += [np.concatenate([other, tok(4)]), np.concatenate([other, tok(6), [EOS]])]
    seqs.append(tok(5))  # a lone sequence: a third tree
    return seqs


def make_records(seqs, *, prompt: int = 12, seed: int = 1, old_logprobs=None):
    """Loss mask 0 on the first `prompt` tokens (a masked prompt); trainable tokens may be
    shared between sequences, each occurrence with its own advantage and behaviour log-prob."""
    rng = np.random.default_rng(seed)
    recs = []
    for i, s in enumerate(seqs):
        mask = np.ones(len(s))
        mask[: min(prompt, len(s) - 1)] = 0
        mask[0] = 0
        old = (old_logprobs[i] if old_logprobs is not None else -rng.random(len(s)) * 3)
        old = np.minimum(old + rng.normal(0, 0.15, len(s)), 0.0)  # log-probs are <= 0
        recs.append(dict(input_ids=s, loss_mask=mask, advantages=rng.normal(size=len(s)),
                         old_logprobs=old,
                         prox_logprobs=np.minimum(old + rng.normal(0, 0.05, len(s)), 0.0)))
    return recs


def hard_batch(model=None, vocab: int = 512, seed: int = 0) -> Batch:
    """The hard batch; with a model, behaviour log-probs sit near the model's own, so PPO
    ratios straddle the clip range (clipped and unclipped tokens both present)."""
    seqs = hard_sequences(vocab, seed)
    old = None
    if model is not None:
        from dta.train import forward_logprobs

        old = [lp.double().numpy() for lp in forward_logprobs(model, Batch.from_records(
            [{"input_ids": s} for s in seqs])).logprobs]
    return Batch.from_records(make_records(seqs, old_logprobs=old))


def _gspo_like(logp, entropy, fields):
    """A sequence-level, non-decomposable loss: clipped sequence ratio + entropy bonus."""
    m = fields["loss_mask"]
    n = m.sum().clamp_min(1)
    log_ratio = ((logp - fields["old_logprobs"]) * m).sum() / n
    ratio = torch.exp(log_ratio)
    adv = (fields["advantages"] * m).sum() / n
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    return pg - 0.01 * (entropy * m).sum() / n


SEQUENCE_LOSS = SequenceLoss(_gspo_like, fields=("loss_mask", "old_logprobs", "advantages"))

"""Loss formulas and reductions against hand-computed values."""
import math

import numpy as np
import pytest
import torch

from dta.batch import Batch
from dta.losses import NLL, PPO, batch_totals, make_loss, sequence_weights, token_weights


def t(*x):
    return torch.tensor(x, dtype=torch.float64)


def test_ppo_clip_and_dual_clip():
    logp = t(math.log(1.5), math.log(0.5), math.log(1.5), math.log(10.0))
    f = {"advantages": t(1.0, 1.0, -1.0, -1.0), "old_logprobs": t(0, 0, 0, 0)}
    plain = PPO(eps_clip=0.2).values(logp, None, f)
    # A>0, r=1.5 -> clipped at 1.2: max(-1.5, -1.2) = -1.2; A>0, r=0.5: max(-.5, -.8) = -.5
    # A<0, r=1.5: max(1.5, 1.2) = 1.5; A<0, r=10: 10
    assert torch.allclose(plain, t(-1.2, -0.5, 1.5, 10.0))
    dual = PPO(eps_clip=0.2, dual_clip=3.0).values(logp, None, f)
    assert torch.allclose(dual, t(-1.2, -0.5, 1.5, 3.0))


def test_decoupled_ppo_and_cap():
    logp = t(math.log(1.1), math.log(1.1))
    f = {"advantages": t(1.0, 1.0), "old_logprobs": t(0.0, 0.0),
         "prox_logprobs": t(math.log(2.0), math.log(6.0))}
    v = PPO(eps_clip=0.2, decoupled=True, behav_imp_weight_cap=5.0).values(logp, None, f)
    # ratio vs the proximal policy 1.1/2 = 0.55: max(-0.55, -0.8) = -0.55; times the behaviour
    # weight exp(prox - old) = 2 -> -1.1. The second token's weight 6 is above the cap: dropped.
    assert torch.allclose(v, t(-1.1, 0.0))


def test_reductions():
    b = Batch.from_records([dict(input_ids=np.arange(5), loss_mask=[0, 1, 1, 0, 0]),
                            dict(input_ids=np.arange(4), loss_mask=[0, 1, 1, 1]),
                            dict(input_ids=np.arange(3), loss_mask=[0, 0, 0])])
    assert batch_totals(b).trainable_tokens == 5 and batch_totals(b).trainable_sequences == 2
    w = token_weights(b, "token_mean")
    assert np.allclose(w[0], [0, .2, .2, 0, 0]) and np.allclose(w[1], [0, .2, .2, .2])
    w = token_weights(b, "seq_mean")
    assert np.allclose(w[0], [0, .25, .25, 0, 0]) and np.allclose(w[1], [0, 1 / 6, 1 / 6, 1 / 6])
    assert not w[2].any()
    w = token_weights(b, "sum")
    assert np.allclose(w[1], [0, 1, 1, 1])
    assert np.allclose(sequence_weights(b, "token_mean"), [.4, .6, 0])
    with pytest.raises(ValueError, match="unknown reduction"):
        token_weights(b, "mean")


def test_registry():
    assert isinstance(make_loss("nll"), NLL)
    assert make_loss("ppo", eps_clip=0.3).eps_clip == 0.3
    with pytest.raises(ValueError, match="unknown loss 'foo'"):
        make_loss("foo")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        PPO(dual_clip=0.5)

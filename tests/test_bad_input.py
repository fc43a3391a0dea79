"""Bad input raises a clear error naming the sequence and field, before any gradient or
parameter is touched."""
import numpy as np
import pytest
import torch

from dta.batch import Batch, BatchError
from dta.losses import NLL, PPO
from dta.model.models import build_model
from dta.train import DFSTrainer


@pytest.fixture(scope="module")
def model():
    return build_model("qwen3", "tiny", seed=0)


def good(n=10, **kw):
    rec = dict(input_ids=3 + np.arange(n) % 500, loss_mask=np.r_[0, np.ones(n - 1)],
               advantages=np.ones(n), old_logprobs=np.full(n, -5.0))
    rec.update(kw)
    return rec


CASES = {
    "empty sequence": ([good(), good(input_ids=np.zeros(0, np.int64), loss_mask=np.zeros(0),
                                   advantages=np.zeros(0), old_logprobs=np.zeros(0))],
                       r"sequence 1: field 'input_ids' is empty"),
    "token outside vocabulary": ([good(), good(input_ids=np.r_[3, 4, 512, 5, 6, 7, 8, 9, 10, 11])],
                                 r"sequence 1: 'input_ids' holds token id 512, outside the vocabulary \[0, 512\)"),
    "negative token id": ([good(input_ids=np.r_[3, -1, 5, 6, 7, 8, 9, 10, 11, 12])],
                          r"sequence 0: field 'input_ids' item 1 is -1, expected >= 0"),
    "too long": ([good(), good(n=4097)], r"sequence 1: length 4097 exceeds the model's maximum positions 4096"),
    "field of wrong length": ([good(), good(), good(advantages=np.ones(9))],
                              r"sequence 2: field 'advantages' has length 9, input_ids has 10"),
    "NaN advantage": ([good(advantages=np.r_[np.ones(4), np.nan, np.ones(5)])],
                      r"sequence 0: field 'advantages' item 4 is nan, expected a finite number"),
    "inf advantage": ([good(), good(advantages=np.r_[np.ones(7), np.inf, np.ones(2)])],
                      r"sequence 1: field 'advantages' item 7 is inf"),
    "inf old log-prob": ([good(old_logprobs=np.r_[-np.inf, -np.ones(9)])],
                         r"sequence 0: field 'old_logprobs' item 0 is -inf"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_rejected_before_any_gradient(model, case):
    records, message = CASES[case]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = DFSTrainer(model, opt, PPO())
    with pytest.raises(BatchError, match=message):
        trainer.step(Batch.from_records(records))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not opt.state


def test_missing_field_required_by_loss(model):
    recs = [dict(input_ids=np.arange(3, 13))]
    with pytest.raises(BatchError, match="field 'advantages' is required by the loss"):
        DFSTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), PPO()).step(
            Batch.from_records(recs))


def test_field_given_for_some_sequences_only():
    with pytest.raises(BatchError, match="sequence 1: field '(loss_mask|advantages)' is missing"):
        Batch.from_records([good(), dict(input_ids=np.arange(3, 9))])


def test_non_integer_ids():
    with pytest.raises(BatchError, match="sequence 0: field 'input_ids' item 0 is 1.5, expected an int"):
        Batch.from_records([dict(input_ids=np.array([1.5, 2.0]))])


def test_left_padding_is_rejected():
    ids = torch.tensor([[0, 5, 6], [5, 6, 7]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with pytest.raises(ValueError, match="sequence 0: attention_mask is not right-padded"):
        Batch.from_padded(ids, mask)


def test_empty_batch(model):
    with pytest.raises(BatchError, match="no sequences"):
        DFSTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), NLL()).step(Batch([]))

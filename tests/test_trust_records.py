"""Records are checked up front: each bad field is named with its file, line and field (or
sequence, for the Python API) before any gradient or parameter is touched; SFT conventions
(token 0 never a target, a batch with nothing to train) are explicit."""
import warnings

import numpy as np
import pytest
import torch

from dta.batch import Batch, BatchError
from dta.losses import NLL, PPO
from dta.model.models import build_model
from dta.records.jsonl import JsonlError, read_jsonl
from dta.train import DFSTrainer, NoTrainedTokenWarning

GOOD = '{"input_ids": [3, 4, 5, 6], "loss_mask": [0, 0, 1, 1], "advantages": 1.0, "logprobs": [0, 0, -1.5, -0.2]}'

# (bad line 3, the field the message must name, a fragment of the message)
BAD_LINES = {
    "unknown field": ('{"input_ids": [3, 4], "response_mask": [0, 1]}', "response_mask",
                      "unknown field 'response_mask'"),
    "labels": ('{"input_ids": [3, 4], "labels": [3, 4]}', "labels", "the fields of a record are"),
    "typo'd loss_mask": ('{"input_ids": [3, 4], "loss_mask ": [0, 1]}', "loss_mask",
                         "did you mean 'loss_mask'"),
    "both log-prob names": ('{"input_ids": [3, 4], "logprobs": [0, -1], "old_logprobs": [0, -1]}',
                            "old_logprobs", "are the same field"),
    "mask -1": ('{"input_ids": [3, 4], "loss_mask": [0, -1]}', "loss_mask", "item 1 is -1, expected 0 or 1"),
    "mask 2": ('{"input_ids": [3, 4], "loss_mask": [0, 2]}', "loss_mask", "item 1 is 2"),
    "mask 0.5": ('{"input_ids": [3, 4], "loss_mask": [0, 0.5]}', "loss_mask", "item 1 is 0.5"),
    "positive log-prob": ('{"input_ids": [3, 4], "logprobs": [0, 0.7]}', "logprobs",
                          "a log-prob is <= 0"),
    "NaN advantage": ('{"input_ids": [3, 4], "advantages": [0, NaN]}', "advantages", "finite"),
    "inf log-prob": ('{"input_ids": [3, 4], "logprobs": [0, -Infinity]}', "logprobs", "finite"),
    "non-numeric": ('{"input_ids": [3, 4], "advantages": [0, "x"]}', "advantages", "item 1 is 'x'"),
    "id 2**63": ('{"input_ids": [3, 9223372036854775808]}', "input_ids",
                 "item 1 is 9223372036854775808, beyond int64"),
    "id outside vocab": ('{"input_ids": [3, 512]}', "input_ids", "outside the model's vocabulary [0, 512)"),
    "negative weight": ('{"input_ids": [3, 4], "weight": -1}', "weight", "expected >= 0"),
    "reward not a number": ('{"input_ids": [3, 4], "reward": "good"}', "reward", "one finite number"),
}


@pytest.fixture(scope="module")
def model():
    return build_model("qwen3", "tiny", seed=0)


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_bad_jsonl_field_named_with_file_line_and_field(tmp_path, model, case):
    line, field, fragment = BAD_LINES[case]
    path = tmp_path / "rollouts.jsonl"
    path.write_text(GOOD + "\n\n" + line + "\n" + GOOD + "\n")
    with pytest.raises(JsonlError) as info:
        read_jsonl(path, vocab_size=model.config.vocab_size)
    msg = str(info.value)
    assert msg.startswith(f"{path} line 3: ") and f"'{field}" in msg and fragment in msg, msg
    assert "\n" not in msg


def test_bad_utf8_names_the_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"input_ids": [3], "task": "\xff"}\n')
    with pytest.raises(JsonlError, match=r"r.jsonl line 2: not UTF-8"):
        read_jsonl(path)


API_CASES = {
    "unknown field": (dict(response_mask=np.ones(6)), "unknown field 'response_mask'"),
    "mask -1": (dict(loss_mask=np.r_[0, 1, 1, -1, 1, 1]), "field 'loss_mask' item 3 is -1"),
    "mask 2": (dict(loss_mask=np.r_[0, 1, 1, 2, 1, 1]), "field 'loss_mask' item 3 is 2"),
    "mask 0.5": (dict(loss_mask=np.r_[0, 1, 1, 0.5, 1, 1]), "field 'loss_mask' item 3 is 0.5"),
    "positive old log-prob": (dict(old_logprobs=np.full(6, 0.3)), "field 'old_logprobs' item 0 is 0.3"),
    "two names": (dict(logprobs=-np.ones(6)), "'logprobs' and 'old_logprobs' are the same field"),
    "id outside vocab": (dict(input_ids=np.r_[3, 4, 5, 6, 7, 999]), "item 5 is 999, outside"),
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_bad_api_record_touches_no_parameter(model, case):
    change, fragment = API_CASES[case]
    good = dict(input_ids=np.arange(3, 9), loss_mask=np.r_[0, 0, 1, 1, 1, 1],
                advantages=np.ones(6), old_logprobs=-np.ones(6))
    bad = {**good, **change}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = DFSTrainer(model, opt, PPO())
    with pytest.raises(BatchError) as info:
        batch = Batch.from_records([good, bad], vocab_size=model.config.vocab_size)
        trainer.step(batch)
    assert str(info.value).startswith("sequence 1: ") and fragment in str(info.value)
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_hand_built_batch_is_checked_too(model):
    batch = Batch([np.arange(3, 9)], {"loss_mask": [np.r_[0, 1, 1, 2, 1, 1.0]]})
    with pytest.raises(BatchError, match=r"sequence 0: field 'loss_mask' is 2.0 at token 3"):
        DFSTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), NLL()).step(batch)
    batch = Batch([np.arange(3, 9)], {"loss_mask": [np.ones(6)], "advantages": [np.ones(6)],
                                      "old_logprobs": [np.full(6, 0.5)]})
    with pytest.raises(BatchError, match="'old_logprobs' is 0.5 at token 0, but a log-prob is <= 0"):
        DFSTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), PPO()).step(batch)


def test_errors_name_the_source_line(model):
    recs = [dict(input_ids=np.arange(3, 9)), dict(input_ids=np.arange(3, 5000) % 500)]
    batch = Batch.from_records(recs, sources=["a.jsonl line 1", "a.jsonl line 2"])
    with pytest.raises(BatchError, match=r"sequence 1 \(a.jsonl line 2\): length 4997 exceeds"):
        DFSTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), NLL()).step(batch)


# -------------------------------------------------------- SFT conventions (issue 9, item 7) --
def _grads_after_step(model, records, reduction="token_mean"):
    m = build_model("qwen3", "tiny", seed=0)
    m.load_state_dict(model.state_dict())
    DFSTrainer(m, torch.optim.SGD(m.parameters(), lr=0.0), NLL(), reduction=reduction).step(
        Batch.from_records(records))
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_all_ones_mask_means_every_predictable_token(model):
    ids = [np.arange(3, 11), np.r_[3, 4, 5, 20, 21]]
    ones = _grads_after_step(model, [dict(input_ids=s, loss_mask=np.ones(len(s))) for s in ids])
    shifted = _grads_after_step(model, [dict(input_ids=s, loss_mask=np.r_[0, np.ones(len(s) - 1)])
                                        for s in ids])
    absent = _grads_after_step(model, [dict(input_ids=s) for s in ids])
    assert ones.keys() == shifted.keys() == absent.keys() and ones
    for n in ones:
        assert torch.equal(ones[n], shifted[n]) and torch.equal(ones[n], absent[n]), n


def test_seq_mean_divides_by_sequences_with_a_trained_token(model):
    """seq_mean = sum over sequences with >= 1 trained token of (their token mean) / their
    count: a sequence without any trained token neither adds a term nor counts."""
    a, b = np.arange(3, 11), np.r_[3, 4, 5, 20, 21]
    a, b = dict(input_ids=a, loss_mask=np.ones(len(a))), dict(input_ids=b, loss_mask=np.ones(len(b)))
    ab = _grads_after_step(model, [a, b], "seq_mean")
    with_empty = _grads_after_step(model, [a, b,
                                           dict(input_ids=np.arange(3, 9), loss_mask=np.zeros(6))],
                                   "seq_mean")
    for n in ab:  # float32 rounding only (token_mean differs from seq_mean by ~20 %)
        assert float((ab[n] - with_empty[n]).norm()) <= 1e-5 * float(ab[n].norm()), n


def test_batch_without_trained_token_changes_nothing(model):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    recs = [dict(input_ids=np.arange(3, 9), loss_mask=np.zeros(6)),
            dict(input_ids=np.arange(3, 6), loss_mask=np.r_[1, 0, 0])]  # token 0's flag: ignored
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = DFSTrainer(model, opt, NLL()).step(Batch.from_records(recs))
    assert res.updated is False
    assert any(issubclass(w.category, NoTrainedTokenWarning) and "no trained token" in str(w.message)
               for w in caught)
    assert not opt.state and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())

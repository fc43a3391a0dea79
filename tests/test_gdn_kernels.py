"""Gated DeltaNet kernels by device (dta.model.gdn_kernels): which kernel a device gets, the
pack path through a segment kernel (flash-linear-attention's varlen contract; on CPU
transformers' own chunked delta rule stands in) trains float64 exactly, and the self-check
refuses a kernel that disagrees with the pure-torch path."""
from __future__ import annotations

import pytest
import torch

from dta.model import attention_kernels as ak
from dta.model.attention_standins import stand_in
from dta.model import gdn_kernels as gk
from dta.model.models import build_model, make_truly_float64
from dta.reference import unpacked_gradients
from dta.selfcheck import SelfCheckError, self_check
from dta.train import accumulate_gradients
from tests.test_attention_kernels import _grads, _worst
from tests.test_families import LOSS, family_batch


def test_kernel_selection_by_device():
    cpu = torch.zeros(1)
    assert gk.segment_kernel(cpu) is None  # CPU: the pure-torch pack path
    with stand_in("cuda"):  # CPU tensors take the CUDA row
        fla = gk.KERNELS["cuda"][0]
        assert fla.name == "fla"
        assert gk.segment_kernel(cpu) is (fla if fla.available() else None)
        with gk.stand_in():
            assert gk.segment_kernel(cpu).name == "stand-in"
    assert gk.segment_kernel(cpu) is None and gk.KERNELS["cuda"][0].name == "fla"


def test_walk_through_a_segment_kernel_float64():
    """qwen3_5 with its GDN layers on the segment kernel (level by level of each pack's
    segment tree, one varlen call per level) and the attention on the CUDA rows: loss,
    log-probs and every gradient <= 1e-10 of per-sequence training (policy recompute: its
    forwards and re-forwards both run the kernel); the self-check's kernel comparison passes."""
    model = build_model("qwen3_5", "tiny", dtype="float64", seed=0, matrix=True)
    make_truly_float64(model)
    batch = family_batch(model)
    model.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model, batch, LOSS)
    g_ref = _grads(model)
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return gk.hf_loop_op(*a, **k)

    with stand_in("cuda"), gk.stand_in(counted):
        report = self_check(model)
        assert any("GDN kernel" in k for k in report.errors) and report.passed, report.errors
        for policy in ("recompute",):
            model.zero_grad(set_to_none=True)
            res = accumulate_gradients(model, batch, LOSS, policy=policy, packing="subtrees",
                                       pack_tokens=20, record=True, self_check=False)
            assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss), policy
            lp = max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs))
            assert lp <= 1e-10 and _worst(_grads(model), g_ref) <= 1e-10, policy
    assert len(calls) > 0


def test_self_check_refuses_a_wrong_kernel():
    model = build_model("qwen3_5", "tiny", dtype="float32", seed=0, matrix=True)

    def wrong(*a, **k):  # a kernel that loses 2 % of every output
        out, final = gk.hf_loop_op(*a, **k)
        return out * 0.98, final

    with stand_in("cuda"), gk.stand_in(wrong):
        with pytest.raises(SelfCheckError, match="GDN kernel stand-in"):
            self_check(model, raise_on_failure=True)
    assert self_check(model).passed  # CPU: no kernel to compare, the rest passes

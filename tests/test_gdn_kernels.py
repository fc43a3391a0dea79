"""Gated DeltaNet kernels by device (dta.model.gdn_kernels): which kernels a device gets, the
pack path through the segment kernels (flash-linear-attention's varlen contracts; on CPU
transformers' own chunked delta rule and torch's depthwise conv1d stand in) trains float64
exactly, and the self-check refuses a delta-rule or conv kernel that disagrees with the
pure-torch path."""
from __future__ import annotations

import pytest
import torch

from dta.model import gdn_kernels as gk
from dta.model.models import build_model, make_truly_float64
from dta.reference import unpacked_gradients
from dta.selfcheck import SelfCheckError, self_check
from dta.train import accumulate_gradients
from tests.standins import gdn_stand_in, hf_loop_op, loop_conv_op, stand_in
from tests.test_attention_kernels import _grads, _worst
from tests.test_families import LOSS, family_batch


def test_kernel_selection_by_device():
    cpu = torch.zeros(1)
    assert gk.segment_kernel(cpu) is None  # CPU: the pure-torch pack path
    with stand_in("cuda"):  # CPU tensors take the CUDA row
        fla = gk.KERNELS["cuda"][0]
        assert fla.name == "fla"
        assert gk.segment_kernel(cpu) is (fla if fla.available() else None)
        with gdn_stand_in():
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
    calls, conv_calls = [], []

    def counted(*a, **k):
        calls.append(1)
        return hf_loop_op(*a, **k)

    def counted_conv(*a, **k):
        conv_calls.append(len(k["cu_seqlens"]) - 1)
        return loop_conv_op(*a, **k)

    with stand_in("cuda"), gdn_stand_in(counted, conv=counted_conv):
        report = self_check(model)
        assert any("GDN kernel" in k for k in report.errors) and report.passed, report.errors
        for policy in ("recompute",):
            model.zero_grad(set_to_none=True)
            res = accumulate_gradients(model, batch, LOSS, policy=policy, packing="subtrees",
                                       pack_tokens=20, record=True, self_check=False)
            assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss), policy
            lp = max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs))
            assert lp <= 1e-10 and _worst(_grads(model), g_ref) <= 1e-10, policy
    assert len(calls) > 0 and len(conv_calls) > 0
    assert max(conv_calls) > 1  # some pack had branches: several segments in one conv call


def test_self_check_refuses_a_wrong_kernel():
    model = build_model("qwen3_5", "tiny", dtype="float32", seed=0, matrix=True)

    def wrong(*a, **k):  # a kernel that loses 2 % of every output
        out, final = hf_loop_op(*a, **k)
        return out * 0.98, final

    with stand_in("cuda"), gdn_stand_in(wrong):
        with pytest.raises(SelfCheckError, match="GDN kernel stand-in"):
            self_check(model, raise_on_failure=True)
    assert self_check(model).passed  # CPU: no kernel to compare, the rest passes


def test_self_check_refuses_a_wrong_conv_kernel():
    """A conv kernel that ignores the initial state (every segment restarts from zeros: the
    classic mistake of a kernel that slides along one sequence) is named and refused."""
    model = build_model("qwen3_5", "tiny", dtype="float32", seed=0, matrix=True)

    def stateless(x, weight, bias=None, initial_state=None, **k):
        return loop_conv_op(x, weight, bias, torch.zeros_like(initial_state), **k)

    with stand_in("cuda"), gdn_stand_in(conv=stateless):
        with pytest.raises(SelfCheckError, match="GDN kernel stand-in"):
            self_check(model, raise_on_failure=True)


def _random_layout(rng, nodes: int):
    """A pack of ``nodes`` local nodes in pre-order with random parents and lengths 1..6 (many
    segments shorter than the conv width), every node handing its state on."""
    from types import SimpleNamespace

    import numpy as np

    par = [-1] + [int(rng.integers(0, i)) for i in range(1, nodes)]
    kids = [[] for _ in range(nodes)]
    for i in range(1, nodes):
        kids[par[i]].append(i)
    order, enter, exit_ = [], {}, {}

    def visit(u):
        enter[u] = len(order)
        order.append(u)
        for c in kids[u]:
            visit(c)
        exit_[u] = len(order)

    visit(0)
    lengths = rng.integers(1, 7, nodes)
    off = np.r_[0, np.cumsum(lengths)]
    return SimpleNamespace(tokens=int(off[-1]), tree_nodes=np.arange(nodes), offsets=off,
                           enter=np.array([enter[u] for u in order]),
                           exit=np.array([exit_[u] for u in order]), open=np.arange(nodes))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conv_kernel_equals_the_gather_float64(seed):
    """One varlen conv call over a pack's segments equals the pure-torch gather, forward and
    the gradients of the inputs, the initial conv state, the weight and the bias (float64)."""
    import numpy as np

    from dta.model.gdn import conv_source, plan_recurrence, tree_conv

    rng = np.random.default_rng(seed)
    lay = _random_layout(rng, 9)
    K, D = 4, 6
    plan = plan_recurrence(lay, K)
    ix = plan.tensors(torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
              for s in ((lay.tokens, D), (1, D, K), (D, K), (D,))]
    results = []
    kernel = gk.SegmentKernel("stand-in", hf_loop_op, conv=loop_conv_op)
    for use_kernel in (False, True):
        src = conv_source(leaves[0], leaves[1], K)
        args = (src, leaves[2], leaves[3], plan, ix)
        y = gk.kernel_conv(kernel, *args) if use_kernel else tree_conv(*args)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype)
                                     .view_as(y)).sum(), leaves)
        results.append((y.detach(), *grads))
    assert len(plan.segments) > 1
    for a, b in zip(*results):
        assert float((a - b).abs().max()) <= 1e-12 * float(b.abs().max())

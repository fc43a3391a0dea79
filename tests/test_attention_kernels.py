"""The split attention's kernel table (dta.model.attention_kernels) and its CUDA rows, run on CPU
with CPU ops standing in for the CUDA ops (``stand_in``: the same code path up to the op
call): the walk through the CUDA rows trains float64 to <= 1e-10 of one-sequence-at-a-time
training, and builds no dense mask over the cached path; FlexAttention's forward over pack
block masks runs here (compiled), equal to SDPA."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from dta.model import attention_kernels as ak
from dta.model.models import build_model, make_truly_float64
from dta.model.packmask import DENSE_PATH_MASKS
from dta.model.split_attention import Split, split_attention
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients
from dta.verify import ZERO_FLOOR, _rel, _whole_norm, worst
from tests.standins import stand_in
from tests.test_families import LOSS, WINDOWED, family_batch

F = torch.nn.functional


def _grads(model):
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}


def _worst(got, ref):
    floor = ZERO_FLOOR * _whole_norm(ref.values())
    return worst(_rel(got[n], g, floor) for n, g in ref.items())


def test_the_table_has_one_row_per_device_dtype_and_kind():
    for dt in ak.CPU_DTYPES:
        for kind in ak.KINDS:
            assert ak.kernel_for("cpu", dt, kind).name == "cpu_flash"
    assert ak.kernel_for("cuda", torch.float32, "causal").name == "cuda_efficient"
    assert ak.kernel_for("cuda", torch.bfloat16, "tree").name == "flex"
    assert ak.kernel_for("cuda", torch.bfloat16, "none", "torch").name == "cuda_flash"
    assert ak.kernel_for("cuda", torch.float64, "none") is None  # no row: one masked call
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        ak.kernel_for("cpu", torch.float32, "none", "fast")


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cuda_rows_split_equals_one_masked_call(tree, backend):
    """flash-attn's / torch's CUDA ops (stand-ins) for the cached and causal pieces, the
    FlexAttention kernel's re-forward backward for the tree piece: output and every gradient
    of the split equal one masked SDPA call (float64), grouped-query heads included."""
    torch.manual_seed(3)
    T, P, H, KV, D = 9, 14, 6, 2, 8
    q = torch.randn(1, T, H, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(1, KV, P + T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, KV, P + T, D, dtype=torch.float64, requires_grad=True)
    own = torch.ones(T, T, dtype=torch.bool).tril()
    if tree:
        own &= (torch.rand(T, T) < 0.5) | torch.eye(T, dtype=torch.bool)
    mask = torch.cat([torch.ones(T, P, dtype=torch.bool), own], 1)[None, None]
    g = torch.randn(1, H, T, D, dtype=torch.float64)
    res = []
    with stand_in("cuda") as calls:
        for fn in (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3,
                                                          enable_gqa=True),
                   lambda: split_attention(q, k, v, Split(P, own if tree else None), 0.3,
                                           backend=backend)):
            q.grad = k.grad = v.grad = None
            o = fn()
            o.backward(g)
            res.append([o.detach(), q.grad, k.grad, v.grad])
    unmasked = "flash_attn" if backend == "auto" else "cuda_flash"
    assert calls[unmasked] > 0 and (calls["flex"] > 0) == tree
    for name, a, b in zip(("out", "dq", "dk", "dv"), *res):
        assert float((a - b).abs().max() / a.abs().max()) <= 1e-12, name


def _pieces_of_the_walk(family):
    model = build_model(family, "tiny", dtype="float64", seed=0, matrix=True)
    make_truly_float64(model)
    batch = family_batch(model)
    model.zero_grad(set_to_none=True)
    return model, batch, unpacked_gradients(model, batch, LOSS), _grads(model)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2", "qwen3_5"])
def test_walk_through_the_cuda_rows_float64(family):
    """The walk on the CUDA rows of the table (CPU stand-ins, float64 through the bf16 row's
    kernels): packs with branches, both memory policies, <= 1e-10 of per-sequence training;
    no dense mask over the cached path is built (a sliding window shorter than the path: a mask
    over the keys inside the window only) -- except Gemma 2, whose attention
    soft-capping runs eager attention: it falls back to the masked call and says so."""
    model, batch, ref, g_ref = _pieces_of_the_walk(family)
    DENSE_PATH_MASKS.clear()
    with stand_in("cuda") as calls, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for policy in ("retain", "recompute"):
            model.zero_grad(set_to_none=True)
            res = accumulate_gradients(model, batch, LOSS, policy=policy, packing="subtrees",
                                       pack_tokens=20, logits_chunk=7, record=True)
            case = (family, policy)
            assert res.walk.masked_packs > 0, case  # packs with branches
            assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss), case
            lp = max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs))
            assert lp <= 1e-10, case
            assert _worst(_grads(model), g_ref) <= 1e-10, case
    said = [str(w.message) for w in said]
    if family == "gemma2":  # eager: soft-capping has no split kernel
        assert DENSE_PATH_MASKS["cuda"] > 0 and sum(calls.values()) == 0
        assert any("soft-capping" in s and "dense" in s for s in said), said
    else:
        assert DENSE_PATH_MASKS["cuda"] == 0, dict(DENSE_PATH_MASKS)
        # a window of 8 on ~40-token paths: every pack over cached keys attends to the keys
        # inside its window in one masked call (no split); the others split
        assert family in WINDOWED or calls["flash_attn"] > 0 and calls["flex"] > 0, dict(calls)
        assert not any("dense" in s for s in said), said
    assert DENSE_PATH_MASKS["cpu"] == 0


def test_a_cpu_walk_builds_no_dense_path_mask_either():
    model, batch, ref, g_ref = _pieces_of_the_walk("qwen3")
    DENSE_PATH_MASKS.clear()
    accumulate_gradients(model, batch, LOSS, packing="subtrees", pack_tokens=20)
    assert sum(DENSE_PATH_MASKS.values()) == 0


def _layout():
    """A pack of 3 nodes (a root piece and two branches) over a 150-token prefix."""
    from types import SimpleNamespace

    a, b, c = 40, 30, 25
    node = np.r_[np.zeros(a), np.ones(b), np.full(c, 2)].astype(np.int64)
    pos = 150 + np.r_[np.arange(a), a + np.arange(b), a + np.arange(c)]
    return SimpleNamespace(tokens=a + b + c, prefix=150, positions=pos, node=node,
                           exit=np.array([3, 2, 3]), chain=False)


def test_flex_forward_over_pack_block_masks_equals_sdpa():
    """FlexAttention (compiled on CPU: forward only) over the pack's block mask -- the cached
    keys and a tree of three nodes -- equals SDPA with the dense mask (float32); and the flex
    tree kernel's forward (eager FlexAttention with its lse) over the pack's own keys equals
    the CPU kernel's. Its backward raises on CPU: it waits for a GPU (docs/gpu.md)."""
    from torch.nn.attention.flex_attention import flex_attention

    from dta.model.packmask import block_mask, dense_mask, own_mask

    torch.manual_seed(0)
    lay = _layout()
    T, S, H, D = lay.tokens, lay.prefix + lay.tokens, 4, 16
    q, k, v = torch.randn(1, H, T, D), torch.randn(1, H, S, D), torch.randn(1, H, S, D)
    window = 64  # the pack's sliding-window form: the tree rule and the window together
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(lay, "cpu", window))
    out = torch.compile(flex_attention, dynamic=False)(q, k, v,
                                                       block_mask=block_mask(lay, "cpu", window))
    assert float((out - ref).abs().max()) <= 1e-5
    own = own_mask(lay, "cpu")
    flex, cpu = ak.FlexTree("flex", ("tree",), ops=dict(fwd=ak._flex_op)), ak.kernel_for(
        "cpu", torch.float32, "tree")
    kq, vq = k[:, :, lay.prefix:], v[:, :, lay.prefix:]
    o1, l1 = flex.forward(q, kq, vq, flex.prepare(own, q.dtype), 0.25)
    o2, l2 = cpu.forward(q, kq, vq, cpu.prepare(own, q.dtype), 0.25)
    assert float((o1 - o2).abs().max()) <= 1e-5 and float((l1 - l2).abs().max()) <= 1e-5
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        qg = q.clone().requires_grad_()
        flex.forward(qg, kq, vq, flex.prepare(own, q.dtype), 0.25)


def test_the_backend_is_a_walk_setting():
    """``attention_backend`` (dta.options.WalkOptions) picks the kernels of the walk: torch's own
    ops instead of flash-attn on the CUDA rows, the same gradients; a bad name is refused."""
    from dta.options import WalkOptionError, WalkOptions

    with pytest.raises(WalkOptionError, match="attention_backend"):
        WalkOptions(attention_backend="fast")
    model, batch, ref, g_ref = _pieces_of_the_walk("llama")
    with stand_in("cuda") as calls:
        model.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, batch, LOSS, packing="subtrees", pack_tokens=20,
                                   attention_backend="torch")
    assert calls["cuda_flash"] > 0 and calls["flash_attn"] == 0, dict(calls)
    assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss)
    assert _worst(_grads(model), g_ref) <= 1e-10
    assert ak.backend == "auto"  # the walk's setting does not outlive the walk

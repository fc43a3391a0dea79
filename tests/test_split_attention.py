"""Attention over cached keys split at the cache boundary (dta.model.split_attention): which masks
split, and the split's output and gradients against one masked SDPA call."""
from __future__ import annotations

import pytest
import torch

from dta.model.split_attention import split_attention, split_of

F = torch.nn.functional


def mask_of(T: int, P: int, own: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.ones(T, P, dtype=torch.bool), own], 1)[None, None]


def tree_own(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.ones(T, T, dtype=torch.bool).tril() & (
        (torch.rand(T, T, generator=g) < 0.5) | torch.eye(T, dtype=torch.bool))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
@pytest.mark.parametrize("T,P,chain,heads,kv", [(7, 11, False, 4, 2), (7, 11, True, 4, 2),
                                                (1, 5, True, 4, 4), (40, 90, False, 6, 2),
                                                (40, 90, True, 3, 3)])
def test_split_equals_one_masked_call(dtype, tol, T, P, chain, heads, kv):
    torch.manual_seed(T + P)
    D = 8
    # q as the attention layers pass it: a [B, T, H, D] tensor transposed (not contiguous)
    q = torch.randn(1, T, heads, D, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(1, kv, P + T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv, P + T, D, dtype=dtype, requires_grad=True)
    own = torch.ones(T, T, dtype=torch.bool).tril() if chain else tree_own(T, T)
    mask = mask_of(T, P, own)
    split = split_of(mask, dtype)
    assert split is not None and split.past == P and (split.inner is None) == chain
    g = torch.randn(1, heads, T, D, dtype=dtype)
    out = []
    for fn in (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.37,
                                                      enable_gqa=heads != kv),
               lambda: split_attention(q, k, v, split, 0.37)):
        q.grad = k.grad = v.grad = None
        o = fn()
        o.backward(g)
        out.append([o.detach(), q.grad, k.grad, v.grad])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *out):
        assert float((a - b).abs().max() / a.abs().max()) <= tol, name


def test_masks_that_do_not_split():
    T, P = 4, 6
    ok = mask_of(T, P, torch.ones(T, T, dtype=torch.bool).tril())
    assert split_of(ok, torch.float32) is not None
    window = ok.clone()
    window[0, 0, 3, 0] = False  # a cached key out of a sliding window
    no_self = mask_of(T, P, torch.ones(T, T, dtype=torch.bool).tril())
    no_self[0, 0, 2, P + 2] = False  # a row that does not see its own key
    no_past = ok[..., P:]  # no cached keys
    batched = ok.expand(2, 1, T, T + P)  # a mask per sequence
    for m in (window, no_self, no_past, batched):
        assert split_of(m, torch.float32) is None
    assert split_of(ok, torch.bfloat16) is not None  # every dtype: the kernel table decides


def test_pieces_are_saved_instead_of_the_joined_kv():
    """Given the pieces a joined K/V was concatenated from, the split attention saves those
    (the frames' K/V, alive anyway) instead of the joined copy, which is then freed after the
    forward: the same outputs and gradients, bitwise, as saving the joined tensors."""
    import gc
    import weakref

    torch.manual_seed(0)
    T, P, D, heads, kv = 6, 13, 8, 4, 2
    q = torch.randn(1, T, heads, D, dtype=torch.float64).transpose(1, 2).requires_grad_()
    kp = [torch.randn(1, kv, n, D, dtype=torch.float64, requires_grad=True) for n in (5, 8, T)]
    vp = [torch.randn(1, kv, n, D, dtype=torch.float64, requires_grad=True) for n in (5, 8, T)]
    split = split_of(mask_of(T, P, torch.ones(T, T, dtype=torch.bool).tril()), torch.float64)
    g = torch.randn(1, heads, T, D, dtype=torch.float64)
    results = []
    for with_pieces in (False, True):
        for t in (q, *kp, *vp):
            t.grad = None
        k, v = torch.cat(kp, dim=2), torch.cat(vp, dim=2)
        joined = weakref.ref(k)
        o = split_attention(q, k, v, split, 0.3, *((kp, vp) if with_pieces else (None, None)))
        del k, v
        gc.collect()
        assert (joined() is None) == with_pieces  # the graph holds the joined K only without
        o.backward(g)
        results.append([o.detach(), q.grad, *(t.grad for t in kp + vp)])
    for a, b in zip(*results):
        # per piece the backward sums dq in another order: equal to rounding
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    # pieces that do not make up the joined tensor are not used
    k, v = torch.cat(kp, dim=2), torch.cat(vp, dim=2)
    joined = weakref.ref(k)
    o = split_attention(q, k, v, split, 0.3, kp[:2], vp)
    del k, v
    gc.collect()
    assert joined() is not None


def test_walk_frees_each_forwards_joined_kv():
    """In a walk every forward over cached keys joins the path's K/V and registers its pieces
    for the split attention; each registration goes with its joined tensor."""
    import numpy as np

    import dta.model.attention as attention
    from dta.batch import Batch
    from dta.losses import NLL
    from dta.model.models import build_model
    from dta.train import accumulate_gradients

    model = build_model("qwen3", "tiny", dtype="float32", seed=0)
    seqs = [np.random.default_rng(s).integers(3, 500, 60) for s in range(2)]
    batch = Batch.from_records([{"input_ids": s, "loss_mask": np.ones(len(s))} for s in seqs])
    import gc
    import weakref

    made = []
    real = attention._remember_pieces
    attention._remember_pieces = lambda j, p: made.append(weakref.ref(j)) or real(j, p)
    try:
        accumulate_gradients(model, batch, NLL(), policy="recompute", block_tokens=16)
    finally:
        attention._remember_pieces = real
    gc.collect()
    assert made and all(j() is None for j in made)  # each joined K/V (and its pieces) freed


def test_recompute_takes_the_path_attention_back_from_the_tape():
    """Policy recompute: a pack's re-forward takes its attention over the path back from the
    tape its first forward kept, so the split attention is computed as often as under retain
    (every pack once), and the gradients are those of retain (float64)."""
    import numpy as np

    import dta.model.split_attention as sa
    from dta.batch import Batch
    from dta.losses import NLL
    from dta.model.models import build_model, make_truly_float64
    from dta.train import accumulate_gradients

    model = build_model("qwen3", "tiny", dtype="float64", seed=0)
    make_truly_float64(model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 40)
    seqs = [np.concatenate([prompt, rng.integers(3, 500, n)]) for n in (50, 23, 61)]
    batch = Batch.from_records([{"input_ids": s, "loss_mask": np.r_[np.zeros(40), np.ones(len(s) - 40)]}
                                for s in seqs])
    real, counts, grads = sa._attend, {}, {}
    for policy in ("retain", "recompute"):
        calls = []
        sa._attend = lambda *a: calls.append(1) or real(*a)
        try:
            model.zero_grad(set_to_none=True)
            walk = accumulate_gradients(model, batch, NLL(), policy=policy, block_tokens=16).walk
        finally:
            sa._attend = real
        counts[policy] = len(calls)
        grads[policy] = {n: p.grad.clone() for n, p in model.named_parameters()}
        if policy == "recompute":
            assert walk.recomputed_tokens > 0  # there were re-forwards to take back
    assert counts["retain"] > 0 and counts["recompute"] == counts["retain"]
    for n, g in grads["retain"].items():
        err = (grads["recompute"][n] - g).norm() / g.norm().clamp_min(1e-300)
        assert err <= 1e-12, (n, float(err))


def test_a_tape_refuses_a_re_forward_that_differs():
    q = torch.randn(1, 4, 3, 8)
    from dta.model.split_attention import Tape

    tape = Tape()
    tape.keep(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3), 5)
    tape.finish()  # the recording forward ends: the re-forward takes back
    with pytest.raises(RuntimeError, match="over 6 cached keys"):
        tape.take(q, 6)
    tape.take(q, 5)
    with pytest.raises(RuntimeError, match="more split attention calls"):
        tape.take(q, 5)
    tape = type(tape)()
    tape.keep(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3), 5)
    tape.finish()
    with pytest.raises(RuntimeError, match="made 0 split attention calls, the forward 1"):
        tape.finish()

"""The CUDA rows of the attention kernel table call torch's own CUDA SDPA ops exactly as the
installed torch declares them. No GPU here: the ops run on *meta* tensors, where torch checks
every argument against the op's schema and its meta kernel computes the outputs' shapes and
dtypes -- the same Python code path as on a GPU, down to the op call (the CPU stand-ins used
elsewhere replace the op call itself, so they cannot catch a wrong argument)."""
from __future__ import annotations

import pytest
import torch

from dta.model import attention_kernels as ak

B, H, KV, T, S, D = 2, 4, 2, 5, 7, 16  # grouped-query heads: these ops take equal heads


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "cuda_flash"), (torch.float16, "cuda_flash"),
                                        (torch.float32, "cuda_efficient")])
@pytest.mark.parametrize("kind", ["none", "causal"])
def test_cuda_sdpa_rows_match_the_op_schemas(dtype, name, kind):
    kernel = ak.kernel_for("cuda", dtype, kind, backend="torch")
    assert kernel is not None and kernel.name == name
    meta = dict(dtype=dtype, device="meta")
    q = torch.empty(B, H, T, D, **meta)
    k, v = torch.empty(B, KV, S, D, **meta), torch.empty(B, KV, S, D, **meta)
    mask = ak.CAUSAL if kind == "causal" else None
    out, lse = kernel.forward(q, k, v, mask, 0.25)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (B, H, T) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(torch.empty_like(out), q, k, v, out, lse, mask, 0.25)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert {dq.dtype, dk.dtype, dv.dtype} == {dtype}


def test_a_wrong_argument_is_caught_on_meta():
    """The meta run would catch a call that does not fit the schema (here: a wrong type)."""
    q = torch.empty(1, 2, 3, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises((RuntimeError, TypeError)):
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, "causal", False)

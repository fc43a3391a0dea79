"""The self-check of a device's GDN kernel: one layer over a small probe pack by the pure-torch
pack path (``dta.model.gdn``) and by the kernel (``dta.model.gdn_kernels``), compared. Apart
from both so that neither imports the other."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from dta.model import attention_kernels
from dta.model.gdn import pack_forward, plan_recurrence
from dta.model.gdn_kernels import SegmentKernel, row
from dta.model.hf_cache import PackStateLayer


def probe_layout(a: int = 9, b: int = 5, c: int = 7):
    """A pack of three local nodes -- a root piece and two branches below it -- every node
    handing its final state on (the integers :func:`dta.model.gdn.plan_recurrence` reads)."""
    T = a + b + c
    return SimpleNamespace(tokens=T, tree_nodes=np.arange(3), offsets=np.array([0, a, a + b, T]),
                           enter=np.array([0, 1, 2]), exit=np.array([3, 2, 3]),
                           open=np.arange(3))


def compare(module, kernel: SegmentKernel, seed: int = 0) -> float:
    """One GDN layer over :func:`probe_layout` from a random initial state, by the pure-torch
    path and by ``kernel``: the largest relative error of the output and the handed-on
    states (both in float64)."""
    p = next(module.parameters())
    g = torch.Generator(device="cpu").manual_seed(seed)
    lay = probe_layout()
    K = module.conv1d.weight.shape[-1]
    plan = plan_recurrence(lay, K)
    hidden = torch.randn(1, lay.tokens, module.out_proj.out_features, generator=g).to(p)
    conv = torch.randn(1, module.conv1d.weight.shape[0], K, generator=g).to(p)
    rec = (0.1 * torch.randn(1, module.num_v_heads, module.head_k_dim, module.head_v_dim,
                             generator=g)).to(p.device, torch.float32)
    results = []
    for use_kernel in (False, True):
        layer = PackStateLayer((conv, rec), plan)
        layer.kernels = use_kernel
        with torch.no_grad(), row(attention_kernels.device_type(hidden), [kernel] if use_kernel else []):
            out = pack_forward(module, hidden, layer)
        results.append((out, *layer.final))
    err = 0.0
    for a, b in zip(*results):
        a, b = a.double(), b.double()
        err = max(err, float((a - b).norm() / b.norm().clamp_min(1e-300)))
    return err

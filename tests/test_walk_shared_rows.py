"""Regression: with open packs (``packing=auto`` may merge a child's own head pack), a frame's
rows on the path through a node can be non-contiguous, read with ``index_select``; several
sibling packs hanging from that node must each get their own (a backward frees its saved
index): the τ²-airline "small" batch trains, under both policies, to the node-by-node walk's
gradient (float64, truly float64 model, <= 1e-10 relative)."""
from __future__ import annotations

import pytest
import torch

from dta.config.loss import loss_kwargs
from dta.config.schema import load_config
from dta.losses import make_loss
from dta.model.models import build_model, make_truly_float64
from dta.train import accumulate_gradients
from dta_cli.batches import BatchSource


def gradients(model, batch, loss, policy, packing):
    model.zero_grad(set_to_none=True)
    res = accumulate_gradients(model, batch, loss, policy=policy, packing=packing)
    return res, torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_open_packs_with_non_contiguous_path_rows_train_exactly(policy):
    cfg = load_config(None, ["workload.scale=small", "model.dtype=float64"])
    model = build_model("qwen3", "tiny", dtype="float64")
    make_truly_float64(model)
    batch = BatchSource(cfg, model.config.vocab_size).batch(0)
    loss = make_loss(cfg.loss.name, **loss_kwargs(cfg))
    res, packed = gradients(model, batch, loss, policy, "auto")
    _, node = gradients(model, batch, loss, policy, "node")
    assert res.walk.packs < res.walk.nodes  # packs of several nodes
    err = float((packed - node).norm() / node.norm())
    assert err <= 1e-10, f"{policy}: auto vs node relative error {err:.3g}"

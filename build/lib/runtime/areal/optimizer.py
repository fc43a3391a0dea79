"""AReaL's optimizer and LR scheduler, built from its ``OptimizerConfig`` as ``FSDPEngine``
builds them. The engine core steps the optimizer (``runtime.engine``: the one reduction, the
clip, the step or the skip, over what its sharding mode steps -- the fp32 masters under bf16
compute); the LR scheduler is AReaL's, stepping the core's optimizer."""
from __future__ import annotations

import torch

__all__ = ["build_optimizer", "build_lr_scheduler", "optimizer_factory"]


def optimizer_factory(oc):
    """``params -> optimizer`` for the engine core (AdamW one tensor at a time where FSDP2's
    DTensor shards sit beside plain tensors: they cannot share a fused or foreach call)."""

    def make(params):
        params = list(params)
        mixed = len({hasattr(p, "device_mesh") for p in params}) > 1
        return build_optimizer(params, oc, multi_tensor=not mixed)

    return make


def build_optimizer(params, oc, *, multi_tensor: bool = True) -> torch.optim.Optimizer:
    """``adam`` (fused AdamW where the device has it), ``adam_bf16`` (AReaL's
    AnyPrecisionAdamW) or ``sgd``, with the config's hyper-parameters. ``multi_tensor=False``:
    AdamW one tensor at a time (FSDP2's DTensor shards beside plain flat shards cannot share
    a fused or foreach kernel call)."""
    if oc.type == "adam":
        kw = dict(lr=oc.lr, weight_decay=oc.weight_decay, betas=(oc.beta1, oc.beta2), eps=oc.eps)
        if not multi_tensor:
            return torch.optim.AdamW(params, foreach=False, **kw)
        try:
            return torch.optim.AdamW(params, fused=True, **kw)
        except (RuntimeError, ValueError):  # a device/dtype without the fused kernel
            return torch.optim.AdamW(params, **kw)
    if oc.type == "adam_bf16":
        from areal.engine.fsdp_utils.optimizer import AnyPrecisionAdamW

        return AnyPrecisionAdamW(params, lr=oc.lr, weight_decay=oc.weight_decay,
                                 betas=(oc.beta1, oc.beta2), eps=oc.eps,
                                 momentum_dtype="bfloat16", variance_dtype="bfloat16")
    if oc.type == "sgd":
        return torch.optim.SGD(params, lr=oc.lr, weight_decay=oc.weight_decay)
    raise ValueError(f"unknown optimizer type {oc.type!r}; choose adam, adam_bf16 or sgd")


def build_lr_scheduler(optimizer, oc, ft_spec):
    """AReaL's ``cosine`` / ``linear`` / ``constant`` schedules with warmup, over
    ``ft_spec.total_train_steps``."""
    if ft_spec is None:
        raise ValueError("initialize() needs a FinetuneSpec (its total_train_steps drives "
                         "the LR scheduler), as FSDPEngine does")
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    total = ft_spec.total_train_steps
    warmup = int(oc.warmup_steps_proportion * total)
    if oc.lr_scheduler_type == "cosine":
        from areal.engine.fsdp_utils import get_cosine_schedule_with_warmup

        return get_cosine_schedule_with_warmup(optimizer, warmup, total,
                                               min_lr_ratio=oc.min_lr_ratio)
    if oc.lr_scheduler_type == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total)
    if oc.lr_scheduler_type == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    raise ValueError(f"unknown lr scheduler type {oc.lr_scheduler_type!r}")

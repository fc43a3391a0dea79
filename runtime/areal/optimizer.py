"""The optimizer side of ``DTATrainEngine``: AReaL's optimizer and LR scheduler, built from
its ``OptimizerConfig`` as ``FSDPEngine`` builds them, and the step with fp32 master weights.

When ``optimizer_dtype`` differs from the compute ``dtype`` (AReaL's default: bf16 compute,
fp32 master weights, like FSDP2's ``MixedPrecisionPolicy``), :class:`MasterWeights` keeps
float32 copies of the trainable parameters: the optimizer and the clip work on them, and the
model holds their cast.
"""
from __future__ import annotations

import torch

from dta.train import clip_and_step

__all__ = ["build_optimizer", "build_lr_scheduler", "MasterWeights"]


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


class _Params:
    """What ``dta.train.clip_and_step`` needs of a model: ``parameters()``."""

    def __init__(self, params):
        self.params = list(params)

    def parameters(self):
        return iter(self.params)


class MasterWeights:
    """Float32 (``storage`` dtype) copies of the model's trainable parameters."""

    def __init__(self, params, storage: torch.dtype):
        self.params = list(params)
        self.master = [torch.nn.Parameter(p.detach().to(storage).clone()) for p in self.params]

    def grads_to_master(self) -> None:
        for m, p in zip(self.master, self.params):
            m.grad = None if p.grad is None else p.grad.detach().to(m.dtype)

    @torch.no_grad()
    def master_grads_to_model(self) -> None:
        """The masters' (clipped) gradients back into the model parameters' ``.grad``, so a
        caller reading ``param.grad`` after the step sees the gradients the optimizer used, as
        with FSDPEngine (whose parameters' gradients are clipped in place)."""
        for m, p in zip(self.master, self.params):
            if m.grad is not None:
                p.grad = m.grad.to(p.dtype)

    @torch.no_grad()
    def master_to_model(self) -> None:
        for m, p in zip(self.master, self.params):
            p.copy_(m)

    @torch.no_grad()
    def model_to_master(self) -> None:
        for m, p in zip(self.master, self.params):
            m.copy_(p)


def step(params, optimizer, max_norm, master: MasterWeights | None, model) -> tuple[float, bool]:
    """Clip by the global norm and step (on the masters when there are any, then copy them
    and their clipped gradients into the model); on a non-finite norm zero the gradients and
    skip. Returns ``(grad_norm, updated)``. Afterwards ``param.grad`` of the model holds the
    clipped gradient either way, as FSDPEngine's does."""
    if master is not None:
        master.grads_to_master()
    norm, updated = clip_and_step(_Params(master.master if master is not None else params),
                                  optimizer, max_norm)
    if not updated:
        model.zero_grad(set_to_none=True)
    elif master is not None:
        master.master_to_model()
        master.master_grads_to_model()
    return norm, updated

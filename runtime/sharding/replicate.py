"""``replicate``: every rank holds the whole model, its gradients and the optimizer state;
the gradients are all-reduced (SUM, flat buckets) and every replica steps alike.

Master weights (a mode fact, as zero1 / fsdp keep theirs): a model built in a wider dtype
than the compute dtype (:meth:`Replicate.storage_dtype` with ``masters``, e.g. fp32 under
bf16 compute, AReaL's ``optimizer_dtype``) keeps those weights as masters: the model holds
their cast, the gradients are reduced, clipped and stepped in the masters' dtype, and after
the step the model's ``.grad`` holds the clipped gradients cast back (as FSDP2's parameters
hold theirs). Without ``masters`` the model is built in the compute dtype and stepped as it is.

Offload (``train.offload=optimizer``, :mod:`.offload`): the masters -- or, without masters,
host copies of the trained weights in the compute dtype -- and the optimizer state live in
host memory; the gradients are reduced, their norm taken and clipped on the device, copied to
the host, stepped there, and the updated weights copied back into the model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from runtime.sharding.base import ShardingMode, register
from runtime.sharding.common import optimizer_bytes, tensor_bytes
from runtime.sharding.offload import host_copy, host_empty, synchronize, to_device, to_host


def allreduce_gradients(grads: list, like: list, bucket_elems: int = 1 << 24,
                        group=None) -> list:
    """Sum ``grads`` (tensors, None where this rank has none; ``like``: the parameters) over
    the group, in place in flat buckets of one dtype; returns them, None where no rank had
    one."""
    device = like[0].device
    present = torch.tensor([g is not None for g in grads], dtype=torch.float32, device=device)
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, like)]
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket, size = [], 0

    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or size + g.numel() > bucket_elems):
            flush()
        bucket.append(g)
        size += g.numel()
    flush()
    dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
    return [g if n > 0 else None for g, n in zip(grads, present.tolist())]


class ReplicaState(Stateful):
    """DCP's view of a replica: what the optimizer steps (the masters where kept), keyed by
    the model's parameter names, and the optimizer state keyed by them too; ``loaded()``
    runs after a load (the masters' cast into the model)."""

    def __init__(self, named, optimizer, loaded=None):
        from runtime.dcp import param_holder

        self.module, self.optimizer, self.loaded = param_holder(named), optimizer, loaded

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": get_model_state_dict(self.module)}
        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state_dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.optimizer is None:
            set_model_state_dict(self.module, model_state_dict=state_dict["model"])
        else:
            set_state_dict(self.module, self.optimizer, model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict["optim"])
        if self.loaded is not None:
            self.loaded()


@register("replicate")
class Replicate(ShardingMode):
    sharded = False

    @classmethod
    def storage_dtype(cls, compute: torch.dtype, masters: torch.dtype | None = None):
        """The compute dtype, or the masters' dtype where masters are asked for."""
        return compute if masters is None else masters

    def __init__(self, model, make_optimizer, *, group=None, compute_dtype=None, layout=None,
                 **_):
        self.model, self.group = model, group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offload = layout is not None and layout.offload == "optimizer"
        built = next(model.parameters()).dtype
        self.masters = None  # fp32 (the built dtype) copies of the trained parameters
        if compute_dtype is not None and built != compute_dtype:
            self.masters = [torch.nn.Parameter(host_copy(p) if self.offload else
                                               p.detach().clone()) for p in self.params]
        if compute_dtype is not None:
            self.model.to(compute_dtype)  # the parameter objects stay (the masters map on them)
        self.host = None  # offloaded without masters: host copies in the compute dtype
        if self.offload and self.masters is None:
            self.host = [torch.nn.Parameter(host_copy(p)) for p in self.params]
        self.host_grads = [host_empty(s.shape, s.dtype) for s in self.stepped] \
            if self.offload else []
        self.optimizer = make_optimizer(self.stepped)
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._reduced: list | None = None  # the reduced gradients, on the device
        self._grad_bytes = 0

    @property
    def stepped(self) -> list:
        """What the optimizer steps: the masters where kept, host copies when offloaded,
        else the trained parameters."""
        if self.masters is not None:
            return self.masters
        return self.host if self.host is not None else self.params

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for s in self.stepped:
            s.grad = None
        self._reduced = None

    def reduce_gradients(self) -> None:
        grads = [p.grad for p in self.params]
        if self.masters is not None:  # reduced in the masters' dtype (fp32 under bf16)
            grads = [None if g is None else g.detach().to(m.dtype)
                     for g, m in zip(grads, self.masters)]
            for p in self.params:
                p.grad = None
        self._grad_bytes = sum(tensor_bytes(g) for g in grads)
        if self.world > 1:
            grads = allreduce_gradients(grads, self.params, group=self.group)
        self._reduced = grads
        if self.masters is None:
            for p, g in zip(self.params, grads):
                p.grad = g
        elif not self.offload:
            for m, g in zip(self.masters, grads):
                m.grad = g

    def _grads(self) -> list[torch.Tensor]:
        return [g for g in self._reduced or [] if g is not None]

    def grad_norm(self) -> float:
        grads = self._grads()  # as torch.nn.utils.clip_grad_norm_ computes it
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def scale_gradients(self, coef: float) -> None:
        for g in self._grads():
            g.mul_(coef)

    @torch.no_grad()
    def apply_update(self) -> None:
        if self.offload:  # the reduced gradients to the host copies' (one synchronization)
            for g, buf in zip(self._reduced, self.host_grads):
                if g is not None:
                    to_host(buf, g)
            synchronize(self.device)
            for s, g, buf in zip(self.stepped, self._reduced, self.host_grads):
                s.grad = None if g is None else buf
        self.optimizer.step()  # the gradients stay (readable after the step)
        self.masters_loaded()
        if self.masters is not None:  # the model holds the masters' cast, and their grads
            for g, p in zip(self._reduced, self.params):
                p.grad = None if g is None else g.to(p.dtype)

    @torch.no_grad()
    def masters_loaded(self) -> None:
        """The model's weights from what the optimizer steps (the masters, the host copies)."""
        if self.stepped is self.params:
            return
        for s, p in zip(self.stepped, self.params):
            to_device(p, s)

    def discard_gradients(self) -> None:
        self.zero_grad()

    @torch.no_grad()
    def load_masters(self, state: dict) -> None:
        """The masters (or host copies) from whole tensors (``state`` by parameter name;
        those absent: from the model's parameters), after the model's weights were set."""
        if self.stepped is self.params:
            return
        for s, name, p in zip(self.stepped, self.names, self.params):
            s.copy_(state[name] if name in state else p)

    def state_bytes(self) -> dict:
        # every weight held (a LoRA model's frozen base too); grads/optimizer: trained only
        model = sum(tensor_bytes(p) for p in self.model.parameters())
        kept = sum(tensor_bytes(s) for s in self.stepped) if self.stepped is not self.params \
            else 0
        optimizer = optimizer_bytes(self.optimizer)
        if self.offload:
            host = kept + optimizer + sum(tensor_bytes(g) for g in self.host_grads)
            return {"params": model, "grads": self._grad_bytes, "optimizer": 0, "host": host}
        return {"params": model + kept, "grads": self._grad_bytes, "optimizer": optimizer,
                "host": 0}

    @torch.no_grad()
    def param_norm(self) -> float:
        return float(sum(p.double().pow(2).sum() for p in self.stepped) ** 0.5)

    def sharded_state(self) -> dict:
        """DCP's view (every rank holds all of it): the stepped weights by name (masters
        where kept, host copies when offloaded) and the optimizer state."""
        return {"replicate": ReplicaState(list(zip(self.names, self.stepped)), self.optimizer,
                                          loaded=self.masters_loaded)}

    @torch.no_grad()
    def full_state(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

"""``offload`` / ``onload`` of ``DTATrainEngine``: the parameters, their gradients, the fp32
master weights and the optimizer state move to host memory and back, so an actor can share
its accelerator with the rollout (AReaL's colocated mode, ``enable_offload``).

FSDPEngine does this with torch_memory_saver (a CUDA allocator hook); here the tensors are
moved with ``.to()``, to pinned host memory when an accelerator is present. Operations that
need the weights (train, forward, save, weight update) onload first and offload again after
(:meth:`OffloadMixin._offload_aware`), as FSDPEngine's ``_offload_aware_context`` does. On a
CPU-only machine the host *is* the device: the moves are no-ops and only the state changes.
"""
from __future__ import annotations

import contextlib

import torch

from runtime.engine import comm

__all__ = ["OffloadMixin"]


def _move(tensor: torch.Tensor | None, device: torch.device, pin: bool):
    if tensor is None or tensor.device == device:
        return tensor
    out = tensor.to(device, non_blocking=True)
    return out.pin_memory() if pin and device.type == "cpu" else out


class OffloadMixin:
    """The offload members (needs ``core``, ``model``, ``optimizer``, ``device``,
    ``groups``)."""

    is_offload = False
    _offload_depth = 0

    def _place(self, device: torch.device) -> None:
        pin = device.type == "cpu" and torch.cuda.is_available()
        params = list(self.model.parameters())
        # what it steps (the fp32 masters where kept), unless actor.dta.offload keeps it, and
        # its state, in host memory for good
        steps_on_host = self.core.layout.offload == "optimizer"
        if self.optimizer is not None and not steps_on_host:
            held = {id(p) for p in params}
            params += [p for g in self.optimizer.param_groups for p in g["params"]
                       if id(p) not in held]
        with torch.no_grad():
            for p in params:  # the gradient leaves first: it must match the data's device
                grad, p.grad = p.grad, None
                p.data = _move(p.data, device, pin)
                if grad is not None:
                    p.grad = _move(grad, device, pin)
            for module in self.model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = _move(buf, device, pin)
            if self.optimizer is not None and not steps_on_host:
                for state in self.optimizer.state.values():
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.dim() > 0:
                            state[key] = _move(value, device, pin)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def offload(self) -> None:
        """Parameters, gradients, master weights and optimizer state to host memory.
        Refused under a sharded layout (zero1 / fsdp): its master slices, optimizer views
        and FSDP's DTensors are not moved by this code."""
        self._require_model()
        if self.core.layout.sharded:
            raise NotImplementedError(
                f"offload() under actor.dta.sharding={self.sharding} is not supported (the "
                "sharded masters and optimizer state stay on the device); set "
                "actor.dta.sharding=replicate for a colocated (offloaded) actor")
        if not self.is_offload:
            self._place(torch.device("cpu"))
            self.is_offload = True
        comm.barrier(self.groups.cpu)

    def onload(self) -> None:
        """Everything :meth:`offload` moved back to the engine's device."""
        self._require_model()
        if self.is_offload:
            self._place(self.device)
            self.is_offload = False
        comm.barrier(self.groups.cpu)

    @contextlib.contextmanager
    def _offload_aware(self):
        """Onload for the duration of an operation that needs the weights, and offload again
        after it if the engine was offloaded (re-entrant: only the outermost call moves)."""
        if not self.is_offload and self._offload_depth == 0:
            yield
            return
        self._offload_depth += 1
        if self._offload_depth == 1:
            self.onload()
        try:
            yield
        finally:
            self._offload_depth -= 1
            if self._offload_depth == 0:
                self.offload()

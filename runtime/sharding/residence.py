"""Where a sharding mode's tensors live: every tensor it holds moved to another device and
back, whatever the layout (:meth:`runtime.sharding.base.Sharding.to`).

What a mode holds is found, not listed: from the mode object, through its own objects (the
``runtime`` classes: flat shards, expert and HSDP parts), the model (parameters, their
gradients, buffers; FSDP2's per-parameter state), the optimizer (its state and parameter
groups), lists, tuples and dicts. A ``DTensor`` is its local tensor. Tensors that share a
storage -- a flat buffer and the parameters viewing it, FSDP2's padded shard and its
``DTensor`` -- are moved as one storage, each tensor re-pointed in place (``.data``) at the
same offset, sizes and strides of the moved one, so every object keeps its tensors and every
view stays a view. Nothing is moved twice, nothing held is left behind -- but a freed storage
(FSDP2's gathered parameters between calls: no bytes) stays where it is, empty, for its owner
to fill again on its device.

To host memory (:func:`offload`): every storage on an accelerator, copied to host (pinned
where CUDA is present); storages already on the host (``train.offload=optimizer``'s state,
device meshes) stay. Back (:func:`onload`): exactly the storages moved, to their device.
``fresh=True`` copies every storage even when the device is the same -- what CPU tests use to
show that everything was found and re-pointed.
"""
from __future__ import annotations

import torch

from runtime.sharding.common import fsdp_param_groups

__all__ = ["held_tensors", "offload", "onload"]

_WALKED = ("runtime.", "torch.distributed.fsdp.")  # objects whose attributes hold state


def held_tensors(root) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` (see the module doc), each once, local tensors
    of ``DTensor``s in their place."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", None)  # a DTensor holds its local tensor
            if local is not None:
                stack.append(local)
            else:
                found[id(obj)] = obj
            stack.append(obj.grad if obj.is_leaf else None)
        elif isinstance(obj, torch.nn.Module):
            stack += [*obj._parameters.values(), *obj._buffers.values(),
                      *obj._modules.values()]
            if hasattr(obj, "_get_fsdp_state"):  # FSDP2: its parameters' shards
                stack += [p for g in fsdp_param_groups(obj) for p in g.fsdp_params]
        elif isinstance(obj, torch.optim.Optimizer):
            stack += [obj.state, obj.param_groups]
        elif isinstance(obj, dict):
            stack += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            stack += list(obj)
        elif type(obj).__module__.startswith(_WALKED) and hasattr(obj, "__dict__"):
            stack += list(vars(obj).values())
    return list(found.values())


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.device, s.data_ptr())


@torch.no_grad()
def _move(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Each storage of ``tensors`` copied once to ``device``, every tensor re-pointed."""
    pin = device.type == "cpu" and torch.cuda.is_available()
    by_storage: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_storage.setdefault(_storage_key(t), []).append(t)
    for group in by_storage.values():
        old = group[0].untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=old.device).set_(old)
        new = torch.empty(raw.shape, dtype=torch.uint8, device=device, pin_memory=pin)
        new.copy_(raw, non_blocking=False)
        storage = new.untyped_storage()
        for t in group:
            t.data = torch.empty(0, dtype=t.dtype, device=device).set_(
                storage, t.storage_offset(), t.size(), t.stride())


def offload(root, *, fresh: bool = False) -> list[tuple[torch.Tensor, torch.device]]:
    """Every tensor ``root`` holds on an accelerator (``fresh``: every tensor) to host memory;
    returns what moved, with the device each came from (for :func:`onload`)."""
    host = torch.device("cpu")
    moved = [(t, t.device) for t in held_tensors(root)
             if t.untyped_storage().nbytes() and (fresh or t.device.type != "cpu")]
    _move([t for t, _ in moved], host)
    _synchronize()
    return moved


def onload(moved: list[tuple[torch.Tensor, torch.device]], *, fresh: bool = False) -> None:
    """What :func:`offload` moved, back to the devices it came from."""
    for device in {d for _, d in moved}:
        _move([t for t, d in moved if d == device and (fresh or t.device != d)], device)
    _synchronize()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

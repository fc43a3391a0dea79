"""HSDP: a mode's state sharded within a group of ranks, replicated across the groups.

A sharded mode (zero1, fsdp) holds its trained parameters as *parts*
(:class:`Part`): parameters sharded alike, each with the process group its state is split
over (``shard``) and the group of ranks holding the same shards (``replicas``, HSDP; None
without). The dense parameters are one part: sharded over the layout's shard group (S
consecutive ranks, a node; the world unless ``train.shard_size`` says otherwise) and
replicated across the W / S groups (``runtime.engine.layout.ProcessGroups.shard`` /
``.replicas``). A part for the routed experts (sharded over the expert replicas) is the
expert-parallel layout's.

The gradient rule stays the world's SUM (every rank's gradient is its share): within a shard
group the mode's collectives sum (fsdp's per-call reduce-scatter, zero1's per-step one), and
across the replicas the shards are summed **once per step**, at the step
(:func:`sum_over_replicas`: one all-reduce per bucket of up to ``BUCKET_ELEMS`` elements,
whatever the walk did), never per backward call -- the walk makes many backward calls per
step, and the replica all-reduce crosses the slow links between nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Part", "dense_part", "sum_over_replicas", "sum_step_over_replicas", "shard_mesh"]

BUCKET_ELEMS = 1 << 24  # elements in one cross-replica all-reduce


@dataclass(frozen=True)
class Part:
    """Trained parameters sharded alike (module doc). ``named``: ``(name, parameter)`` in
    the model's order; ``shard``: the group their state is split over; ``replicas``: the
    group holding the same shards (summed across once per step), None without HSDP."""

    named: tuple
    shard: object = None
    replicas: object = None

    @property
    def params(self) -> list:
        return [p for _, p in self.named]


def dense_part(named, *, group=None, groups=None) -> Part:
    """The dense parameters' part: over ``groups.shard`` / ``groups.replicas`` where the
    engine made the layout's groups, else over ``group`` (plain sharding)."""
    if groups is not None and groups.shard is not None:
        return Part(tuple(named), groups.shard, groups.replicas)
    return Part(tuple(named), group, None)


def shard_mesh(part: Part, device_type: str):
    """The 1-D DeviceMesh of ``part``'s shard group (the DTensors of its state live on it:
    FSDP2's parameters, the flat shards' checkpoint views). Built from the existing group,
    no new process group: the "shard" dimension of HSDP's (replicate, shard) mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    group = part.shard if part.shard is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))


@torch.no_grad()
def sum_over_replicas(grads: list, like: list, flags: torch.Tensor, group,
                      bucket_elems: int = BUCKET_ELEMS) -> tuple[list, torch.Tensor]:
    """SUM ``grads`` (tensors, or None where this rank has none) over ``group``, the
    replicas, with ``flags`` (a 1-D float tensor of the caller's presence counts, in the
    gradients' dtype) summed along in the last bucket: one all-reduce per bucket, the same
    buckets on every replica (from ``like``: each gradient's shape). Returns the summed
    gradients (in place where this rank had one; None where no replica had one: their flag
    entries, ``present[i]``, say so) and the summed flags. A gradient that is None here but
    present on another replica comes back as the others' sum (zeros added)."""
    dtype = flags.dtype
    device = flags.device
    present = torch.tensor([g is not None for g in grads], dtype=dtype, device=device)
    tail = torch.cat([present, flags])
    full = [g if g is not None else torch.zeros(t.shape, dtype=dtype, device=device)
            for g, t in zip(grads, like)]
    if any(g.dtype != dtype for g in full):
        raise TypeError(f"sum_over_replicas: every gradient must be {dtype} (the flags' dtype)")
    buckets: list[list[int]] = [[]]
    size = 0
    for i, g in enumerate(full):
        if buckets[-1] and size + g.numel() > bucket_elems:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += g.numel()
    for b, members in enumerate(buckets):
        last = b == len(buckets) - 1
        # built on the flags' device (the collective's): a gradient summed on the host
        # (offload gradients) goes up for the all-reduce and back into its buffer below
        parts = [full[i].reshape(-1).to(device) for i in members] + ([tail] if last else [])
        flat = torch.cat(parts) if parts else tail
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        at = 0
        for i in members:
            n = full[i].numel()
            full[i].copy_(flat[at:at + n].view_as(full[i]))
            at += n
        if last:
            tail = flat[at:]
    n = len(grads)
    counts = tail[:n].tolist()
    return [g if c > 0 else None for g, c in zip(full, counts)], tail[n:]


def sum_step_over_replicas(group, flats=(), grads=(), like=()) -> list:
    """The step's one cross-replica SUM of a mode's parts replicated over ``group``: the
    reduced slices of ``flats`` (:class:`~runtime.sharding.flat.FlatShards`, their presence
    counts summed along) and ``grads`` (e.g. FSDP2's sharded gradients, None where this rank
    has none; ``like``: their shapes). Returns ``grads`` summed (see
    :func:`sum_over_replicas`); the flats' slices and presence are summed in place."""
    flats, grads, like = list(flats), list(grads), list(like)
    ref = flats[0].grad_shard if flats else like[0]
    flags = torch.cat([f.presence for f in flats]) if flats else \
        torch.zeros(0, dtype=ref.dtype, device=ref.device)
    out, flags = sum_over_replicas(grads + [f.grad_shard for f in flats],
                                   like + [f.grad_shard for f in flats], flags, group)
    at = 0
    for f in flats:
        n = f.presence.numel()
        f.presence = flags[at:at + n]
        at += n
    return out[:len(grads)]

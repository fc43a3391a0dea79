"""What a sharded mode checkpoints: DCP-ready views of its sharded state (see runtime.dcp).

- flat shards (zero1; fsdp's vocabulary weights): the master weights and each optimizer
  state as one logical 1-D tensor of N elements, a ``Shard(0)`` DTensor whose local part is
  this rank's slice (the ``torch.chunk`` cut :mod:`.flat` uses), plus each parameter's step
  count (replicated);
- FSDP2 parameters: the sharded DTensor parameters themselves and their optimizer states.

Loading fills the same objects in place, then regathers the compute parameters. The
optimizer's per-parameter state is created up front (zeros, step 0: what AdamW's first step
would create), so there is always something to load into.
"""
from __future__ import annotations

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.optimizer import _get_scalar_dtype

STATE_KEYS = {"AdamW": ("exp_avg", "exp_avg_sq"), "Adam": ("exp_avg", "exp_avg_sq"),
              "SGD": ()}


def state_keys(optimizer) -> tuple[str, ...]:
    name = type(optimizer).__name__
    if name not in STATE_KEYS:
        raise TypeError(f"sharded checkpoints support {sorted(STATE_KEYS)}, not {name}")
    if name == "SGD" and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return ("momentum_buffer",)
    return STATE_KEYS[name]


def ensure_state(optimizer, params) -> None:
    keys = state_keys(optimizer)
    for p in params:
        st = optimizer.state[p]
        if not st and keys:
            st["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            for k in keys:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _dtensor(local: torch.Tensor, mesh, total: int):
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(total,),
                              stride=(1,))


class FlatShardsState(Stateful):
    """DCP view of a :class:`~runtime.sharding.flat.FlatShards` and its optimizer."""

    def __init__(self, shards, optimizer, mesh):
        self.shards, self.optimizer, self.mesh = shards, optimizer, mesh

    def state_dict(self) -> dict:
        sh = self.shards
        ensure_state(self.optimizer, sh.master_params)
        flat = sh.master_flat_state(self.optimizer)
        out = {k: _dtensor(v, self.mesh, sh.total) for k, v in flat.items()}
        out["steps"] = sh.param_steps(self.optimizer)
        return out

    def load_state_dict(self, sd: dict) -> None:
        flat = {k: v.to_local() for k, v in sd.items() if k != "steps"}
        self.shards.load_flat_state(self.optimizer, flat, sd["steps"],
                                    step_dtype=_get_scalar_dtype())


class DTensorParamsState(Stateful):
    """DCP view of FSDP2's sharded parameters and their optimizer states (offloaded: the
    host copies the optimizer steps, keyed by the same names; ``loaded()`` runs after a load:
    the device shards from them)."""

    def __init__(self, named_params, optimizer, loaded=None):
        self.named, self.optimizer, self.loaded = list(named_params), optimizer, loaded

    def state_dict(self) -> dict:
        ensure_state(self.optimizer, [p for _, p in self.named])
        out = {}
        for name, p in self.named:
            out[f"param.{name}"] = p
            for k, v in self.optimizer.state[p].items():
                out[f"optim.{name}.{k}"] = v
        return out

    def load_state_dict(self, sd: dict) -> None:
        with torch.no_grad():
            for name, p in self.named:
                src = sd[f"param.{name}"]
                if src is not p:
                    p.copy_(src)
                st = self.optimizer.state[p]
                for k in list(st):
                    v = sd[f"optim.{name}.{k}"]
                    if v is not st[k]:
                        st[k].copy_(v)
        if self.loaded is not None:
            self.loaded()

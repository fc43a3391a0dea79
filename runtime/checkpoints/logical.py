"""The training state's one layout-independent view: what every sharding mode saves and loads.

Per trained parameter -- by its name in the model (``named_parameters()``) and its whole
shape -- three kinds of logical tensor, whatever the world size, the mode or the
context-parallel size::

    model.<name>               the weights the optimizer steps (the fp32 masters where kept)
    optim.<name>.<key>         each optimizer state tensor (AdamW: exp_avg, exp_avg_sq)
    optim.<name>.step          its step count (0-d; AdamW only; 0: no state yet)

A mode declares what this rank holds of each parameter as :class:`Held` pieces
(:meth:`Sharding.held`): a *box* (a ``DTensor``'s local shard, fsdp's layers; an expert
slice; a replica's whole tensor: ``offsets`` of its origin) or a *flat range* (zero1's and
fsdp's vocabulary flat shards: elements ``[start, start + n)`` of the row-major parameter,
held 1-D). Everything else is generic: the optimizer state is the optimizer's own
(``optimizer.state[held.stepped]``), DCP re-cuts the logical tensors for the loading ranks
(:mod:`runtime.checkpoints.pieces`), and after a load the mode derives the rest (:meth:`Sharding.
logical_loaded`: the compute weights regathered, the masters cast into the model).

How a new layout plugs in: declare its pieces. Expert parallelism -- rank r holds experts
``[r n/E, (r + 1) n/E)`` of a fused ``[n, ...]`` parameter -- is a box at
``(r n/E, 0, ...)`` with the whole shape in :meth:`Sharding.logical_shapes`; HSDP's
``DTensor`` on a (replicate, shard) mesh is a box like fsdp's (the replicas' identical
boxes are written once); optimizer offload steps host tensors: ``stepped`` is the host
master, its state on the host. Nothing else changes.

A replica (``replicate``) and a plain model (:class:`WholeModel`, the Python API's
checkpoints) are one-shard layouts: every parameter one box at the origin, saved by one
process. Whole tensors (the legacy formats, read whole by :mod:`.legacy`) load through the
same view (:func:`load_whole`), so every source reaches every layout by one path. :func:`check_fits` refuses, in one line and before
anything is touched, a checkpoint whose parameters, shapes or optimizer state are not this
run's (another model, LoRA <-> full, AdamW <-> SGD).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.checkpoints.pieces import LogicalTensor
from runtime.checkpoints.sharded import CheckedState, ShardedCheckpointError

__all__ = ["Held", "held_dtensor", "LogicalState", "View", "WholeModel", "load_whole",
           "check_fits", "KEY", "STEP"]

KEY = "logical"  # the view's entry in a DCP state (its tensors: "logical.model.<name>", ...)
STEP = "step"


@dataclass(frozen=True)
class Held:
    """This rank's piece of one trained parameter. ``stepped``: what the optimizer steps
    for it (its state is ``optimizer.state[stepped]``; a ``DTensor``: its local part).
    Exactly one of ``offsets`` (a box: the local tensor has the box's shape) and ``start``
    (a flat range of the row-major parameter: the local tensor is 1-D)."""

    name: str
    shape: tuple
    stepped: torch.Tensor
    offsets: tuple | None = None
    start: int | None = None

    def __post_init__(self):
        if (self.offsets is None) == (self.start is None):
            raise ValueError(f"{self.name}: a piece is a box (offsets) or a flat range (start)")


def held_dtensor(name: str, stepped) -> Held:
    """The piece of a ``DTensor`` parameter (FSDP2's ``Shard(0)``, HSDP's mesh): its one box."""
    chunks = stepped.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValueError(f"{name}: a DTensor of {len(chunks)} local boxes")
    return Held(name, tuple(stepped.shape), stepped, offsets=tuple(chunks[0].offsets))


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


def _has_step(optimizer) -> bool:
    return type(optimizer).__name__ in ("AdamW", "Adam")


def _state_keys(optimizer) -> tuple[str, ...]:
    """The optimizer's per-parameter state tensors; none without an optimizer (an engine
    that only infers, e.g. AReaL's reference model: its view is the weights alone)."""
    from runtime.checkpoints.optimizer_state import state_keys

    return () if optimizer is None else state_keys(optimizer)


def wanted(mode) -> dict[str, tuple]:
    """Every logical tensor of ``mode``'s state and its whole shape: what a checkpoint must
    hold to be loaded by it (read off the mode; nothing is created or touched)."""
    keys = _state_keys(mode.optimizer)
    out = {}
    for name, shape in mode.logical_shapes():
        out[f"model.{name}"] = tuple(shape)
        for k in keys:
            out[f"optim.{name}.{k}"] = tuple(shape)
        if _has_step(mode.optimizer):
            out[f"optim.{name}.{STEP}"] = ()
    return out


class View:
    """The logical tensors of one mode on this rank (targets of a load, sources of a save),
    keyed ``model.<name>``, ``optim.<name>.<key>``, ``optim.<name>.step``; a parameter this
    rank holds nothing of has empty ones."""

    def __init__(self, mode):
        from runtime.checkpoints.optimizer_state import ensure_state

        self.sharding, self.optimizer = mode, mode.optimizer
        self.keys = _state_keys(self.optimizer)
        self.stepped = _has_step(self.optimizer)
        self.held = list(mode.held())
        if self.optimizer is not None:
            ensure_state(self.optimizer, [h.stepped for h in self.held])
        self.shapes = {n: tuple(s) for n, s in mode.logical_shapes()}
        self.tensors: dict[str, LogicalTensor] = {}
        for name, shape in self.shapes.items():
            self.tensors[f"model.{name}"] = LogicalTensor(shape)
            for k in self.keys:
                self.tensors[f"optim.{name}.{k}"] = LogicalTensor(shape)
            if self.stepped:
                self.tensors[f"optim.{name}.{STEP}"] = LogicalTensor(())
        self.steps: dict[str, torch.Tensor] = {}
        for h in self.held:
            if self.shapes.get(h.name) != tuple(h.shape):
                raise ValueError(f"{h.name}: a piece of a parameter of shape {h.shape}; the "
                                 f"mode's logical shape is {self.shapes.get(h.name)}")
            st = self.optimizer.state[h.stepped] if self.optimizer is not None else {}
            self._add(f"model.{h.name}", h, _local(h.stepped))
            for k in self.keys:
                self._add(f"optim.{h.name}.{k}", h, _local(st[k]))
            if self.stepped and h.name not in self.steps:  # one box per rank
                self.steps[h.name] = torch.tensor(float(st[STEP]), dtype=torch.float64)
                self.tensors[f"optim.{h.name}.{STEP}"].add_box((), self.steps[h.name])

    def _add(self, fqn: str, h: Held, local: torch.Tensor) -> None:
        if h.start is not None:
            if not local.is_contiguous():
                raise ValueError(f"{fqn}: a flat piece must be contiguous")
            self.tensors[fqn].add_range(h.start, local.reshape(-1))
        else:
            self.tensors[fqn].add_box(h.offsets, local)

    @torch.no_grad()
    def finish(self) -> None:
        """After the pieces were written: the step counts into the optimizer state (a
        parameter at step 0 has none, as in a fresh optimizer), then the mode's rest."""
        for h in self.held:
            if not self.stepped:
                continue
            step = float(self.steps[h.name])
            if step <= 0:
                self.optimizer.state.pop(h.stepped, None)
            else:
                self.optimizer.state[h.stepped][STEP].fill_(step)
        self.sharding.logical_loaded()


class LogicalState(CheckedState):
    """DCP's view of a mode (``Sharding.sharded_state()``): the logical tensors on a
    save, loaded in place then finished (:meth:`View.finish`) on a load."""

    def __init__(self, mode):
        self.sharding = mode
        self.view: View | None = None  # checked against a checkpoint, to be loaded

    def check(self, path: str, metadata, key: str = KEY) -> None:
        """Before a load: refuse (one line) a checkpoint whose logical tensors (DCP's
        ``metadata``) are not this run's; the view is kept for the load."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        prefix = f"{key}."
        saved = {k[len(prefix):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
                 if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
        check_fits(repr(path), saved, wanted(self.sharding),
                   optimizer=self.sharding.optimizer is not None)
        self.view = View(self.sharding)

    def state_dict(self) -> dict:
        if self.view is None:
            return View(self.sharding).tensors
        return self.view.tensors

    def load_state_dict(self, state_dict) -> None:
        view, self.view = self.view, None
        if view is None:
            raise RuntimeError("a logical state is loaded after check() only")
        view.finish()


class WholeModel:
    """A plain model (a LoRA model: its adapters are what it trains) and its optimizer as a
    one-shard layout, as a replica holds its state: every trained parameter whole, stepped
    as it is (:func:`runtime.checkpoints.whole.save_checkpoint`)."""

    sharded = False

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def logical_shapes(self) -> list[tuple[str, tuple]]:
        return [(n, tuple(p.shape)) for n, p in self.named]

    def held(self) -> list[Held]:
        return [Held(n, tuple(p.shape), p, offsets=(0,) * p.dim()) for n, p in self.named]

    def logical_loaded(self) -> None:
        """Nothing to derive: the model's parameters are what was loaded."""

    def sharded_state(self) -> dict:
        return {KEY: LogicalState(self)}


@torch.no_grad()
def load_whole(mode, whole: dict[str, torch.Tensor], *, what: str) -> None:
    """Whole tensors keyed as the view's (``model.<name>``, ``optim.<name>.<key>``,
    ``optim.<name>.step``) into this rank's pieces; checked first (:func:`check_fits`)."""
    check_fits(what, {k: tuple(v.shape) for k, v in whole.items()}, wanted(mode),
               optimizer=mode.optimizer is not None)
    view = View(mode)
    for fqn, lt in view.tensors.items():
        src = whole[fqn]
        for offsets, local in lt.chunks.items():
            box = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            local.copy_(src[box] if box else src)
    view.finish()


def _names(keys, prefix: str) -> set[str]:
    return {k[len(prefix):] for k in keys if k.startswith(prefix)}


def check_fits(what: str, saved: dict[str, tuple], wanted: dict[str, tuple], *,
               optimizer: bool = True) -> None:
    """One line (:class:`runtime.checkpoints.sharded.ShardedCheckpointError`) when the checkpoint ``what``
    (its logical tensors' shapes, ``saved``) is not this run's state (``wanted``). Without
    an ``optimizer`` the checkpoint's optimizer state is not read (only its weights)."""
    have, need = _names(saved, "model."), _names(wanted, "model.")
    if have != need:
        extra, lacking = sorted(have - need), sorted(need - have)
        lora_saved, lora_run = (any("lora_" in n for n in s) for s in (have, need))
        why = " (another model or size)"
        if lora_saved != lora_run:
            why = (f": it was saved by a {'LoRA' if lora_saved else 'full'} run and this run "
                   f"trains {'LoRA adapters' if lora_run else 'the full model'}; the trained "
                   "weights are different tensors, so LoRA <-> full cannot resume (start a "
                   "new run from exported weights)")
        parts = ([f"holds {len(extra)} trained parameter(s) this run does not train "
                  f"{extra[:2]}"] if extra else []) + \
            ([f"lacks {len(lacking)} of this run's {lacking[:2]}"] if lacking else [])
        raise ShardedCheckpointError(f"checkpoint {what} does not fit this run: it "
                                     f"{' and '.join(parts)}{why}")
    shapes = [n for n in sorted(need) if saved[f"model.{n}"] != wanted[f"model.{n}"]]
    if shapes:
        n = shapes[0]
        raise ShardedCheckpointError(
            f"checkpoint {what} does not fit this run: parameter {n!r} has shape "
            f"{tuple(saved[f'model.{n}'])} there and {tuple(wanted[f'model.{n}'])} here "
            f"({len(shapes)} parameter(s) differ: another model or size)")
    kinds = ({k.rsplit(".", 1)[1] for k in _names(saved, "optim.")},
             {k.rsplit(".", 1)[1] for k in _names(wanted, "optim.")})
    if optimizer and kinds[0] != kinds[1]:
        raise ShardedCheckpointError(
            f"checkpoint {what} holds optimizer state {sorted(kinds[0])} per parameter, this "
            f"run's optimizer keeps {sorted(kinds[1])}: resume with the optimizer it was "
            "saved with (optimizer.name)")
    odd = [k for k in wanted if saved.get(k) != wanted[k]]
    if odd:
        raise ShardedCheckpointError(
            f"checkpoint {what} does not fit this run: {odd[0]!r} is "
            f"{'missing' if odd[0] not in saved else f'of shape {saved[odd[0]]}'} "
            f"(this run: {wanted[odd[0]]})")

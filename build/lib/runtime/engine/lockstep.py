"""Keeping the ranks' decoder calls matched while each walks its own tree.

Some layouts make collectives inside every decoder call: FSDP all-gathers every layer's
parameters (forward) and a backward all-gathers them again and reduce-scatters the
gradients; expert parallelism (``dta.model.expert_parallel``) exchanges each MoE layer's
routed rows with the other ranks of its group, forward and backward. The ranks of different
data-parallel groups walk different trees, so they make different sequences of calls -- and
collectives must be matched one for one. This module pads each rank's sequence with dummy
one-token calls (zero gradient) so that every rank performs the same kind of event at the
same time. The engine core runs it where the layout needs it
(``ParallelLayout.matched_calls``: fsdp, or an expert-parallel group spanning data-parallel
groups), in every sharding mode.

Events. A rank announces its next event when it calls the decoder
(:class:`LockstepDecoder`), when the backward of a kept graph reaches that call's outputs
(:class:`_Tie`), or DONE after its walk:

- **B**: the backward of a graph kept since its forward (*retain*: a pack's backward at its
  pop, after its subtree; a leaf pack's at its head flush), detected inside
  ``_Tie.backward``, which runs before any collective of that graph's backward (the tie
  sits on the decoder's outputs);
- **F**: a forward (*retain*: with gradient, the graph kept; *recompute*: a push, no grad);
- **X** (*recompute* only): a forward with gradient whose backward follows before the next
  call (a leaf, or a pop's re-forward);
- **DONE**.

One all-reduce of the per-event counts decides each round, by priority B < F < X < DONE:

- B: the B ranks backpropagate; the others make a dummy X (one-token forward with grad,
  backward of a zero gradient) and announce again. The dummy's forward collectives are
  matched on the B ranks by ``forward_steps``: the collectives one forward makes, in forward
  order, without a forward (a forward cannot be used: inside a backward FSDP does not
  reshard after forward, ``is_bw()``) -- FSDP's ``unshard()`` / ``reshard()`` of each unit,
  and between a layer's two, expert parallelism's exchanges of that layer with no rows of
  this rank's (``ExpertParallel.forward_exchanges``; the sharding mode interleaves them,
  ``Sharding.forward_steps``: gloo collectives of different groups block, so the order
  is the dummy's). When every rank announced B, nothing is padded;
- F: the F ranks forward, the others make a dummy F (no grad) and announce again;
- X: the X ranks forward and backpropagate, the DONE ranks make a dummy X;
- all DONE: the session ends.

Every backward passes through the decoder's last hidden state (its K/V outputs are tied to
it with a zero gradient; the walker starts a pack's backward at its hidden states, with zeros
where only the router aux loss reaches the pack, whose surrogate enters at the routers), so
every layer's collectives run in every backward, real or dummy: one backward of any call is
the same sequence of collectives on every rank (expert parallelism's backward exchanges
serve whichever call a peer backpropagates).
One backward must cover one decoder call: the layout asks the walker to flush its LM head
per pack under retain (``head_rows=0``: a leaf pack is backpropagated alone, right after its
forward), and a backward reaching a second call's tie is refused (:class:`LockstepError`),
as is, under recompute, a call whose backward did not follow. The walker is untouched: the
engine hands it a model whose ``get_decoder()`` is the wrapper.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from dta.model import routing

B, F, X, DONE = 0, 1, 2, 3
KINDS = 4


class LockstepError(RuntimeError):
    pass


class _Tie(torch.autograd.Function):
    """Identity on (hidden, *kv) whose backward always sends a gradient (zeros if none) to
    the hidden state; under retain its backward first announces B (the round's collectives
    then follow in the engine's run of the graph)."""

    @staticmethod
    def forward(ctx, sync, hidden, *kv):
        ctx.sync = sync
        return (hidden.view_as(hidden), *(t.view_as(t) for t in kv))

    @staticmethod
    def backward(ctx, dhidden, *dkv):
        ctx.sync.before_backward()
        return (None, dhidden, *dkv)  # grads are materialized: zeros where unused


class Lockstep:
    """One step's protocol state on this rank (see the module doc). ``kept_graphs``: the
    walker's retain policy (forwards with grad keep their graph; backwards are B events)."""

    def __init__(self, decoder, group=None, *, kept_graphs: bool = False, forward_steps=(),
                 on_end=None, what: str = "matched calls"):
        self.decoder, self.group = decoder, group
        self.on_end = on_end  # after the walk (the mode's: fsdp reshards every unit)
        self.kept_graphs = kept_graphs
        self.forward_steps = list(forward_steps)  # a forward's collectives, in its order
        self.what = what  # the layout's reason, for errors (e.g. "fsdp")
        self.world = dist.get_world_size(group)
        self.active = False
        self.pending_backward = False
        self.backward_task = None
        self.rounds = 0
        self.by_kind = [0] * KINDS  # rounds won by each event
        self.mixed_backwards = 0  # B rounds in which some rank made a dummy X
        self.padded = 0  # dummy events this rank made

    def _decide(self, want: int) -> tuple[int, int]:
        """(the round's event, how many ranks announced it)."""
        counts = torch.zeros(KINDS, dtype=torch.int64)
        counts[want] = 1
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
        self.rounds += 1
        kind = next(k for k in range(KINDS) if counts[k] > 0)
        self.by_kind[kind] += 1
        if kind == B and int(counts[B]) < self.world:
            self.mixed_backwards += 1
        return kind, int(counts[kind])

    def _dummy(self, grad: bool) -> None:
        self.padded += 1
        emb = self.decoder.get_input_embeddings()
        x = torch.zeros(1, 1, emb.weight.shape[1], dtype=emb.weight.dtype,
                        device=emb.weight.device, requires_grad=grad)
        pos = torch.zeros(1, 1, dtype=torch.long, device=x.device)
        with torch.set_grad_enabled(grad), routing.suspended():  # not the walk's call: no replay
            h = self.decoder(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state
        if grad:
            torch.autograd.backward([h], [torch.zeros_like(h)])

    def _collectives_of_a_forward(self) -> None:
        """The collectives of a forward, without one (``forward_steps``, in order)."""
        self.padded += 1
        for step in self.forward_steps:
            step()

    def _follow(self, kind: int) -> None:
        """A round another event won: make the matching dummy."""
        self._dummy(grad=kind in (B, X))

    def _check_backward_done(self) -> None:
        if self.pending_backward:
            self.active = False
            raise LockstepError(
                f"{self.what}: a decoder call with gradient was not backpropagated before the "
                "next call; the ranks' collectives cannot be matched (a walk that keeps graphs "
                "across calls needs the lockstep's retain protocol: walker.policy=retain)")

    def before_call(self) -> None:
        if not self.active:
            return
        self._check_backward_done()
        grad = torch.is_grad_enabled()
        want = X if grad and not self.kept_graphs else F
        while True:
            kind, _ = self._decide(want)
            if kind == want:
                break
            self._follow(kind)
        self.pending_backward = want == X

    def before_backward(self) -> None:
        """A tied call's backward is starting (inside the autograd engine)."""
        if not self.active:
            return
        if not self.kept_graphs:  # recompute: the backward of the X round just announced
            self.pending_backward = False
            return
        task = torch._C._current_graph_task_id()
        if task == self.backward_task:
            self.active = False
            raise LockstepError(
                f"{self.what}: one backward reached two decoder calls; their collectives "
                "interleave and cannot be matched across ranks (flush the walker's LM head "
                "per pack: head_rows=0)")
        self.backward_task = task
        kind, count = self._decide(B)
        if kind != B:
            raise LockstepError(f"{self.what} lockstep: a backward lost its round to event "
                                f"{kind}")
        if count < self.world:  # the other ranks make a dummy X: match its forward
            self._collectives_of_a_forward()

    def begin(self) -> None:
        self.active, self.pending_backward, self.rounds, self.padded = True, False, 0, 0
        self.by_kind, self.mixed_backwards, self.backward_task = [0] * KINDS, 0, None

    def stats(self) -> dict:
        """This step's rounds, by the event that won them, and this rank's dummies."""
        return {"rounds": self.rounds, "padded": self.padded,
                "mixed_backwards": self.mixed_backwards,
                **{name: n for name, n in zip(("B", "F", "X", "DONE"), self.by_kind)}}

    def end(self) -> int:
        """After this rank's walk: follow the peers' remaining calls, then ``on_end`` (the
        mode's ``release_gathered``); returns the rounds."""
        self._check_backward_done()
        while True:
            kind, _ = self._decide(DONE)
            if kind == DONE:
                break
            self._follow(kind)
        self.active = False
        if self.on_end is not None:
            self.on_end()
        return self.rounds


class LockstepDecoder(torch.nn.Module):
    """The decoder as the walker sees it: each call is announced (an F or an X), and the
    outputs of a call with gradient pass through :class:`_Tie`."""

    def __init__(self, decoder, sync: Lockstep):
        super().__init__()
        self.inner = decoder
        self.sync = sync
        object.__setattr__(self, "__wrapped__", decoder)  # what the model interface reads

    def forward(self, *args, cache=None, **kwargs):
        self.sync.before_call()
        if cache is not None:
            kwargs["cache"] = cache
        out = self.inner(*args, **kwargs)
        if not (self.sync.active and torch.is_grad_enabled()):
            return out
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        layers = list(cache.layers) if cache is not None else []
        slots = [_state_of(layer) for layer in layers]
        hidden, *tied = _Tie.apply(self.sync, out.last_hidden_state,
                                   *(t for _, names in slots for t in names))
        at = 0
        for layer, (attr, names) in zip(layers, slots):
            n = len(names)
            if attr == "cells":
                layer.cells = tuple(tied[at:at + n])
            else:
                layer.keys, layer.values = tied[at], tied[at + 1]
            at += n
        out.last_hidden_state = hidden
        return out


def _state_of(layer) -> tuple[str, tuple]:
    """The tensors a decoder call left in a cache layer, to tie to the hidden state: a
    context-parallel layer's ``cells`` (its heads' K/V, ``dta.model.cp_attention``), else
    ``keys`` / ``values``. A layer without them is refused: its backward could reach FSDP's
    hooks before the tie announces it."""
    cells = getattr(layer, "cells", None)
    if isinstance(cells, tuple) and cells and all(torch.is_tensor(t) for t in cells):
        return "cells", cells
    kv = (getattr(layer, "keys", None), getattr(layer, "values", None))
    if all(torch.is_tensor(t) for t in kv):
        return "keys", kv
    raise LockstepError(f"matched calls: a decoder call left a {type(layer).__name__} cache "
                        "layer without K/V tensors; the lockstep cannot tie its state to the "
                        "call's output (train this model without fsdp or expert parallelism "
                        "across data-parallel groups)")

"""Keeping the ranks' FSDP collectives in step while each walks its own tree.

Under FSDP a decoder call all-gathers every layer's parameters (forward) and a backward
all-gathers them again and reduce-scatters the gradients. Each rank walks a different tree,
so the ranks make different sequences of calls — and collectives must be matched one for
one. This module pads each rank's sequence with dummy one-token calls (zero gradient) so
that every rank performs the same kind of event at the same time.

With the walker's *recompute* policy every decoder call is one of two events: **F**, a
forward without gradient (a push), or **X**, a forward with gradient whose backward follows
before the next call (a leaf, or a pop's re-forward). Each rank announces its next event
when it calls the decoder (:class:`LockstepDecoder`), or DONE after its walk; one all-reduce
(MIN over F < X < DONE) decides the round:

- some rank wants F: the F ranks forward, the others make a dummy F (the X ranks then
  announce again);
- else some rank wants X: the X ranks forward (and then backpropagate), the DONE ranks make
  a dummy X (forward + backward);
- all DONE: the session ends.

Every backward passes through the decoder's last hidden state (its K/V outputs are tied to
it with a zero gradient), so every layer's FSDP hooks fire in every X, real or dummy. Under
the *retain* policy a node's backward waits for its whole subtree, between other calls: such
a walk cannot be matched this way and is refused (:class:`LockstepError`). The walker is
untouched: the runtime hands it a model whose ``get_decoder()`` is the wrapper.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

F, X, DONE = 0, 1, 2


class LockstepError(RuntimeError):
    pass


class _Tie(torch.autograd.Function):
    """Identity on (hidden, *kv) whose backward always sends a gradient (zeros if none) to
    the hidden state and records that the call's backward ran."""

    @staticmethod
    def forward(ctx, sync, hidden, *kv):
        ctx.sync = sync
        return (hidden.view_as(hidden), *(t.view_as(t) for t in kv))

    @staticmethod
    def backward(ctx, dhidden, *dkv):
        ctx.sync.pending_backward = False
        return (None, dhidden, *dkv)  # grads are materialized: zeros where unused


class Lockstep:
    """One step's protocol state on this rank (see the module doc)."""

    def __init__(self, decoder, group=None):
        self.decoder, self.group = decoder, group
        self.active = False
        self.pending_backward = False
        self.rounds = 0

    def _decide(self, want: int) -> int:
        t = torch.tensor([want], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        self.rounds += 1
        return int(t)

    def _dummy(self, grad: bool) -> None:
        emb = self.decoder.get_input_embeddings()
        x = torch.zeros(1, 1, emb.weight.shape[1], dtype=emb.weight.dtype,
                        device=emb.weight.device, requires_grad=grad)
        pos = torch.zeros(1, 1, dtype=torch.long, device=x.device)
        with torch.set_grad_enabled(grad):
            h = self.decoder(inputs_embeds=x, position_ids=pos, use_cache=False).last_hidden_state
        if grad:
            torch.autograd.backward([h], [torch.zeros_like(h)])

    def _check_backward_done(self) -> None:
        if self.pending_backward:
            self.active = False
            raise LockstepError(
                "fsdp: a decoder call with gradient was not backpropagated before the next "
                "call; the ranks' FSDP collectives cannot be matched (walker.policy=retain "
                "keeps graphs across calls; use walker.policy=recompute or "
                "train.sharding=zero1)")

    def before_call(self) -> None:
        if not self.active:
            return
        self._check_backward_done()
        want = X if torch.is_grad_enabled() else F
        while True:
            kind = self._decide(want)
            if kind == want:
                break
            self._dummy(grad=False)  # a peer forwards without gradient (kind F < X)
        self.pending_backward = want == X

    def begin(self) -> None:
        self.active, self.pending_backward, self.rounds = True, False, 0

    def end(self) -> int:
        """After this rank's walk: follow the peers' remaining calls; returns the rounds."""
        self._check_backward_done()
        while True:
            kind = self._decide(DONE)
            if kind == DONE:
                break
            self._dummy(grad=kind == X)
        self.active = False
        return self.rounds


class LockstepDecoder(torch.nn.Module):
    """The decoder as the walker sees it: each call is announced (an F or an X), and the
    outputs of an X pass through :class:`_Tie`."""

    def __init__(self, decoder, sync: Lockstep):
        super().__init__()
        self.inner = decoder
        self.sync = sync

    def forward(self, *args, cache=None, **kwargs):
        self.sync.before_call()
        if cache is not None:
            kwargs["cache"] = cache
        out = self.inner(*args, **kwargs)
        if not (self.sync.active and torch.is_grad_enabled()):
            return out
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        layers = list(cache.layers) if cache is not None else []
        kv = [t for layer in layers for t in (layer.keys, layer.values)]
        hidden, *kv = _Tie.apply(self.sync, out.last_hidden_state, *kv)
        for i, layer in enumerate(layers):
            layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
        out.last_hidden_state = hidden
        return out

"""Expert parallelism: a group of ``E`` ranks holds every MoE layer's routed experts once.

Applied from outside, torchtitan style: ``parallelize_experts(model, group)`` replaces each MoE
layer's fused experts module (Hugging Face 5.x: ``block.experts`` with 3-D ``gate_up_proj``
[n, 2I, H] and ``down_proj`` [n, H, I], called as ``experts(hidden, top_k_index,
top_k_weights)``) by an :class:`ExpertSlice`: rank ``r`` keeps experts ``[r·n/E, (r+1)·n/E)``
(the parameters are replaced by their slices: 1/E of the expert weights per rank).

One call (a decoder forward of any rows):

1. each (token, k) pair is sent to its expert's owner (``all_to_all_single``; a header
   exchange first says how many rows go to each of the owner's experts, whether the
   requester will backpropagate them and the requester's call number);
2. the owner computes its experts on what it received and sends the outputs back;
3. the requester multiplies them by its top-k weights and adds them into its tokens' rows,
   locally -- so the router (replay and aux-loss hooks, ``dta.model.routing``) and its
   weight's gradient are untouched and stay on the requester.

**No autograd graph spans two ranks.** A walk backpropagates a call long after its forward
(``retain``: at the pack's pop), and the ranks of a data-parallel run walk different trees,
so a graph shared with a peer could not be backpropagated when the peer is not. The owner
keeps, for each call whose requester will backpropagate it (grad enabled), the rows it
received as a leaf and the small graph of its experts over them, keyed by (requester,
call number). The requester's graph holds one node per MoE layer (:class:`_Routed`); its
backward sends the output gradients to the owners with the call number, and every owner
*serves* whatever arrives -- backpropagates the stored graph of that (requester, call),
which accumulates its experts' ``.grad`` and gives the rows' input gradient -- and sends
the input gradients back. So every backward of any call on any rank is one exchange per MoE
layer (reverse layer order), whichever calls the peers' backwards belong to: the ranks only
have to make matching *numbers* of forward and backward calls, in the same order
(``runtime.engine.lockstep`` pads a rank where they differ; ranks of one context-parallel
group make the same calls anyway). Every expert FLOP of a call is made once, by its owner.

Gradients: a rank's expert slices collect its served rows' gradients -- its share of the
expert replicas' (the ranks holding the same slice) sum; the dense parameters are untouched
(their gradient is the requester's, as without expert parallelism).

Exactness: the same per-expert arithmetic as Hugging Face's eager experts loop, each token's
``k`` outputs added in expert order: float64 equal to the unsharded model within round-off.

Refused (:class:`ExpertParallelError`, one line): a model whose MoE layers do not hold their
experts as that fused module (or one with biases, transposed or interleaved weights, a post
norm, no gate or its own gate function), a number of experts not divisible by ``E``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["ExpertParallel", "ExpertParallelError", "ExpertSlice", "parallelize_experts",
           "expert_parallel_of"]

ATTRIBUTE = "_dta_expert_parallel"


class ExpertParallelError(ValueError):
    """Expert parallelism that cannot run exactly: refused before training."""


class ExpertParallel:
    """The expert-parallel group of a model, its MoE layers' slices and what was sent.

    ``sent_bytes``: bytes this rank sent to the other ranks (forward and backward, headers
    included); ``routed_rows``: the (token, k) rows this rank routed to their owners -- each
    forward's rows, and each backward's rows of output gradient (a recomputed call routes
    its rows again)."""

    def __init__(self, group):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ExpertParallelError("expert_parallel_group: torch.distributed is not initialized")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.layers: list[ExpertSlice] = []
        self.sent_bytes = 0
        self.collectives = 0
        self.routed_rows = 0
        self.errors: list[str] = []  # found inside a backward (raised by check(): no hang)

    @classmethod
    def of(cls, group) -> "ExpertParallel | None":
        """None for no group (or a group of one rank: nothing to divide)."""
        if group is None:
            return None
        if isinstance(group, ExpertParallel):
            return group
        ep = cls(group)
        return ep if ep.size > 1 else None

    def __deepcopy__(self, memo):  # a copy of a parallelized model exchanges on the same group
        return self

    # ------------------------------------------------------------- parameters --
    def expert_parameters(self) -> list[torch.nn.Parameter]:
        """The per-rank slices (each a piece of the whole ``[n, ...]`` tensor, dim 0)."""
        return [p for layer in self.layers for p in (layer.gate_up_proj, layer.down_proj)]

    def is_expert(self, p) -> bool:
        return any(p is q for q in self.expert_parameters())

    def slice_of(self, p) -> tuple[int, int, int]:
        """``(first, stop, whole)`` experts of dim 0 that the slice ``p`` holds."""
        for layer in self.layers:
            if p is layer.gate_up_proj or p is layer.down_proj:
                return layer.first, layer.first + layer.num_local, layer.num_experts
        raise KeyError("not an expert slice of this group")

    @torch.no_grad()
    def full_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The whole ``[n, ...]`` tensor of a slice ``t`` (a collective over the group)."""
        from dta.model.collectives import all_gather_single

        t = t.detach().contiguous()
        out = t.new_empty((t.shape[0] * self.size, *t.shape[1:]))
        all_gather_single(out, t, group=self.group)
        return out

    # --------------------------------------------------------- matched calls --
    def forward_exchanges(self) -> dict[int, list[Callable[[], None]]]:
        """Per decoder layer index, the exchanges one forward makes there, as calls that
        make them with no rows of this rank's own (a rank matching a peer's forward
        without one: ``runtime.engine.lockstep``); the peers' rows are served."""
        out: dict[int, list] = {}
        for layer in self.layers:
            out.setdefault(layer.layer_index, []).append(layer.empty_forward)
        return out

    def reset(self) -> int:
        """Drop what the owners keep for calls never backpropagated (a session's start);
        returns the rows dropped."""
        dropped = 0
        for layer in self.layers:
            dropped += sum(len(leaf) for leaf, _ in layer.store.values())
            layer.store.clear()
        return dropped

    def check(self) -> None:
        """Raise what a backward found (the exchanges went on, with zeros, so that no rank
        waits forever; the gradients are wrong)."""
        if self.errors:
            first, n = self.errors[0], len(self.errors)
            self.errors = []
            raise ExpertParallelError(f"expert parallel: {first}" + (f" (and {n - 1} more)"
                                                                     if n > 1 else ""))

    # ------------------------------------------------------------ collectives --
    def exchange(self, x: torch.Tensor, recv: list, sends: list) -> torch.Tensor:
        """One ``all_to_all_single`` of a flat buffer (``sends[p]`` elements to rank p,
        ``recv[p]`` from it)."""
        import torch.distributed as dist

        out = x.new_empty(sum(recv))
        dist.all_to_all_single(out, x.contiguous(), recv, sends, group=self.group)
        self.sent_bytes += (sum(sends) - sends[self.rank]) * x.element_size()
        self.collectives += 1
        return out


class ExpertSlice(torch.nn.Module):
    """One MoE layer's experts on one rank of the group: the slice ``[first, first +
    num_local)`` of the fused weights, and the forward of the whole layer's experts
    (module doc). Its parameters keep the names of the module it replaces."""

    def __init__(self, experts: torch.nn.Module, ep: ExpertParallel, layer_index: int,
                 name: str):
        super().__init__()
        n = int(experts.num_experts)
        self.num_experts, self.num_local = n, n // ep.size
        self.first = ep.rank * self.num_local
        self.hidden_dim = int(experts.gate_up_proj.shape[2])
        self.layer_index, self.name = int(layer_index), name
        self.act_fn = experts.act_fn
        for attr in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, attr)
            piece = whole.detach()[self.first:self.first + self.num_local].clone()
            setattr(self, attr, torch.nn.Parameter(piece, requires_grad=whole.requires_grad))
        object.__setattr__(self, "ep", ep)  # not a submodule
        self.store: dict = {}  # (requester, call) -> (rows as a leaf, outputs with graph)
        self.calls = 0

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.num_local - 1} of "
                f"{self.num_experts}, rank {self.ep.rank} of {self.ep.size}")

    # ---------------------------------------------------------------- forward --
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert: owners' rows contiguous
        order = order[flat.index_select(0, order) < self.num_experts]  # HF skips index n
        experts = flat.index_select(0, order)
        tokens = order // k
        x = hidden_states.index_select(0, tokens)
        keep = torch.is_grad_enabled()
        if keep and not x.requires_grad:  # every call with grad has this layer's backward
            x = x.detach().requires_grad_()
        self.ep.routed_rows += len(x)
        y = _Routed.apply(x, experts, keep, self)
        w = top_k_weights.reshape(-1).index_select(0, order)
        out = torch.zeros_like(hidden_states)
        return out.index_add_(0, tokens, (y * w[:, None]).to(out.dtype))

    def _experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's experts on rows sorted by local expert (``counts[j]`` rows of j)."""
        outs = []
        for j, rows in enumerate(x.split(counts)):
            if not counts[j]:
                continue
            gate, up = F.linear(rows, self.gate_up_proj[j]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[j]))
        return torch.cat(outs) if outs else x.new_empty(0, self.hidden_dim)

    def exchange_forward(self, x: torch.Tensor, counts: torch.Tensor, keep: bool,
                         call: int) -> tuple[torch.Tensor, list[int]]:
        """Rows ``x`` (``counts`` [E, local experts] of them to each owner's experts, in
        that order) out, the owners' outputs back; serves the peers' rows on the way.
        Returns (outputs, rows sent to each rank)."""
        ep, n_loc, H = self.ep, self.num_local, self.hidden_dim
        E = ep.size
        info = counts.new_tensor([int(keep), int(call)]).expand(E, 2)
        head = ep.exchange(torch.cat([counts, info], 1).reshape(-1), [n_loc + 2] * E,
                           [n_loc + 2] * E).view(E, n_loc + 2).tolist()
        sends = counts.sum(1).tolist()
        recv = [sum(h[:n_loc]) for h in head]
        xr = ep.exchange(x.reshape(-1), [r * H for r in recv], [s * H for s in sends])
        outs = []
        for p, rows in enumerate(xr.view(-1, H).split(recv)):
            if not recv[p]:
                continue
            per_expert = head[p][:n_loc]
            if head[p][n_loc]:  # the requester backpropagates it: keep its graph
                leaf = rows.detach().requires_grad_()
                with torch.enable_grad():
                    y = self._experts(leaf, per_expert)
                self.store[p, head[p][n_loc + 1]] = (leaf, y)
                outs.append(y.detach())
            else:
                with torch.no_grad():
                    outs.append(self._experts(rows, per_expert))
        yr = torch.cat(outs) if outs else xr.new_empty(0, H)
        y = ep.exchange(yr.reshape(-1), [s * H for s in sends], [r * H for r in recv])
        return y.view(-1, H), sends

    def empty_forward(self) -> None:
        """This layer's forward exchanges with no rows of this rank's (the peers' rows are
        served): a rank matching a peer's forward without making one."""
        p = self.gate_up_proj
        with torch.no_grad():
            self.exchange_forward(p.new_empty(0, self.hidden_dim),
                                  torch.zeros(self.ep.size, self.num_local, dtype=torch.long,
                                              device=p.device), False, -1)

    def exchange_backward(self, g: torch.Tensor, sends: list[int], call: int) -> torch.Tensor:
        """The gradient of the outputs of call ``call`` (rows sent as ``sends``) to their
        owners, the peers' served; returns the gradient of the rows."""
        ep, H, E = self.ep, self.hidden_dim, self.ep.size
        ep.routed_rows += sum(sends)
        head = ep.exchange(torch.tensor([[s, call] for s in sends], dtype=torch.long,
                                        device=g.device).reshape(-1), [2] * E, [2] * E)
        head = head.view(E, 2).tolist()
        recv = [h[0] for h in head]
        gr = ep.exchange(g.contiguous().reshape(-1), [r * H for r in recv], [s * H for s in sends])
        dx = []
        for p, rows in enumerate(gr.view(-1, H).split(recv)):
            if not recv[p]:
                continue
            entry = self.store.pop((p, head[p][1]), None)
            if entry is None or len(entry[0]) != recv[p]:
                ep.errors.append(f"{self.name}: rank {ep.rank} was sent the gradient of "
                                 f"{recv[p]} rows of rank {p}'s call {head[p][1]}, which it "
                                 "does not hold (the ranks' calls were not matched)")
                dx.append(torch.zeros_like(rows))
                continue
            leaf, y = entry
            torch.autograd.backward(y, rows)  # the experts' .grad and the rows' gradient
            dx.append(leaf.grad if leaf.grad is not None else torch.zeros_like(rows))
        dxr = torch.cat(dx) if dx else gr.new_empty(0)
        return ep.exchange(dxr.reshape(-1), [s * H for s in sends], [r * H for r in recv]).view(-1, H)


class _Routed(torch.autograd.Function):
    """The requester's side of one call of one MoE layer: rows (sorted by expert) to the
    owners and their outputs back; backward: the outputs' gradient out, the rows' back."""

    @staticmethod
    def forward(ctx, x, experts, keep: bool, layer: ExpertSlice):
        counts = torch.bincount(experts, minlength=layer.num_experts).view(layer.ep.size, -1)
        call = layer.calls
        layer.calls += 1
        y, sends = layer.exchange_forward(x.detach(), counts, keep, call)
        ctx.layer, ctx.sends, ctx.call = layer, sends, call
        return y

    @staticmethod
    def backward(ctx, g):
        return ctx.layer.exchange_backward(g, ctx.sends, ctx.call), None, None, None


# ------------------------------------------------------------------ applying it --
_REFUSED_FLAGS = (("has_bias", False, "biases"), ("is_transposed", False, "transposed weights"),
                  ("is_concatenated", True, "interleaved gate/up weights"),
                  ("has_post_expert_norm", False, "a norm after each expert"),
                  ("has_gate", True, "no gate projection"))


def _fused_experts(module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and gu.dim() == 3 and down.dim() == 3 and hasattr(module, "num_experts"))


def _check_experts(module, owner: str, name: str, size: int) -> None:
    for attr, need, what in _REFUSED_FLAGS:
        if bool(getattr(module, attr, need)) != need:
            raise ExpertParallelError(f"{owner}: expert parallel runs Hugging Face's fused "
                                      f"experts; {name} has {what}")
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        raise ExpertParallelError(f"{owner}: expert parallel runs Hugging Face's fused experts "
                                  f"with the default gate (act(gate) * up); {name} "
                                  f"({type(module).__name__}) has its own")
    n = int(module.num_experts)
    if n % size:
        raise ExpertParallelError(f"{owner}: expert parallel over {size} ranks needs a number "
                                  f"of experts divisible by {size}; {name} has {n}")


def parallelize_experts(model, expert_parallel_group):
    """Apply expert parallelism to ``model`` from outside: each MoE layer's experts become
    this rank's slice, their calls exchanged over ``expert_parallel_group`` (a
    ``torch.distributed`` group or an :class:`ExpertParallel`; None or one rank: nothing
    changes). Every rank of the group must hold the same model. Returns the model."""
    ep = ExpertParallel.of(expert_parallel_group)
    if ep is None:
        return model
    if getattr(model, ATTRIBUTE, None) is not None:
        raise ExpertParallelError(f"{type(model).__name__}: expert parallelism is applied already")
    owner = type(model).__name__
    decoder = model.get_decoder()
    found = []
    for i, layer in enumerate(getattr(decoder, "layers", [])):
        for name, module in list(layer.named_modules()):
            if not name or not _fused_experts(module):
                continue
            full = f"layers.{i}.{name}"
            _check_experts(module, owner, full, ep.size)
            parent_name, _, attr = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            piece = ExpertSlice(module, ep, i, full)
            setattr(parent, attr, piece)
            found.append(piece)
    if not found:
        raise ExpertParallelError(f"{owner}: expert parallel needs MoE layers whose routed "
                                  "experts are one fused module (block.experts with 3-D "
                                  "gate_up_proj and down_proj, Hugging Face 5.x); this model "
                                  "has none")
    ep.layers = found
    object.__setattr__(model, ATTRIBUTE, ep)
    return model


def expert_parallel_of(model) -> ExpertParallel | None:
    """The group ``model``'s experts are divided over, or None."""
    return getattr(model, ATTRIBUTE, None)

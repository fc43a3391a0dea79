"""Context parallelism: a group of ``C`` ranks walks one tree, each doing ~1/C of the work.

Every rank of the group plans and walks the same packs and blocks, but a pack's ``T`` rows
are divided (Ulysses over the tree):

* **Rows** (:meth:`ContextParallel.rows`): rank ``r`` runs everything outside attention --
  the embedding lookup, norms, projections, MLPs and MoE experts (routing its own tokens),
  the LM head and the loss -- on rows ``[r·T // C, (r+1)·T // C)`` only, at their true
  positions. A rank with no row of a short pack forwards one phantom row whose outputs no
  one reads (``dta.model.placement.PackPart``), so that every rank makes the same calls.
* **Heads** (:mod:`dta.model.cp_attention`): inside each attention call one all-to-all turns
  the rows' q/k/v (all heads) into every row of the pack for this rank's heads; the
  attention runs over the path's K/V of those heads -- stored *split by heads*, every path
  row, so each rank keeps ~1/C of the path's K/V and of their gradient accumulators -- and
  the pack's own K/V, under the pack's tree mask and window; one all-to-all turns the output
  back into rows. Where ``C`` exceeds the K/V heads, the ``C / KV`` ranks sharing a head
  split its rows and the row owners merge their partial outputs by log-sum-exp. The bytes
  of one call are ∝ the pack's tokens × hidden size, never the path's length.
* **Gated DeltaNet** (:mod:`dta.model.cp_gdn`): split the same way by value head (the conv
  is depthwise per channel, the recurrence per head): projections on own rows, all-to-all
  to own heads' channels, the conv and the delta rule over every row for own heads, back to
  rows before ``out_proj``; the handed-on states are stored per head.
* **MoE**: each rank routes its own rows; the router aux loss's per-row counts and
  probabilities (rows × experts, small) are gathered over the group
  (``dta.model.router_aux``).
* **Loss**: each rank evaluates its own rows' loss terms; the walk's loss is summed over the
  group, recorded log-probs are combined (an opaque sequence loss is linearized on the full
  log-probs, then each rank trains its own rows' coefficients).

Autograd runs through the collectives (:class:`AllToAll`), so every rank's backward makes
the same collectives in the same order (a pack's collectives form one chain; the walk
backpropagates the same packs on every rank). **Each rank's parameter gradient is a partial
sum** -- its rows, its heads -- and the group's gradient is the sum over its ranks:
``partial_gradients`` says so to the runtime, which sums over the whole world.

Applied from outside, torchtitan style: ``parallelize_context(model, group)`` puts a
placement (:class:`Spread`) on the model; the walker and the model interface see only the
placement (``dta.model.placement``), never the group.
"""
from __future__ import annotations

import weakref

import torch

from dta.model.placement import ATTRIBUTE, ContextParallelError, PackPart, Whole

__all__ = ["ContextParallel", "ContextParallelError", "Spread", "parallelize_context",
           "context_parallel_of"]


class ContextParallel:
    """The group a walk is divided over, its collectives, and what this rank sent
    (``sent_bytes``: bytes it sent to the other ranks, forward and backward) and stored
    (``path_bytes``: its path K/V leaves and their gradients alive now; ``path_bytes_peak``)."""

    partial_gradients = True  # each rank's gradient is its rows' and heads' share: sum them

    def __init__(self, group):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ContextParallelError("context_parallel_group: torch.distributed is not "
                                       "initialized")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # where the group's small sums travel: NCCL takes CUDA tensors only
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if "nccl" in str(dist.get_backend(group)).lower() else torch.device("cpu")
        self.sent_bytes = 0
        self.collectives = 0
        self.exchanges = 0  # all-to-all exchanges made in forward (their tags: AllToAll)
        self.mismatched = None  # backward exchanges that met another exchange's tag
        self.path_bytes = 0
        self.path_bytes_peak = 0

    @classmethod
    def of(cls, group) -> "ContextParallel | None":
        """None for no group (or a group of one rank: nothing to divide)."""
        if group is None:
            return None
        if isinstance(group, ContextParallel):  # given explicitly: used even for one rank
            return group
        cp = cls(group)
        return cp if cp.size > 1 else None

    def __deepcopy__(self, memo):  # a copy of a parallelized model walks on the same group
        return self

    # ------------------------------------------------------------------ rows --
    def rows(self, n: int) -> tuple[int, int]:
        """This rank's rows of an ``n``-row pack: ``[r·n // C, (r+1)·n // C)``."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def part(self, n: int) -> PackPart:
        return PackPart(int(n), *self.rows(int(n)))

    def _lengths(self, n: int) -> list[int]:
        return [(r + 1) * n // self.size - r * n // self.size for r in range(self.size)]

    # ------------------------------------------------------------ collectives --
    def rows_to_heads(self, x: torch.Tensor, columns: list, part: PackPart) -> torch.Tensor:
        """``x`` [forward rows, F] -> [T, F_mine]: every rank's real rows of the columns
        ``columns[rank]`` (a LongTensor per rank) -- this rank's heads -- in row order."""
        T, mine = part.tokens, columns[self.rank]
        x = x[: part.real]
        if self.size == 1:
            return x.index_select(1, mine)
        sends = torch.cat([x.index_select(1, c).reshape(-1) for c in columns])
        width = len(mine)
        recv = [n * width for n in self._lengths(T)]
        return AllToAll.apply(sends, recv, [part.real * len(c) for c in columns], self).view(T, width)

    def heads_to_rows(self, y: torch.Tensor, widths: list[int], part: PackPart) -> list:
        """``y`` [T, F_mine] -> per rank p: [real rows, widths[p]] (p's columns of this rank's
        rows): the inverse exchange of :meth:`rows_to_heads`."""
        if self.size == 1:
            return [y[part.lo: part.hi]]
        y = y.contiguous()
        sends = [n * y.shape[1] for n in self._lengths(part.tokens)]
        out = AllToAll.apply(y.reshape(-1), [part.real * w for w in widths], sends, self)
        return [b.view(part.real, w) for b, w in zip(out.split([part.real * w for w in widths]),
                                                     widths)]

    def gather_rows(self, x: torch.Tensor, part: PackPart) -> torch.Tensor:
        """[T, ...] from every rank's real rows ``x`` [real, ...] (no gradient)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        width = -(-part.tokens // self.size)
        x, device = x.detach().to(self.device), x.device
        padded = torch.cat([x, x.new_zeros(width - len(x), *x.shape[1:])]).contiguous()
        out = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(out, padded, group=self.group)
        self._sent(padded.numel() * padded.element_size())
        return torch.cat([o[:n] for o, n in zip(out, self._lengths(part.tokens))]).to(device)

    def combine(self, tensors: list) -> None:
        """Sum ``tensors`` over the group, in place (one collective)."""
        if self.size == 1 or not tensors:
            return
        import torch.distributed as dist

        flat = torch.cat([t.reshape(-1).to(self.device, torch.float64) for t in tensors])
        dist.all_reduce(flat, group=self.group)
        self._sent(flat.numel() * flat.element_size())
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view(t.shape))

    def total(self, value: float) -> float:
        """``value`` summed over the group (the walk's end: the exchanges' tags are checked)."""
        if self.mismatched is not None:
            bad, self.mismatched = int(self.mismatched), None
            if bad:
                raise ContextParallelError(
                    f"context parallel: {bad} backward exchanges of rank {self.rank} met "
                    "another exchange of a peer: the ranks backpropagated different graphs or "
                    "in different orders (the gradients are wrong)")
        t = torch.tensor([float(value)], dtype=torch.float64)
        self.combine([t])
        return float(t[0])

    def sum_gradients(self, model, exclude=()) -> None:
        """The group's gradient on every rank: each trainable parameter's ``.grad`` summed
        over the group (a parameter no rank has a gradient for stays None; ``exclude``:
        parameters left as they are, e.g. expert slices, whole on their rank). For
        verification and benchmarks; a runtime reduces over its whole world instead."""
        skip = {id(p) for p in exclude}
        params = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float64)
        self.combine([has])
        grads = []
        for p, h in zip(params, has.tolist()):
            if h and p.grad is None:
                p.grad = torch.zeros_like(p)
            if h:
                grads.append(p.grad)
        self.combine(grads)

    def _sent(self, nbytes: int) -> None:
        self.sent_bytes += int(nbytes) * (self.size - 1)
        self.collectives += 1

    # ------------------------------------------------------------ path memory --
    def count(self, t: torch.Tensor) -> None:
        """Count ``t`` in :attr:`path_bytes` until it is freed."""
        n = t.numel() * t.element_size()
        self.path_bytes += n
        self.path_bytes_peak = max(self.path_bytes_peak, self.path_bytes)
        weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.path_bytes -= n

    def _count_grad(self, leaf: torch.Tensor) -> None:
        if getattr(leaf, "_dta_counted", None) is not leaf.grad:  # a new gradient tensor
            leaf._dta_counted = leaf.grad
            self.count(leaf.grad)


class AllToAll(torch.autograd.Function):
    """One ``all_to_all_single`` of a flat buffer (``sends[p]`` elements to rank p,
    ``recv[p]`` from it); its backward is the reverse exchange of the gradient.

    Every rank's backward must run the exchanges in the same order (the walk backpropagates
    the same packs on every rank; autograd runs one pack's exchanges in the order their data
    depend on each other, and a later pack's before an earlier one's). That is checked, not
    assumed: each exchange is tagged with its forward's place in the rank's sequence of
    exchanges, and its backward sends the tag along with the gradient; a peer's tag that
    differs is counted (on the device: no wait) and raised at the walk's end
    (:meth:`ContextParallel.total`), before any gradient is used."""

    @staticmethod
    def forward(ctx, x, recv: list, sends: list, cp: ContextParallel):
        ctx.recv, ctx.sends, ctx.cp = recv, sends, cp
        cp.exchanges += 1
        ctx.tag = 1 + cp.exchanges % 251  # exact in every float dtype (bfloat16 included)
        return _exchange(x, recv, sends, cp)

    @staticmethod
    def backward(ctx, g):
        cp, tag = ctx.cp, ctx.tag
        sends, recv = ctx.recv, ctx.sends  # the reverse exchange, one tag after each share
        stamp = g.new_full((1,), float(tag))
        g = torch.cat([x for part in g.contiguous().split(sends) for x in (part, stamp)])
        got = _exchange(g, [n + 1 for n in recv], [n + 1 for n in sends], cp).split(
            [n + 1 for n in recv])
        wrong = torch.stack([x[-1] for x in got]) != tag
        cp.mismatched = wrong.sum() if cp.mismatched is None else cp.mismatched + wrong.sum()
        return torch.cat([x[:-1] for x in got]), None, None, None


def _exchange(x: torch.Tensor, recv: list, sends: list, cp: ContextParallel) -> torch.Tensor:
    import torch.distributed as dist

    out = x.new_empty(sum(recv))
    dist.all_to_all_single(out, x.contiguous(), recv, sends, group=cp.group)
    cp.sent_bytes += (sum(sends) - sends[cp.rank]) * x.element_size()
    cp.collectives += 1
    return out


# ------------------------------------------------------------------ the placement --
class Spread(Whole):
    """The placement of a model whose walks are divided over a context-parallel group:
    ``dta.model.placement``'s protocol, answered by the group (rows, heads, collectives)."""

    partial_gradients = True

    def __init__(self, cp: ContextParallel, heads: int, kv_heads: int):
        from dta.model.cp_attention import HeadSplit

        self.cp, self.size = cp, cp.size
        self.heads = HeadSplit(heads, kv_heads, cp.size, cp.rank)
        self._gdn: dict = {}

    def __deepcopy__(self, memo):  # a copy of a parallelized model walks on the same group
        return self

    def part(self, tokens: int) -> PackPart:
        return self.cp.part(tokens)

    def kv_rows(self, tokens: int) -> tuple[int, int]:
        return self.heads.kv_rows(int(tokens))

    def attention_layer(self, parts: list, layout):
        from dta.model.cp_attention import SplitHeadsLayer

        return SplitHeadsLayer(parts, self, layout)

    def recurrent_layer(self, initial, plan, positions: int):
        from dta.model.cp_gdn import SplitStateLayer

        return SplitStateLayer(initial, plan, positions, self)

    def gdn_split(self, module):
        from dta.model.cp_gdn import GDNSplit

        key = (module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)
        if key not in self._gdn:
            self._gdn[key] = GDNSplit(module, self.cp.size, self.cp.rank)
        return self._gdn[key]

    def mask(self, layout, model, device, dtype, support):
        from dta.model.cp_attention import pack_views

        return pack_views(layout, model, device, support)

    def total(self, value: float) -> float:
        return self.cp.total(value)

    def combine(self, tensors: list) -> None:
        self.cp.combine(tensors)

    def gather_rows(self, x: torch.Tensor, part: PackPart) -> torch.Tensor:
        return self.cp.gather_rows(x, part)

    def stored(self, leaves: list, kinds: list) -> list:
        """Count the attention K/V leaves (and their gradients, once they have one) in
        ``cp.path_bytes``."""
        for kind, layer in zip(kinds, leaves):
            if kind != "attention":
                continue
            for x in layer:
                self.cp.count(x)
                if x.requires_grad:
                    x.register_post_accumulate_grad_hook(self.cp._count_grad)
        return leaves


def parallelize_context(model, context_parallel_group):
    """Apply context parallelism to ``model`` from outside (torchtitan style): its walks are
    divided over ``context_parallel_group`` (a ``torch.distributed`` process group, or a
    :class:`ContextParallel`); None or a group of one rank removes it. Every rank of the
    group must hold the same model and walk the same batch with the same settings; each
    rank's gradient is then its share (``partial_gradients``). Returns the model."""
    cp = ContextParallel.of(context_parallel_group)
    if cp is None:
        if hasattr(model, ATTRIBUTE):
            delattr(model, ATTRIBUTE)
        return model
    name = type(model).__name__
    kind = getattr(model.config, "_attn_implementation", None)
    if kind not in ("sdpa", "dta_sdpa"):
        raise ContextParallelError(f"{name}: context parallel needs attention implementation "
                                   f"'sdpa' (run as 'dta_sdpa'), not {kind!r}")
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
        else model.config
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    value_heads = getattr(cfg, "linear_num_value_heads", None)
    from dta.model.recurrent import is_hybrid

    if is_hybrid(model) and value_heads is not None and cp.size > int(value_heads):
        raise ContextParallelError(f"{name}: context parallel over {cp.size} ranks splits each "
                                   f"Gated DeltaNet layer's {value_heads} value heads over the "
                                   f"group; at most {value_heads} ranks")
    object.__setattr__(model, ATTRIBUTE, Spread(cp, heads, kv))
    return model


def context_parallel_of(model) -> ContextParallel | None:
    """The group ``model``'s walks are divided over, or None."""
    placement = getattr(model, ATTRIBUTE, None)
    return placement.cp if isinstance(placement, Spread) else None

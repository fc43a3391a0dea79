"""Context-parallel Gated DeltaNet: a pack's rows in, this rank's value heads over every row,
rows out (``dta.model.gdn.pack_forward`` runs the same code on either placement).

A GDN layer's conv is depthwise (one filter per channel) and its delta rule runs per value
head, so both divide by head: rank ``p`` holds value heads ``[p·Hv // C, (p+1)·Hv // C)``
(``C <= Hv``), the key heads they read (value head h reads key head h // (Hv / Hk), as
Qwen3.5's ``repeat_interleave`` does: a key head read by two ranks' value heads is
computed by both, and its gradient is the sum of theirs), and the conv channels of those
heads (q and k channels of its key heads, v channels of its value heads). The rows'
projections (own rows) go through one all-to-all to every row of those channels; the conv,
the delta rule and the gated norm run over every row of the pack for them; one all-to-all
returns the output to the row owners before ``out_proj``. The handed-on states are the
rank's channels and heads: ~1/C of a layer's (a shared key head's conv channels on each
rank that reads it).
"""
from __future__ import annotations

import torch

from dta.model.hf_cache import PackStateLayer
from dta.model.placement import ContextParallelError


class GDNSplit:
    """A GDN layer's heads and channels on each of ``size`` ranks (module docstring)."""

    def __init__(self, module, size: int, rank: int):
        Hk, Hv = int(module.num_k_heads), int(module.num_v_heads)
        dk, dv = int(module.head_k_dim), int(module.head_v_dim)
        if Hv % Hk or size > Hv:
            raise ContextParallelError(f"context parallel over {size} ranks: a Gated DeltaNet "
                                       f"layer of {Hv} value heads over {Hk} key heads")
        ratio, key_dim, value_dim = Hv // Hk, Hk * dk, Hv * dv
        conv_dim = 2 * key_dim + value_dim
        ar = torch.arange
        self.columns, self.widths = [], []
        for p in range(size):
            v0, v1 = p * Hv // size, (p + 1) * Hv // size
            k0, k1 = v0 // ratio, (v1 - 1) // ratio + 1
            channels = torch.cat([ar(k0 * dk, k1 * dk), key_dim + ar(k0 * dk, k1 * dk),
                                  2 * key_dim + ar(v0 * dv, v1 * dv)])
            self.columns.append(torch.cat([channels, conv_dim + ar(v0 * dv, v1 * dv),
                                           conv_dim + value_dim + ar(v0, v1),
                                           conv_dim + value_dim + Hv + ar(v0, v1)]))
            self.widths.append((v1 - v0) * dv)
            if p == rank:
                self.channels, self.value_heads = channels, (v0, v1)
                self.key_dim, self.value_dim = (k1 - k0) * dk, (v1 - v0) * dv
                self.key_of_value = torch.as_tensor([v // ratio - k0 for v in range(v0, v1)])
        self.dv = dv
        self._device: dict = {}

    def on(self, device) -> "GDNSplit":
        """Index tensors on ``device`` (moved once)."""
        key = str(device)
        if key not in self._device:
            self._device[key] = (self.channels.to(device), self.key_of_value.to(device),
                                 [c.to(device) for c in self.columns])
        return self._device[key]


class RankHeads:
    """One pack's GDN layer on this rank: the exchanges and the parameter slices
    ``dta.model.gdn.pack_forward`` asks a head split for."""

    def __init__(self, split: GDNSplit, part, cp, device):
        self.split, self.part, self.cp = split, part, cp
        self._channels, self._key_of_value, self._columns = split.on(device)
        self.key_dim, self.value_dim = split.key_dim, split.value_dim

    def to_heads(self, mixed, z, b, a):
        """Own rows' projections ([rows, conv_dim], [rows, Hv, dv], [rows, Hv] x 2) -> every
        row of this rank's channels and heads."""
        rows = mixed.shape[0]
        x = torch.cat([mixed, z.reshape(rows, -1), b, a], dim=1)
        x = self.cp.rows_to_heads(x, self._columns, self.part)
        T, ch, hv = self.part.tokens, len(self._channels), self.value_dim // self.split.dv
        mixed, z, b, a = x.split([ch, self.value_dim, hv, hv], dim=1)
        return mixed, z.reshape(T, hv, self.split.dv), b, a

    def channels(self, w):
        return None if w is None else w.index_select(0, self._channels)

    def heads(self, p):
        v0, v1 = self.split.value_heads
        return p[v0:v1]

    def queries(self, query, key):
        """q, k of this rank's key heads -> one per value head."""
        return query.index_select(1, self._key_of_value), key.index_select(1, self._key_of_value)

    def to_rows(self, core):
        """[T, value heads · dv] of this rank -> [own rows, Hv · dv] (the phantom row: 0)."""
        blocks = self.cp.heads_to_rows(core, self.split.widths, self.part)
        return self.part.pad(torch.cat(blocks, dim=1), 0)


class SplitStateLayer(PackStateLayer):
    """A GDN layer's cache over a pack under context parallelism: the initial state and the
    handed-on states are this rank's channels and heads (:class:`GDNSplit`)."""

    def __init__(self, initial, plan, positions: int, spread):
        super().__init__(initial, plan, positions)
        self.spread = spread
        self.part = spread.part(plan.tokens)

    def heads(self, module) -> RankHeads:
        return RankHeads(self.spread.gdn_split(module), self.part, self.spread.cp,
                         module.A_log.device)

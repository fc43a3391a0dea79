"""AReaL's batches and losses as the engine core's walks (``DTATrainEngine``'s ``train_batch``
/ ``eval_batch`` / ``forward_batch``), and AReaL's logits-level ``forward_backward_batch``.

A batch is walked as one prefix tree, so a prefix shared by many sequences is forwarded
once; the core walks it (``EngineCore.walk_sequences``: a forward-only walk records every
sequence's log-probs, entropies and logit min/max, AReaL's ``loss_fn`` runs once per
sequence on them -- in AReaL's packed layout, inside a :class:`dta.losses.SequenceLoss` --,
is linearized, and a training walk backpropagates the linear surrogate, which has the same
gradient). This module translates: AReaL's padded batch into a ``dta.batch.Batch`` (each
sequence with its wrap label), its loss and weights into a sequence loss, and the core's
log-probs and tree stats back into AReaL's layout.
"""
from __future__ import annotations

import torch

from dta.losses import SequenceLoss
from runtime.areal import convert
from runtime.engine import comm

__all__ = ["WalksMixin"]


class WalksMixin:
    """The walks (needs ``core``: the engine core; ``config``, ``device``, ``groups``)."""

    # AReaL (after 1.0.4) hands R3 routing to an engine with ``_r3_enabled`` through these
    # attributes (areal/engine/r3/transport.py: PPOActor pops the keys from the batch and sets
    # them around each forward / train_batch call); 1.0.4 leaves the keys in the batch.
    _r3_enabled = True
    _r3_pending_routed_experts = None
    _r3_pending_valid = None

    def _sequences(self, input_, device=None):
        """(token ids, one-sequence micro-batches, replayed routing or None, split metadata)."""
        batched, meta = convert.normalize_input(input_)
        if self._r3_pending_routed_experts is not None or self._r3_pending_valid is not None:
            if any(k in batched for k in convert.ROUTING_KEYS):
                raise ValueError("R3 routing given twice: in the batch ('routed_experts') and "
                                 "through AReaL's side channel (_r3_pending_routed_experts)")
            batched["routed_experts"] = self._r3_pending_routed_experts
            if self._r3_pending_valid is not None:
                batched["r3_routing_valid"] = self._r3_pending_valid
        routing = convert.take_routing(batched)
        ids, mbs = convert.split_sequences(batched, model_type=self._model_type(), device=device)
        return ids, mbs, routing, meta

    def _loss_scales(self, mbs, loss_weight_fn) -> list[float]:
        """``loss_weight_fn(mb) / Σ_all loss_weight_fn`` per sequence, the total computed as
        FSDPEngine does (in float32 -- exact for token counts --, summed over the
        data-parallel ranks), the ratio in float64. FSDPEngine also
        multiplies by the data-parallel size and averages the ranks' gradients; the core
        sums them (each rank's gradient is its share of the whole batch's): the same
        gradient."""
        weights = [loss_weight_fn(mb) for mb in mbs]
        total = torch.stack([torch.as_tensor(w) for w in weights]).sum().detach().clone().to(
            dtype=torch.float32, device=self.device)
        comm.all_reduce(total, self.groups.data)
        if not total > 0:
            raise ValueError(f"the total loss weight of the batch is {float(total)}; it must be "
                             "positive (does any sequence have a trainable token?)")
        # the ratio in float64 (FSDPEngine's float32 ratio would round each weight)
        return [0.0 if w == 0 else float(w) / float(total) for w in weights]

    def _walk(self, ids, routing=None, *, scales=None, loss=None, train: bool = False):
        """The core's walks of AReaL's sequences (each with its wrap label); records the
        walked tree's stats for ``export_stats``."""
        cfg = self.config
        labels = [convert.wrap_label(s, pad_to_maximum=cfg.pad_to_maximum,
                                     max_tokens_per_mb=cfg.mb_spec.max_tokens_per_mb) for s in ids]
        batch = convert.walk_batch(ids, scales, labels=labels, routing=routing,
                                   max_positions=getattr(self.model.config,
                                                         "max_position_embeddings", None))
        res = self.core.walk_sequences(batch, loss, train=train, reduction="sum",
                                       minmax=loss is not None, counted=[len(s) for s in ids])
        t = res.tree
        self._last = dict(tree_token_ratio=float(t.sharing_ratio),
                          tree_total_tokens=float(t.total_tokens),
                          tree_unique_tokens=float(t.unique_tokens),
                          tree_sequences=float(t.sequences), tree_depth=float(t.depth),
                          dta_forwarded_tokens=float(res.forwarded_tokens))
        if loss is not None:
            self._last["dta_loss"] = float(res.loss)
        return res

    def _walk_loss(self, ids, mbs, loss_fn, scales, *, train: bool, routing=None
                   ) -> list[torch.Tensor]:
        """``loss_fn`` once per sequence (scaled by its weight) on the forward walk's tensors
        in AReaL's layout; with ``train``, the gradient of the scaled sum accumulated.
        Returns the scaled losses."""
        temperature = float(self.config.temperature)
        lengths = [len(s) for s in ids]
        values: list[torch.Tensor] = []

        def per_sequence(lp, ent, fields):
            i = int(fields[convert.SEQ_INDEX][0])
            if scales[i] == 0:  # FSDPEngine skips loss_fn for a zero-weight micro-batch
                return lp.sum() * 0.0
            n = lengths[i]
            # AReaL reports the min/max of the raw logits; the walker's are divided by T
            vmin = (convert.areal_view(fields["vocab_min"], n) * temperature).float()
            vmax = (convert.areal_view(fields["vocab_max"], n) * temperature).float()
            loss = loss_fn(convert.areal_view(lp, n), convert.areal_view(ent, n), mbs[i],
                           vocab_min_logits=vmin, vocab_max_logits=vmax)
            values.append((loss * scales[i]).detach())
            return loss

        self._walk(ids, routing, scales=scales, train=train,
                   loss=SequenceLoss(per_sequence, (convert.SEQ_INDEX,)))
        return values or [torch.zeros((), device=self.device)]

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        """AReaL's micro-batch interface, forward only and without prefix sharing: for each
        micro-batch the packed logits ``[T, V]`` (every packed segment, padding included,
        forwarded on its own by the core -- ``EngineCore.logits`` --, so sequences never
        attend to each other), then ``process_output_fn(logits, ctx)`` with FSDPEngine's
        context keys. AReaL calls it only inside an engine's own ``train_batch`` /
        ``eval_batch`` / ``forward_batch``, which are DTA's depth-first walks here: training
        through it (``forward_only=False``) is refused, and so is a forward where the ranks'
        model calls are kept matched (``fsdp``)."""
        self._require_model()
        layout = self.core.layout
        if not forward_only or self.core.matched_calls:
            raise NotImplementedError(
                f"forward_backward_batch(forward_only={forward_only}) under "
                f"actor.dta.sharding={layout.sharding} on {layout.world} rank(s): DTA trains "
                "and evaluates by depth-first walks: use train_batch / forward_batch / "
                "eval_batch" + ("" if not forward_only else " (a forward-only call runs "
                                "where the ranks' model calls need not match: not fsdp)"))
        for item in mb_list:
            padded = item.padded_mb
            ids = padded["input_ids"].reshape(-1).to(self.device)
            pos = padded.get("position_ids")
            pos = None if pos is None else pos.reshape(-1).to(self.device)
            cu = [int(c) for c in padded["cu_seqlens"]]
            logits = torch.cat([self.core.logits(ids[a:b], torch.arange(b - a, device=self.device)
                                                 if pos is None else pos[a:b])
                                for a, b in zip(cu[:-1], cu[1:]) if b > a])
            ctx = dict(model_inputs=padded, mb_input=item.orig_mb,
                       pad_length=item.padding_length, ulysses_pad_size=0, trie_node=None)
            process_output_fn(logits, ctx)

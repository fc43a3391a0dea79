"""The depth-first walks behind ``DTATrainEngine``'s ``train_batch`` / ``eval_batch`` /
``forward_batch``, and AReaL's logits-level ``forward_backward_batch``.

A batch is walked as one prefix tree, so a prefix shared by many sequences is forwarded once:

1. a forward-only walk records every sequence's log-probs, entropies and logit min/max;
2. each sequence's AReaL loss is evaluated on them (``loss_fn`` once per sequence, in AReaL's
   packed layout, inside a :class:`dta.losses.SequenceLoss`) and linearized (its gradient with
   respect to the log-probs and entropies: ``dta.objective.linearize``);
3. a training walk backpropagates that linear surrogate, which has the same gradient.
"""
from __future__ import annotations

import torch

from dta.losses import SequenceLoss
from dta.model.routing import MoERouters, check_routing
from dta.objective import linearize
from dta.tree import PrefixTree
from runtime.areal import convert
from runtime.engine import comm

__all__ = ["WalksMixin"]


class WalksMixin:
    """The walks (needs ``core``: the engine core, whose walker walks with the run's
    WalkOptions; ``model``, ``config``, ``walk``, ``device``, ``groups``)."""

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

    def _walk_batch(self, ids, scales=None, routing=None):
        cfg = self.config
        labels = [convert.wrap_label(s, pad_to_maximum=cfg.pad_to_maximum,
                                     max_tokens_per_mb=cfg.mb_spec.max_tokens_per_mb) for s in ids]
        batch = convert.walk_batch(ids, scales, labels=labels, max_positions=self._max_positions(),
                                   routing=routing)
        batch.validate(vocab_size=self.model.config.vocab_size,
                       max_positions=self._max_positions(), required=(convert.SEQ_INDEX,))
        check_routing(batch, MoERouters(self.model))  # the model's MoE layers, k, experts
        return batch

    def _walk(self, ids, mbs, loss_fn, scales, *, train: bool, routing=None) -> list[torch.Tensor]:
        """Evaluate ``loss_fn`` once per sequence (scaled) on the forward walk's tensors; with
        ``train``, accumulate the exact gradient of the scaled sum by a training walk."""
        batch = self._walk_batch(ids, scales, routing)
        walker = self.core.walker()
        tree = PrefixTree(batch.input_ids, min_shared=self.walk.min_shared)
        fwd = walker.forward(tree, batch, minmax=True)
        temperature = float(self.config.temperature)
        lengths = [len(s) for s in ids]
        values: list[torch.Tensor] = []

        def per_sequence(lp, ent, fields):
            i = int(fields[convert.SEQ_INDEX][0])
            if scales[i] == 0:  # FSDPEngine skips loss_fn for a zero-weight micro-batch
                return lp.sum() * 0.0
            n = lengths[i]
            # AReaL reports the min/max of the raw logits; the walker's are divided by T
            vmin = (convert.areal_view(fwd.vocab_min[i], n) * temperature).float()
            vmax = (convert.areal_view(fwd.vocab_max[i], n) * temperature).float()
            loss = loss_fn(convert.areal_view(lp, n), convert.areal_view(ent, n), mbs[i],
                           vocab_min_logits=vmin, vocab_max_logits=vmax)
            values.append((loss * scales[i]).detach())
            return loss

        loss = SequenceLoss(per_sequence, (convert.SEQ_INDEX,))
        forwarded = fwd.tokens
        if train:
            with torch.enable_grad():
                objective, total = linearize(batch, loss, "sum", fwd.logprobs, fwd.entropy)
                res = walker.train(tree, objective)
            forwarded += res.tokens + res.recomputed_tokens
        else:
            _, total = linearize(batch, loss, "sum", fwd.logprobs, fwd.entropy)
        self._record_tree(ids, tree, forwarded, loss=total)
        return values or [torch.zeros((), device=self.device)]

    def _record_tree(self, ids, walked: PrefixTree, forwarded: int, loss: float | None = None):
        stats = PrefixTree(ids, min_shared=self.walk.min_shared).stats()
        self._last = dict(tree_token_ratio=float(stats.sharing_ratio),
                          tree_total_tokens=float(stats.total_tokens),
                          tree_unique_tokens=float(stats.unique_tokens),
                          tree_sequences=float(stats.sequences),
                          tree_depth=float(stats.depth),
                          dta_forwarded_tokens=float(forwarded))
        if loss is not None:
            self._last["dta_loss"] = float(loss)

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False):
        """AReaL's micro-batch interface, without prefix sharing: for each micro-batch the
        packed logits ``[T, V]`` (every packed segment, padding included, forwarded on its own,
        so sequences never attend to each other), then ``process_output_fn(logits, ctx)`` with
        FSDPEngine's context keys, and ``backward()`` on its result unless ``forward_only``.
        ``train_batch`` / ``forward_batch`` / ``eval_batch`` are the DFS paths.

        Training through it runs on one process, replicated (the core sums the ranks'
        gradients, which ``train_batch`` scales for; the sharded modes hold no whole
        gradient); forward-only it runs wherever the ranks' model calls need not be matched
        (not under ``fsdp``)."""
        self._require_model()
        layout = self.core.layout
        if self.core.matched_calls or (not forward_only and (layout.world > 1
                                                             or layout.sharded)):
            raise NotImplementedError(
                f"forward_backward_batch(forward_only={forward_only}) under "
                f"actor.dta.sharding={layout.sharding} on {layout.world} rank(s): use "
                "train_batch / forward_batch / eval_batch (the DFS walks), or one replicated "
                "process")
        for item in mb_list:
            padded = item.padded_mb
            ids = padded["input_ids"].reshape(-1).to(self.device)
            pos = padded.get("position_ids")
            pos = None if pos is None else pos.reshape(-1).to(self.device)
            cu = [int(c) for c in padded["cu_seqlens"]]
            with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
                parts = []
                for a, b in zip(cu[:-1], cu[1:]):
                    if b > a:
                        p = torch.arange(b - a, device=self.device) if pos is None else pos[a:b]
                        parts.append(self.model(input_ids=ids[a:b][None],
                                                position_ids=p[None]).logits[0])
                logits = torch.cat(parts)
                ctx = dict(model_inputs=padded, mb_input=item.orig_mb,
                           pad_length=item.padding_length, ulysses_pad_size=0, trie_node=None)
                loss = process_output_fn(logits, ctx)
                if not forward_only and loss is not None:
                    loss.backward()

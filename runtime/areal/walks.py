"""AReaL's batches and losses as the engine core's walks (what ``DTATrainEngine``'s ``train_batch``
/ ``eval_batch`` / ``forward_batch`` call), and AReaL's logits-level ``forward_backward_batch``.

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

__all__ = ["sequences", "loss_scales", "walk", "walk_loss", "forward_logprobs",
           "forward_backward"]


def sequences(input_, *, routed=None, valid=None, model_type: str = "", device=None):
    """(token ids, one-sequence micro-batches, replayed routing or None, split metadata).
    ``routed`` / ``valid``: R3 routing handed through AReaL's side channel (the engine's
    ``_r3_pending_routed_experts`` / ``_r3_pending_valid``)."""
    batched, meta = convert.normalize_input(input_)
    if routed is not None or valid is not None:
        if any(k in batched for k in convert.ROUTING_KEYS):
            raise ValueError("R3 routing given twice: in the batch ('routed_experts') and "
                             "through AReaL's side channel (_r3_pending_routed_experts)")
        batched["routed_experts"] = routed
        if valid is not None:
            batched["r3_routing_valid"] = valid
    routing = convert.take_routing(batched)
    ids, mbs = convert.split_sequences(batched, model_type=model_type, device=device)
    return ids, mbs, routing, meta


def loss_scales(mbs, loss_weight_fn, *, device, group) -> list[float]:
    """``loss_weight_fn(mb) / Σ_all loss_weight_fn`` per sequence, the total computed as
    FSDPEngine does (in float32 -- exact for token counts --, summed over the data-parallel
    ``group``), the ratio in float64. FSDPEngine also multiplies by the data-parallel size
    and averages the ranks' gradients; the core sums them (each rank's gradient is its share
    of the whole batch's): the same gradient."""
    weights = [loss_weight_fn(mb) for mb in mbs]
    total = torch.stack([torch.as_tensor(w) for w in weights]).sum().detach().clone().to(
        dtype=torch.float32, device=device)
    comm.all_reduce(total, group)
    if not total > 0:
        raise ValueError(f"the total loss weight of the batch is {float(total)}; it must be "
                         "positive (does any sequence have a trainable token?)")
    # the ratio in float64 (FSDPEngine's float32 ratio would round each weight)
    return [0.0 if w == 0 else float(w) / float(total) for w in weights]


def walk(core, config, ids, routing=None, *, scales=None, loss=None, train: bool = False):
    """The core's walks of AReaL's sequences (each with its wrap label): ``(result, the walked
    tree's stats for export_stats)``."""
    labels = [convert.wrap_label(s, pad_to_maximum=config.pad_to_maximum,
                                 max_tokens_per_mb=config.mb_spec.max_tokens_per_mb) for s in ids]
    batch = convert.walk_batch(ids, scales, labels=labels, routing=routing,
                               max_positions=getattr(core.model.config,
                                                     "max_position_embeddings", None))
    res = core.walk_sequences(batch, loss, train=train, reduction="sum",
                              minmax=loss is not None, counted=[len(s) for s in ids])
    t = res.tree
    stats = dict(tree_token_ratio=float(t.sharing_ratio), tree_total_tokens=float(t.total_tokens),
                 tree_unique_tokens=float(t.unique_tokens), tree_sequences=float(t.sequences),
                 tree_depth=float(t.depth), dta_forwarded_tokens=float(res.forwarded_tokens))
    if loss is not None:
        stats["dta_loss"] = float(res.loss)
    return res, stats


def walk_loss(core, config, ids, mbs, loss_fn, scales, *, train: bool, routing=None,
              device=None):
    """``loss_fn`` once per sequence (scaled by its weight) on the forward walk's tensors in
    AReaL's layout; with ``train``, the gradient of the scaled sum accumulated. Returns
    ``(the scaled losses, the walked tree's stats)``."""
    temperature = float(config.temperature)
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

    _, stats = walk(core, config, ids, routing, scales=scales, train=train,
                    loss=SequenceLoss(per_sequence, (convert.SEQ_INDEX,)))
    return values or [torch.zeros((), device=device)], stats


def forward_logprobs(core, config, input_, ids, routing, meta, output_seqlens, aggregate_fn):
    """``forward_batch``'s log-probs in AReaL's layout (``(out, tree stats)``): ``out[i, t] =
    log p(ids[i, t+1] | ids[i, :t+1])`` for ``t < L_i - 1``, ``out[i, L_i - 1]`` the wrap
    label's, padding 0; a list input (``meta``) split back per trajectory."""
    lengths = [len(s) for s in ids]
    if meta is not None:
        inferred = [d["attention_mask"].shape[-1] for d in input_]
        if output_seqlens is not None and output_seqlens != inferred:
            raise ValueError(f"output_seqlens mismatch for list input: given {output_seqlens}, "
                             f"inferred {inferred} from attention_mask shapes.")
        output_seqlens = inferred if len(inferred) == len(ids) else lengths
    if output_seqlens is None:
        output_seqlens = lengths
    res, stats = walk(core, config, ids, routing)
    outputs = [convert.areal_view(lp, n) for lp, n in zip(res.logprobs, lengths)]
    result = convert.pad_outputs(outputs, list(output_seqlens), aggregate_fn)
    return (result if meta is None else convert.split_batch(result, meta)), stats


def forward_backward(core, mb_list, process_output_fn, *, forward_only: bool, device) -> None:
    """AReaL's micro-batch interface, forward only and without prefix sharing: for each
    micro-batch the packed logits ``[T, V]`` (every packed segment, padding included,
    forwarded on its own by the core -- ``EngineCore.logits`` --, so sequences never attend
    to each other), then ``process_output_fn(logits, ctx)`` with FSDPEngine's context keys.
    AReaL calls it only inside an engine's own ``train_batch`` / ``eval_batch`` /
    ``forward_batch``, which are DTA's depth-first walks here: training through it
    (``forward_only=False``) is refused, and so is a forward where the ranks' model calls
    are kept matched (``fsdp``)."""
    layout = core.layout
    if not forward_only or core.matched_calls:
        raise NotImplementedError(
            f"forward_backward_batch(forward_only={forward_only}) under "
            f"actor.dta.sharding={layout.sharding} on {layout.world} rank(s): DTA trains "
            "and evaluates by depth-first walks: use train_batch / forward_batch / "
            "eval_batch" + ("" if not forward_only else " (a forward-only call runs "
                            "where the ranks' model calls need not match: not fsdp)"))
    for item in mb_list:
        padded = item.padded_mb
        ids = padded["input_ids"].reshape(-1).to(device)
        pos = padded.get("position_ids")
        pos = None if pos is None else pos.reshape(-1).to(device)
        cu = [int(c) for c in padded["cu_seqlens"]]
        logits = torch.cat([core.logits(ids[a:b], torch.arange(b - a, device=device)
                                        if pos is None else pos[a:b])
                            for a, b in zip(cu[:-1], cu[1:]) if b > a])
        ctx = dict(model_inputs=padded, mb_input=item.orig_mb,
                   pad_length=item.padding_length, ulysses_pad_size=0, trie_node=None)
        process_output_fn(logits, ctx)

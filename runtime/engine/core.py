"""``EngineCore``: one rank of DTA training, whatever the front door.

A front door (the Ray worker, AReaL's ``DTATrainEngine``, verl's ``DTAEngine``) translates its
configuration into what the core takes -- a model builder (``runtime.engine.model``), the
resolved :class:`~runtime.engine.resolve.RunSettings` (layout + walk, ``runtime.engine.resolve``),
an optimizer factory, the compute dtype and the device -- and its batches into a
:class:`dta.batch.Batch` and a loss; the core does the rest:

1. ``EngineCore(...)`` builds the model in the dtype the layout's mode stores it in;
2. :meth:`parallelize` -- once ``torch.distributed`` is up (or on one rank) -- makes the
   layout's process groups, applies context parallelism to the model
   (``dta.model.context_parallel.parallelize_context``) and expert parallelism
   (``dta.model.expert_parallel.parallelize_experts``), reads who reduces what
   (``runtime.engine.layout.reporting_of``), shards it (``runtime.sharding.make_sharding``) and,
   where the layout needs the ranks' decoder calls matched (fsdp, expert parallelism across
   data-parallel groups), wraps the decoder in the lockstep (``runtime.engine.lockstep``);
3. a step: :meth:`train_step` (or its pieces, for a front door with its own loss:
   :meth:`zero_grad`, :meth:`walk_sequences` -- a host framework's per-sequence loss, or
   forward-only log-probs -- / :meth:`accumulate`, :meth:`optimizer_step`): every walk of a
   batch on one prefix tree (``dta.train.walk_batch``, DTA's own step's too) with the run's
   one ``WalkOptions`` object, the one gradient reduction, the clip, the update or the skip
   of a non-finite one (``runtime.engine.step``);
4. checkpoints (one format, DCP files of the logical view, every layout; a front door's own state -- its LR scheduler -- in them as
   ``extra_state``: ``runtime.checkpoints.engine``), Hugging Face export, the full state dict
   and the parameter norm (``runtime.engine.weights``); the whole weights in the compute dtype
   for a rollout's weight update, and whole tensors loaded back (:meth:`named_full_tensors`,
   :meth:`full_state_dict`, :meth:`load_full_state`).

The walk settings are used as given: never rebuilt, never patched (a walk that lacks what the
layout's mode needs is refused at construction).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

import runtime.checkpoints.engine as checkpoint
import runtime.engine.weights as weights
from dta.model.models import raise_buffers, resolve_dtype
from dta.options import WalkOptions
from runtime.engine.layout import (
    ParallelLayout,
    ProcessGroups,
    Reporting,
    build_groups,
    reporting_of,
)
from runtime.engine.resolve import check_walk
from runtime.engine.step import optimizer_step

__all__ = ["EngineCore", "StepOutcome"]


@dataclass
class StepOutcome:
    """One rank's step. ``loss``: what this rank adds to the run's loss (0 on a
    context-parallel rank whose group's head reports it); ``tree``: the walked tree's stats where this rank counts them, else
    None; ``walk``: this rank's walk (None when it walked nothing); ``sent_bytes``: what the
    context-parallel exchange sent; ``expert_sent_bytes``: what expert parallelism's
    exchanges sent in the step (forward, backward, and what the rank served); ``updated`` False on a non-finite norm or a batch
    without a trained token (then ``skipped``)."""

    loss: float = 0.0
    sequences: int = 0
    tree: object = None
    walk: object = None
    sent_bytes: int = 0
    expert_sent_bytes: int = 0
    grad_norm: float = 0.0
    updated: bool = False
    skipped: bool = False
    accumulate_s: float = 0.0
    update_s: float = 0.0


class EngineCore:
    """See the module doc. ``build(dtype) -> nn.Module``; ``make_optimizer(params)``;
    ``master_dtype``: the master weights' dtype (None: the mode's own -- ``zero1`` / ``fsdp``
    keep fp32 masters under 16-bit compute, ``replicate`` none; given: ``replicate`` keeps
    masters in it, a sharded mode checks it is its own)."""

    def __init__(self, build: Callable[[torch.dtype], torch.nn.Module], *,
                 layout: ParallelLayout, walk: WalkOptions,
                 make_optimizer: Callable, compute_dtype, device="cpu", master_dtype=None):
        from runtime.sharding import sharding_class

        check_walk(walk, layout)
        self.layout, self.walk = layout, walk
        self.make_optimizer = make_optimizer
        self.compute_dtype = resolve_dtype(compute_dtype)
        self.device = torch.device(device)
        masters = resolve_dtype(master_dtype) if master_dtype is not None else None
        stored = sharding_class(layout.sharding).storage_dtype(self.compute_dtype, masters)
        self.model = build(stored).to(self.device)
        raise_buffers(self.model, self.compute_dtype)  # one rule in every mode
        # the layout against the model (the driver ran the same check before Ray started)
        layout.check_model(self.model.config, frozen=any(not p.requires_grad
                                                         for p in self.model.parameters()))
        self.sharding = None  # the sharding mode, made by parallelize()
        self.groups = ProcessGroups()
        self.reporting = Reporting()
        self.sync = None  # the lockstep, where the layout needs matched calls

    # ------------------------------------------------------------------ setup --
    def parallelize(self, groups: ProcessGroups | None = None) -> "EngineCore":
        """Groups, context and expert parallelism, who reduces what, sharding, the lockstep
        (see the module doc): once, on every rank, after ``torch.distributed`` is
        initialized (one rank: without). ``groups``: the layout's groups when the front
        door made them already (``build_groups(layout)``, e.g. before it builds the
        model)."""
        from dta.model.context_parallel import parallelize_context
        from dta.model.expert_parallel import parallelize_experts
        from runtime.sharding import make_sharding

        if self.sharding is not None:
            raise RuntimeError("the engine core is parallelized already")
        self.groups = groups if groups is not None else build_groups(self.layout)
        if self.layout.expert_parallel > 1:
            # the walker's self-check probes the model in this process alone: on the whole
            # experts, before they are divided (its result is kept for this model object)
            from dta.selfcheck import ensure_self_check
            ensure_self_check(self.model)
        if self.layout.context_parallel > 1:
            self.model = parallelize_context(self.model, self.groups.context)
        if self.layout.expert_parallel > 1:
            self.model = parallelize_experts(self.model, self.groups.expert)
        self.reporting = reporting_of(self.layout, self.model)
        self.sharding = make_sharding(self.layout.sharding, self.model, self.make_optimizer,
                              group=self.groups.world, compute_dtype=self.compute_dtype,
                              policy=self.walk.policy, layout=self.layout,
                              groups=self.groups)
        self.model = self.sharding.model
        if self.layout.matched_calls:
            self._lockstep()
        return self

    def _lockstep(self) -> None:
        """The ranks' decoder calls matched (``runtime.engine.lockstep``): the walker calls
        the wrapper; a forward's collectives without a forward are the mode's around the
        model's own (expert parallelism's exchanges)."""
        from dta.model.expert_parallel import expert_parallel_of
        from runtime.engine.lockstep import Lockstep, LockstepDecoder

        decoder = self.model.get_decoder()
        ep = expert_parallel_of(self.model)
        steps = self.sharding.forward_steps(ep.forward_exchanges() if ep is not None else {})
        group = self.groups.shard if self.layout.lockstep_in_shard else self.groups.world
        self.sync = Lockstep(decoder, group, kept_graphs=self.walk.policy == "retain",
                             forward_steps=steps, on_end=self.sharding.release_gathered,
                             what=self.layout.matched_reason())
        wrapper = LockstepDecoder(decoder, self.sync)
        self.model.get_decoder = lambda: wrapper  # what the walker calls; the model unchanged

    def _require(self):
        if self.sharding is None:
            raise RuntimeError("the engine core is not parallelized: call parallelize() once "
                               "torch.distributed is up")
        return self.sharding

    @property
    def optimizer(self):
        return self._require().optimizer

    @property
    def matched_calls(self) -> bool:
        """Whether the ranks' decoder calls are kept matched (fsdp, expert parallelism across
        data-parallel groups): a model call outside the core's walks (:meth:`walk_session`,
        a step) would unmatch them."""
        self._require()
        return self.sync is not None

    # ------------------------------------------------------------------- walks --
    def walker(self, temperature: float | None = None, *, adapters: bool = True):
        """A walker of the model with the run's walk settings (self-checked).
        ``temperature``: a front door whose batches carry their own sampling temperature
        (verl's) walks them at it -- the run's walk with that one field replaced, derived
        here once per temperature (the one place a walk differs from the resolved one).
        ``adapters=False``: a LoRA model's base (its adapters off; ``dta.model.lora.
        base_view``, sharing the weights: a reference policy's log-probs)."""
        from dta.train import checked_walker

        return checked_walker(self.model if adapters else self._base_model(),
                              self.walk_at(temperature))

    def _base_model(self):
        from dta.model.lora import base_view, is_peft_model

        if not is_peft_model(self.model):
            return self.model
        if self.__dict__.get("_base") is None:
            self._base = base_view(self.model)
        return self._base

    def walk_at(self, temperature: float | None) -> WalkOptions:
        """The run's walk (the very object), or its copy at a batch's ``temperature``."""
        if temperature is None or float(temperature) == self.walk.temperature:
            return self.walk
        cache = self.__dict__.setdefault("_walks", {})
        if float(temperature) not in cache:
            cache[float(temperature)] = self.walk.replace(temperature=float(temperature))
        return cache[float(temperature)]

    @contextlib.contextmanager
    def walk_session(self):
        """Around walks outside :meth:`train_step` (forward / eval): where the layout needs
        them, the ranks' decoder calls are matched for its duration; otherwise nothing."""
        self._require()
        sync = self.sync
        if sync is None or sync.active:
            yield
            return
        sync.begin()
        try:
            yield
        except BaseException:
            sync.active = False
            raise
        sync.end()

    def walk_sequences(self, batch, loss=None, *, train: bool, reduction: str = "token_mean",
                       totals=None, temperature: float | None = None, adapters: bool = True,
                       minmax: bool = False, counted: list[int] | None = None, progress=None,
                       recompute: tuple[str, ...] = ()):
        """Every walk of ``batch`` (a ``dta.batch.Batch``) on one prefix tree, with the run's
        walk settings (``dta.train.walk_batch``, what DTA's own step runs): ``train`` adds
        the loss's gradient into ``.grad``; a ``dta.losses.SequenceLoss`` -- a host
        framework's per-sequence loss -- is evaluated once per sequence on a forward walk's
        log-probs, linearized and trained; not ``train``: the forward walk (no graph) and
        the loss's value if one is given; ``loss`` None: log-probs only. ``temperature`` /
        ``adapters``: as :meth:`walker`; ``minmax``: the logits' vocabulary min / max too
        (handed to the loss as ``vocab_min`` / ``vocab_max``); ``counted``: the tokens of
        each sequence the tree stats count (a host's wrap label appended for the walk is
        not its own); ``recompute``: batch fields set to the current policy's log-probs by
        the forward walk of the same tree first (one tree for both walks). The batch is
        validated for the model first. Inside
        :meth:`walk_session` (fsdp outside a step: the ranks' calls matched). Returns a
        ``dta.train.StepResult``: log-probs, entropy (and min / max), the loss, the walked
        tree's stats, the tokens forwarded and the context-parallel bytes sent."""
        from dta.train import validate_for_model, walk_batch

        self._require()
        if train and not adapters:
            raise ValueError("walk_sequences(train=True, adapters=False): the walk trains the "
                             "LoRA adapters; their base is walked for log-probs only")
        validate_for_model(batch, self.model, loss, recompute=recompute,
                           aux_loss=train and self.walk.router_aux_coef > 0)
        walker = self.walker(temperature, adapters=adapters)
        with self.walk_session(), torch.set_grad_enabled(train):
            return walk_batch(walker, batch, loss, train=train, reduction=reduction,
                              totals=totals, minmax=minmax, counted=counted,
                              progress=progress, recompute=tuple(recompute))

    @torch.no_grad()
    def logprobs(self, batch, *, minmax: bool = False):
        """The batch's per-token log-probs by a forward-only walk (no graph): the
        ``dta.walk.WalkResult`` of :meth:`walk_sequences`' forward walk."""
        return self.walk_sequences(batch, train=False, minmax=minmax).walk

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits ``[T, V]`` for one sequence ``[T]`` at ``position_ids``: a
        plain forward (no tree, no graph) for a host's logits-level interface; refused where
        the ranks' decoder calls are kept matched (:attr:`matched_calls`)."""
        if self.matched_calls:
            raise NotImplementedError(f"sharding={self.layout.sharding} keeps the ranks' "
                                      "decoder calls matched: a plain forward outside the "
                                      "core's walks would unmatch them")
        return self.model(input_ids=input_ids[None], position_ids=position_ids[None]).logits[0]

    def _experts(self):
        from dta.model.expert_parallel import expert_parallel_of

        return expert_parallel_of(self.model)

    def zero_grad(self) -> None:
        """Clear the gradients and open the step's matched calls (where the layout needs
        them)."""
        self._require().zero_grad()
        ep = self._experts()
        if ep is not None:
            ep.reset()
        if self.sync is not None:
            self.sync.begin()

    def accumulate(self, batch, loss, *, totals=None, reduction: str = "token_mean",
                   progress=None, recompute: tuple[str, ...] = ()):
        """Add ``batch``'s loss gradient into ``.grad`` by one walk with the run's walk
        settings (:meth:`walk_sequences`); returns (``dta.train.StepResult``, bytes the
        context-parallel exchange sent)."""
        res = self.walk_sequences(batch, loss, train=True, totals=totals, reduction=reduction,
                                  progress=progress, recompute=recompute)
        return res, res.sent_bytes

    def optimizer_step(self, max_grad_norm) -> tuple[float, bool]:
        """The one reduction, the clip, the update or the skip: ``(norm, updated)`` (after
        following the peers' remaining calls, where they are matched)."""
        mode = self._require()
        if self.sync is not None and self.sync.active:
            self.sync.end()
        ep = self._experts()
        if ep is not None:
            ep.check()
        return optimizer_step(mode, max_grad_norm)

    def train_step(self, batch, loss, *, totals, max_grad_norm, reduction: str = "token_mean",
                   progress=None, recompute: tuple[str, ...] = (),
                   before_reduce: Callable | None = None) -> StepOutcome:
        """One optimizer update from this rank's share ``batch`` (None: nothing to walk) of
        a global batch whose normalizers are ``totals``. A global batch without a trained
        token changes nothing (every rank sees the same totals: no collective is entered).
        ``recompute``: batch fields set to the current policy's log-probs (after the
        gradients are cleared) on the training walk's own tree (:meth:`walk_sequences`);
        ``before_reduce()`` between the walk and the reduction."""
        self._require()
        t0 = time.perf_counter()
        out = StepOutcome()
        if totals is not None and totals.trainable_tokens == 0:
            out.skipped = True
            return out
        self.zero_grad()
        ep = self._experts()
        ep_sent = ep.sent_bytes if ep is not None else 0
        if batch is not None and len(batch):
            res, out.sent_bytes = self.accumulate(batch, loss, totals=totals,
                                                  reduction=reduction, progress=progress,
                                                  recompute=recompute)
            out.walk, out.sequences = res.walk, len(batch)
            out.loss = float(res.loss) if self.reporting.counts_loss else 0.0
            out.tree = res.tree if self.reporting.counts_tree else None
        t1 = time.perf_counter()
        if before_reduce is not None:
            before_reduce()
        out.grad_norm, out.updated = self.optimizer_step(max_grad_norm)
        out.expert_sent_bytes = ep.sent_bytes - ep_sent if ep is not None else 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out.accumulate_s, out.update_s = t1 - t0, time.perf_counter() - t1
        return out

    # ------------------------------------------------------------------ state --
    def full_state(self) -> dict:
        """The model's state dict on CPU (gathered where sharded: every rank calls it)."""
        return self._require().full_state()

    def param_norm(self) -> float:
        """L2 norm of what the optimizer steps (the masters where sharded: a collective)."""
        return self._require().param_norm()

    def state_bytes(self) -> dict:
        return self._require().state_bytes()

    def sharded_state(self) -> dict:
        """DCP's view of the training state (every rank's part: the stepped weights -- the
        masters where kept -- and the optimizer state), loaded in place."""
        return self._require().sharded_state()

    def named_full_tensors(self):
        """``(name, whole tensor in the compute dtype)`` per parameter, in the model's order
        (sharded: gathered, a collective per tensor: every rank iterates)."""
        self._require()
        return weights.named_full_tensors(self)

    def full_state_dict(self, keep: bool = True) -> dict:
        """The model's state dict in the compute dtype on CPU, whole tensors (what a rollout
        serves; tied weights under both names). Every rank calls it; ``keep=False`` takes
        part in the gathers without holding the result (returns ``{}``)."""
        self._require()
        return weights.full_state_dict(self, keep=keep)

    def load_full_state(self, state: dict, *, what: str) -> None:
        """Whole tensors (e.g. a Hugging Face folder read on every rank) into the model, its
        shards and its masters; every parameter must be there (``what`` names the source)."""
        self._require()
        weights.load_full_state(self, state, what=what)

    # ------------------------------------------------------------ checkpoints --
    def save(self, directory: str, step: int, meta: dict, *, run_id: str | None = None,
             keep_last: int | None = None, extra_state: dict | None = None,
             every_rank: bool = False) -> str:
        """Checkpoint ``step`` under ``directory`` (``runtime.checkpoints.engine``); every
        rank may call it: replicated, rank 0 writes the whole state (the others only return
        its path); sharded -- or ``every_rank``: replicated state written by the ranks
        together -- every rank writes its part; one format either way. ``extra_state``: a front door's own objects (name -> ``state_dict()`` /
        ``load_state_dict()``: its LR scheduler), saved in the checkpoint's meta;
        ``keep_last``: the newest N checkpoints of this run kept."""
        self._require()
        meta = {**meta, **checkpoint.extra_meta(extra_state)}
        if not (self.layout.sharded or every_rank) and self.layout.rank != 0:
            from runtime.checkpoints.checkpoint import step_name

            return os.path.join(os.path.abspath(directory), step_name(step))
        return checkpoint.save(self, directory, step, meta, run_id=run_id, keep_last=keep_last,
                               every_rank=every_rank)

    def find_checkpoint(self, path: str, *, kind: str, name: str, whose: str,
                        writer: str) -> tuple[str, dict]:
        """The checkpoint at ``path`` (its folder, or the newest under a run's folder) and
        its meta, read before anything is loaded: a front door's own ``kind`` (``name`` /
        ``whose`` call it so in the errors, ``writer`` is the call that writes it), anything
        else refused in one line."""
        try:
            final, meta = checkpoint.find(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no {name} under {path!r} (expected "
                                    f"step-*/meta.json written by {writer})") from None
        if meta.get("kind") != kind:
            raise ValueError(f"checkpoint {final!r} is a {meta.get('kind')!r} checkpoint, not "
                             f"{whose} ({kind})")
        return final, meta

    def load(self, path: str, *, extra_state: dict | None = None) -> dict:
        """The checkpoint at ``path`` (its folder, or the newest under a run's folder) into
        the core (sharded: every rank calls it), then ``extra_state`` from its meta (each
        entry must be there: checked before anything is loaded); returns its meta."""
        self._require()
        if extra_state or not checkpoint.is_checkpoint(path):
            path, meta = checkpoint.find(path)
            checkpoint.check_extra(path, meta, extra_state)
        meta = checkpoint.load(self, path)
        checkpoint.restore_extra(self, path, meta, extra_state)
        return meta

    def export_hf(self, path: str, *, merged: bool = False) -> str:
        self._require()
        return weights.export_hf(self, path, merged=merged)

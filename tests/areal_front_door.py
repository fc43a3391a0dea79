"""AReaL's ``DTATrainEngine`` as a front door of tests/test_engine_front_doors.py: the run
config's model, walk, loss and optimizer as AReaL writes them (``fsdp:d{W/C}c{C}`` +
``actor.dta.sharding``, right-padded training dicts, DTA's PPO through AReaL's ``loss_fn`` /
``loss_weight_fn``, AReaL's ``OptimizerConfig``), 2 ``train_batch`` steps on this rank."""
from __future__ import annotations

import os

import torch
from areal.api.cli_args import OptimizerConfig

from runtime.areal import DTAOptions, DTATrainEngine
from tests.test_areal import FT_SPEC, VOCAB


def _model_dir(cfg) -> str:
    """The run config's model (``model.family`` / ``size`` / ``seed``, built in
    ``model.dtype``) as a local Hugging Face folder for AReaL's ``config.path`` (a fresh
    temporary folder: the caller removes it)."""
    import tempfile

    from safetensors.torch import save_model

    from dta.model.models import build_model

    m = cfg.model
    path = tempfile.mkdtemp(prefix="dta-front-door-")
    # written by hand: save_pretrained writes on torch.distributed's rank 0 only
    model = build_model(str(m.family), str(m.size), dtype=str(m.dtype), seed=int(m.seed))
    model.config.save_pretrained(path)
    save_model(model, os.path.join(path, "model.safetensors"))
    return path


def _dta_loss(logprobs, entropy, mb, *, loss, **_):
    """A DTA token loss (the run config's ``loss``) through AReaL's loss API: one sequence's
    packed tensors (AReaL's rolled fields), its token mean; weighed by its trainable tokens
    (``loss_weight_fn``), the batch's loss is DTA's token mean."""
    mask = mb["loss_mask"].to(logprobs.dtype)
    fields = {"advantages": mb["advantages"].to(logprobs.dtype),
              "old_logprobs": mb["logprobs"].to(logprobs.dtype)}
    return (loss.values(logprobs, entropy, fields) * mask).sum() / mask.sum()


def make_engine(world, mode, cp, cfg, ep=1):
    """AReaL's ``DTATrainEngine`` on ``fsdp:d{W/C}c{C}`` (E > 1: ``archon:d{W/C}c{C}e{E}``,
    AReaL's fsdp backend refuses ``e``) + ``actor.dta.sharding=mode`` (and ``shard_size``,
    ``offload``, ``node_resident``, ``prefetch`` from ``train.*``): the run config's model
    (float64 throughout where it is float64), walk and optimizer (AReaL's
    ``OptimizerConfig``, a constant LR schedule)."""
    import shutil

    from areal.api.cli_args import MicroBatchSpec, TrainEngineConfig

    from dta.config.walk import walk_options
    from dta.model import models

    oc, dp = cfg.optimizer, world // cp
    path = _model_dir(cfg)
    config = TrainEngineConfig(
        experiment_name="front-doors", trial_name="areal", path=path,
        attn_impl=str(cfg.model.attn_implementation),
        backend=f"fsdp:d{dp}c{cp}" if ep == 1 else f"archon:d{dp}c{cp}e{ep}",
        temperature=float(cfg.actor.temperature), mb_spec=MicroBatchSpec(n_mbs=1),
        optimizer=OptimizerConfig(type="adam", lr=float(oc.lr),
                                  weight_decay=float(oc.weight_decay), beta1=float(oc.betas[0]),
                                  beta2=float(oc.betas[1]), eps=float(oc.eps),
                                  gradient_clipping=float(oc.max_grad_norm),
                                  lr_scheduler_type="constant", warmup_steps_proportion=0.0))
    shard = cfg.train.shard_size
    options = DTAOptions.of(walk_options(cfg), dtype=str(cfg.model.dtype), sharding=mode,
                            shard_size=None if shard is None else int(shard),
                            offload=str(cfg.train.offload),
                            node_resident=cfg.train.node_resident is True,
                            prefetch=cfg.train.prefetch is True)
    load = models.load_model

    def truly_float64(*args, **kwargs):  # as the Ray door's truly_float64, before sharding
        model = load(*args, **kwargs)
        models.make_truly_float64(model)
        return model

    models.load_model = truly_float64
    try:
        eng = DTATrainEngine(config, options)
        eng.create_process_group()
        eng.initialize(None, FT_SPEC)
    finally:
        models.load_model = load
        shutil.rmtree(path, ignore_errors=True)
    return eng


def train_step(eng, cfg, k, rank, world, cp) -> dict:
    """``train_batch`` of the run config's batch ``k`` (this data-parallel group's share as
    AReaL's right-padded training dicts; DTA's PPO through AReaL's ``loss_fn`` /
    ``loss_weight_fn``)."""
    import functools

    from dta.config.loss import loss_kwargs
    from dta.losses import make_loss
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from dta_cli.batches import BatchSource
    from runtime.areal import convert

    loss_fn = functools.partial(_dta_loss, loss=make_loss(cfg.loss.name, **loss_kwargs(cfg)))
    batch = BatchSource(cfg, VOCAB).batch(k)
    mine = batch.subset(assign_workers(PrefixTree(batch.input_ids),
                                       world // cp).workers[rank // cp])
    records = [{"input_ids": mine.input_ids[i],
                **{f: mine.fields[f][i] for f in ("loss_mask", "advantages", "old_logprobs")}}
               for i in range(len(mine))]
    stats = eng.train_batch(convert.from_records(records, logprobs_dtype=torch.float64),
                            loss_fn, lambda mb: mb["loss_mask"].count_nonzero())
    if stats["update_successful"] != 1.0:
        raise RuntimeError(f"AReaL front door: step {k} did not update")
    return stats


def front_door(rank, world, mode, cp, cfg, ep=1):
    """AReaL's ``DTATrainEngine`` as a front door of tests/test_engine_front_doors.py
    (:func:`make_engine`), 2 ``train_batch`` steps (:func:`train_step`)."""
    from dta.model.context_parallel import context_parallel_of

    eng = make_engine(world, mode, cp, cfg, ep)
    cpo = context_parallel_of(eng.model)
    sent = cpo.sent_bytes if cpo is not None else 0
    for k in range(2):
        train_step(eng, cfg, k, rank, world, cp)
    from dta.model.expert_parallel import expert_parallel_of

    experts = expert_parallel_of(eng.model)
    out = {"state": eng.core.full_state(), "param_norm": eng.param_norm(),
           "layout": eng.core.layout, "sent": (cpo.sent_bytes - sent) if cpo is not None else 0,
           "expert_sent": experts.sent_bytes if experts is not None else 0}
    eng.destroy()
    return out

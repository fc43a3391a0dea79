"""A ``dta`` run config (``dta.config.schema``: YAML + ``key=value`` overrides) as AReaL's
``PPOActorConfig`` plus :class:`~runtime.areal.engine.DTAOptions`, so that the same
``configs/*.yaml`` (and ``actor.eps_clip=0.3``) drive :class:`~runtime.areal.actor.DTAPPOActor`.

The PPO knobs come from the resolved ``loss`` section (which follows ``actor.*`` unless set
explicitly), the rest of the actor keys from ``actor``. ``loss.behav_imp_weight_cap`` — the
pre-1.0 AReaL key — becomes 1.0.4's ``rejection_sampling: {metric: ratio, upper: cap}``
(token level, action mask: the tokens above the cap are dropped, as DTA's PPO loss does).
``train.sharding``, ``shard_size``, ``offload``, ``node_resident``, ``prefetch`` and
``expert_parallel`` become ``DTAOptions`` and the allocation as ``dta train`` takes them (:func:`layout_keys`: an ``auto``
priced by the memory model; ``train.sharding=auto`` alone: unset, so the engine shards as
``fsdp:dN`` means when N > 1).
"""
from __future__ import annotations

import math

from areal.api.cli_args import (
    MicroBatchSpec,
    NormConfig,
    OptimizerConfig,
    PPOActorConfig,
    RejectionSamplingConfig,
)

from dta.config.walk import walk_options
from runtime.areal.options import DTAOptions

__all__ = ["actor_config_from_dta"]

_AREAL_DTYPES = ("float32", "bfloat16", "float16")


def actor_config_from_dta(cfg, *, experiment_name: str = "dta", trial_name: str = "run",
                          backend: str = "fsdp:d1") -> tuple[PPOActorConfig, DTAOptions]:
    """``(PPOActorConfig, DTAOptions)`` from a loaded ``dta.config.schema`` config (``load_config``).

    Raises ValueError, naming the key, for what AReaL's PPO actor cannot express: a model
    without ``model.path`` (AReaL engines load a local HF directory), the ``nll`` loss, an
    entropy bonus, or a reduction other than ``token_mean`` (PPOActor weighs micro-batches by
    their trainable tokens)."""
    if not cfg.model.path:
        raise ValueError("config key 'model.path' is required for the AReaL backend: its engines "
                         "load a local Hugging Face directory (save a built model there first)")
    loss = cfg.loss
    if loss.name != "ppo":
        raise ValueError(f"config key 'loss.name' is {loss.name!r}: the AReaL backend trains "
                         "AReaL's PPO actor (grpo_loss_fn); use loss.name=ppo")
    if float(loss.entropy_coef) != 0.0:
        raise ValueError("config key 'loss.entropy_coef' must be 0 for the AReaL backend: "
                         "grpo_loss_fn has no entropy bonus")
    if cfg.walker.reduction != "token_mean":
        raise ValueError(f"config key 'walker.reduction' is {cfg.walker.reduction!r}: AReaL's "
                         "PPOActor normalizes by trainable tokens (token_mean)")
    actor, opt = cfg.actor, cfg.optimizer
    dtype = str(cfg.model.dtype)
    optimizer = OptimizerConfig(
        type="adam" if opt.name == "adamw" else "sgd", lr=float(opt.lr),
        weight_decay=float(opt.weight_decay), beta1=float(opt.betas[0]),
        beta2=float(opt.betas[1]), eps=float(opt.eps),
        gradient_clipping=math.inf if opt.max_grad_norm is None else float(opt.max_grad_norm),
        lr_scheduler_type="constant", warmup_steps_proportion=0.0)
    cap = loss.behav_imp_weight_cap
    adv_norm = None
    if actor.adv_norm is not None:
        n = actor.adv_norm
        adv_norm = NormConfig(mean_level=n.mean_level, std_level=n.std_level,
                              group_size=int(n.group_size), eps=float(n.eps))
    lora = cfg.model.lora  # AReaL's keys: use_lora, lora_rank, lora_alpha, target_modules
    if int(lora.r) and bool(lora.rslora):
        raise ValueError("config key 'model.lora.rslora' has no AReaL counterpart "
                         "(FSDPEngine scales alpha / r); set it to false for the AReaL backend")
    config = PPOActorConfig(
        use_lora=bool(int(lora.r)), lora_rank=int(lora.r) or 32, lora_alpha=float(lora.alpha),
        target_modules=[str(t) for t in lora.target_modules] if int(lora.r) else [],
        experiment_name=experiment_name, trial_name=trial_name, path=str(cfg.model.path),
        attn_impl=str(cfg.model.attn_implementation), backend=backend,
        dtype=dtype if dtype in _AREAL_DTYPES else "float32",
        optimizer_dtype="float32",  # fp32 master weights, AReaL's default
        optimizer=optimizer, temperature=float(actor.temperature), mb_spec=MicroBatchSpec(),
        ppo_n_minibatches=int(actor.ppo_n_minibatches), eps_clip=float(loss.eps_clip),
        eps_clip_higher=None if loss.eps_clip_high is None else float(loss.eps_clip_high),
        c_clip=None if loss.dual_clip is None else float(loss.dual_clip),
        use_decoupled_loss=bool(loss.decoupled),
        rejection_sampling=None if cap is None else RejectionSamplingConfig(
            level="token", action="mask", metric="ratio", upper=float(cap)),
        recompute_logprob=bool(actor.recompute_logprob),
        reward_scaling=float(actor.reward_scaling), reward_bias=float(actor.reward_bias),
        reward_clip=float(actor.reward_clip),
        mask_no_eos_with_zero=bool(actor.mask_no_eos_with_zero),
        discount=float(actor.discount), gae_lambda=float(actor.gae_lambda), adv_norm=adv_norm,
        kl_ctl=float(actor.kl_ctl), kl_estimator=str(actor.kl_estimator))
    layout = layout_keys(cfg, backend)
    config.backend = layout.pop("backend")
    options = DTAOptions.of(walk_options(cfg), dtype=None if dtype in _AREAL_DTYPES else dtype,
                            **layout)
    return config, options


def layout_keys(cfg, backend: str) -> dict:
    """``train.sharding`` / ``shard_size`` / ``offload`` / ``node_resident`` / ``prefetch``
    / ``expert_parallel`` as ``dta train`` takes them, on the world of AReaL's ``backend``: an
    ``auto`` among all but the first is priced by the memory model as ``dta train`` prices it (``runtime.engine.
    resolve_run_config``, the model's config read from ``model.path``), which also settles
    an ``auto`` mode; otherwise ``train.sharding=auto`` stays unset (the engine shards as
    ``fsdp:dN`` means). Expert parallelism lives in AReaL's allocation: ``fsdp:dN`` with
    ``train.expert_parallel=E`` > 1 becomes ``archon:dNeE`` (AReaL's fsdp parser has no
    ``e``); an allocation that states another ``e`` > 1 is refused naming both. Returns
    DTAOptions' ``sharding``, ``shard_size``, ``offload``, ``node_resident``, ``prefetch``
    and the ``backend``."""
    from dta.options import AUTO
    from runtime.areal.parallel import strategy_of

    t = cfg.train
    strategy = strategy_of(backend)
    dp = int(getattr(strategy, "data_parallel_size", 1) or 1)
    cp = int(getattr(strategy, "context_parallel_size", 1) or 1)
    given_e = int(getattr(strategy, "expert_parallel_size", 1) or 1)
    sharding, shard, offload, E = str(t.sharding), t.shard_size, str(t.offload), \
        t.expert_parallel
    resident, prefetch = t.node_resident, t.prefetch
    if AUTO in (shard, offload, E, resident, prefetch):
        from omegaconf import OmegaConf
        from transformers import AutoConfig

        from runtime.engine import resolve_run_config

        hf = AutoConfig.from_pretrained(str(cfg.model.path), local_files_only=True)
        world = OmegaConf.merge(cfg, {"ray": {"num_workers": dp * cp},
                                      "train": {"context_parallel": cp}})
        layout = resolve_run_config(world, hf).layout
        sharding, shard, offload, E = (layout.sharding, layout.shard_size, layout.offload,
                                       layout.expert_parallel)
        resident, prefetch = layout.node_resident, layout.prefetch
    E = int(E)
    if E not in (1, given_e) and given_e != 1:
        raise ValueError(f"config key 'train.expert_parallel' is {E}, the AReaL allocation "
                         f"{backend!r} states e{given_e}: give one")
    if E not in (1, given_e):
        backend = f"archon:d{dp}{f'c{cp}' if cp > 1 else ''}e{E}"
    return {"sharding": None if sharding == AUTO else sharding,
            "shard_size": None if shard is None else int(shard), "offload": offload,
            "node_resident": bool(resident), "prefetch": bool(prefetch), "backend": backend}

"""Which config keys ``dta train`` uses, and the refusal of those it would ignore.

Every key of the schema (:mod:`dta.config.schema`) is either used by ``dta train`` (:data:`KEY_USE`
says where) or, when ``dta train`` does not implement it, accepted only at its neutral value
(:data:`NOT_IN_DTA_TRAIN`; :func:`check_dta_train` names it otherwise): a config key never
does nothing silently. tests/test_trust_config_keys.py walks the schema and every shipped
config. The AReaL backend (runtime/areal) reads the actor keys itself.
"""
from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from dta.config.schema import ConfigError, _get, default_config

__all__ = ["KEY_USE", "NOT_IN_DTA_TRAIN", "check_dta_train"]

KEY_USE: dict[str, str] = {
    "model.family": "builds the random-init model (superseded by model.path)",
    "model.size": "builds the random-init model (superseded by model.path)",
    "model.path": "loads a local HF model",
    "model.dtype": "model dtype", "model.attn_implementation": "HF attention kernel",
    "model.seed": "random init", "model.lora.r": "LoRA rank (0: full model)",
    "model.lora.alpha": "LoRA scale", "model.lora.target_modules": "LoRA targets",
    "model.lora.rslora": "rsLoRA scale alpha / sqrt(r)",
    "train.export_merged": "export_hf writes merged weights (LoRA)",
    "workload.name": "batch generator (without workload.path)",
    "workload.scale": "batch generator", "workload.seed": "batch generator (seed + step)",
    "workload.path": "JSONL batches", "workload.vocab_size": "generated token ids",
    "workload.sequences_per_step": "JSONL: sequences per step",
    "walker.policy": "retain | recompute", "walker.logits_chunk": "LM-head chunk",
    "walker.temperature": "log-prob temperature", "walker.reduction": "loss reduction",
    "walker.min_shared": "prefix sharing threshold",
    "walker.block_tokens": "longest piece of a node per call (dta.planning.blocks)",
    "loss.name": "the loss", "loss.eps_clip": "PPO clip", "loss.eps_clip_high": "PPO clip",
    "loss.dual_clip": "PPO dual clip", "loss.decoupled": "decoupled PPO",
    "loss.behav_imp_weight_cap": "decoupled PPO", "loss.entropy_coef": "entropy bonus",
    "optimizer.name": "optimizer", "optimizer.lr": "optimizer", "optimizer.betas": "AdamW",
    "optimizer.weight_decay": "optimizer", "optimizer.eps": "AdamW",
    "optimizer.max_grad_norm": "gradient clipping",
    "train.steps": "run length", "train.checkpoint_dir": "checkpoints",
    "train.checkpoint_every": "checkpoints", "train.keep_last": "checkpoint retention",
    "train.resume": "resume", "train.stop_grace_s": "SIGTERM/SIGINT: step and save, bounded",
    "train.skip_nonfinite": "non-finite update policy",
    "train.log_dir": "metrics log", "train.export_hf": "save_pretrained at the end",
    "train.sharding": "sharding mode (runtime.sharding)",
    "train.memory_budget_gib": "memory budget of sharding=auto (dta.planning.memory)",
    "train.host_memory_budget_gib": "host memory budget of the auto layout (dta.planning.memory)",
    "train.context_parallel": "ranks per tree: context-parallel groups of the workers "
                              "(runtime.ray_runtime.worker, dta.model.context_parallel)",
    "train.expert_parallel": "ranks per expert group (runtime.engine.layout)",
    "train.shard_size": "HSDP shard group (runtime.engine.layout)",
    "train.offload": "optimizer state (gradients: and the per-call gradient sum) in host memory (runtime.sharding)",
    "train.node_resident": "fsdp's node-resident gathers, hpZ (runtime.sharding.fsdp)",
    "train.prefetch": "fsdp's next-layer all-gather (runtime.sharding.fsdp)",
    "ray.address": "cluster", "ray.num_workers": "workers", "ray.cpus_per_worker": "workers",
    "ray.gpus_per_worker": "workers", "ray.placement": "workers' placement group",
    "ray.object_store_memory": "local instance",
    "ray.namespace": "cluster", "ray.temp_dir": "local instance",
    "ray.step_timeout_s": "hung-worker detection", "ray.torch_threads": "workers",
    "ray.log_to_driver": "worker logs",
    "actor.group_size": "GRPO groups of records without group_id (with actor.adv_norm)",
    "actor.eps_clip": "loss.eps_clip", "actor.eps_clip_higher": "loss.eps_clip_high",
    "actor.c_clip": "loss.dual_clip", "actor.temperature": "walker.temperature",
    "actor.use_decoupled_loss": "loss.decoupled",
    "actor.behav_imp_weight_cap": "loss.behav_imp_weight_cap",
    "actor.recompute_logprob": "workers recompute old_logprobs",
    "actor.reward_scaling": "GRPO rewards -> advantages", "actor.reward_bias": "GRPO rewards",
    "actor.reward_clip": "GRPO rewards", "actor.adv_norm": "GRPO advantage normalization",
    "actor.adv_norm.mean_level": "GRPO advantage normalization",
    "actor.adv_norm.std_level": "GRPO advantage normalization",
    "actor.adv_norm.group_size": "GRPO groups of records without group_id",
    "actor.adv_norm.eps": "GRPO advantage normalization",
    "actor.router_aux_loss_coef": "MoE router load-balancing loss per sequence (docs/moe.md)",
}
# key -> (the only value dta train accepts, why)
NOT_IN_DTA_TRAIN: dict[str, tuple[Any, str]] = {
    "actor.ppo_n_minibatches": (1, "dta train makes one optimizer update per batch"),
    "actor.kl_ctl": (0.0, "dta train has no reference model, so no KL penalty"),
    "actor.kl_estimator": ("k1", "it only matters with a KL penalty (actor.kl_ctl), which "
                                 "dta train does not implement"),
    "actor.discount": (1.0, "dta train broadcasts outcome rewards to every trained token "
                            "(discount = gae_lambda = 1)"),
    "actor.gae_lambda": (1.0, "dta train broadcasts outcome rewards to every trained token "
                              "(discount = gae_lambda = 1)"),
    "actor.mask_no_eos_with_zero": (False, "the records carry no end-of-sequence flag"),
    "model.lora.dropout": (0.0, "a LoRA dropout mask differs between DFS and per-sequence "
                                "training (DTA trains exactly or not at all)"),
    "stream.target_sequences": (0, "dta train takes its batches from workload.*; stream.* "
                                   "configures Trainer.train_stream (Python API)"),
    "stream.target_tokens": (0, "dta train takes its batches from workload.*; stream.* "
                                "configures Trainer.train_stream (Python API)"),
}


def check_dta_train(cfg) -> None:
    """Reject keys ``dta train`` would ignore (see KEY_USE / NOT_IN_DTA_TRAIN), naming them."""
    for key, (neutral, why) in NOT_IN_DTA_TRAIN.items():
        value = _get(cfg, key)
        if value != neutral:
            raise ConfigError(f"config key '{key}' is {value!r}, but {why}; set it to "
                              f"{neutral!r} (or leave it out)")
    defaults = default_config()
    OmegaConf.resolve(defaults)

    def changed(key):
        return _get(cfg, key) != _get(defaults, key)

    if _get(cfg, "loss.name") == "nll":
        for key in ("loss.eps_clip", "loss.eps_clip_high", "loss.dual_clip",
                    "loss.behav_imp_weight_cap", "loss.entropy_coef"):
            if changed(key):
                raise ConfigError(f"config key '{key}' has no effect with loss.name=nll "
                                  "(a PPO setting)")
    elif not _get(cfg, "loss.decoupled") and _get(cfg, "loss.behav_imp_weight_cap") is not None:
        raise ConfigError("config key 'loss.behav_imp_weight_cap' needs the decoupled loss "
                          "(actor.use_decoupled_loss=true); without it nothing is capped")
    if _get(cfg, "optimizer.name") == "sgd":
        for key in ("optimizer.betas", "optimizer.eps"):
            if changed(key):
                raise ConfigError(f"config key '{key}' has no effect with optimizer.name=sgd")
    if not _get(cfg, "model.lora.r"):
        for key in ("model.lora.alpha", "model.lora.target_modules", "model.lora.rslora",
                    "train.export_merged"):
            if changed(key):
                raise ConfigError(f"config key '{key}' has no effect without LoRA (set "
                                  "model.lora.r > 0)")
    if _get(cfg, "workload.path"):
        for key in ("workload.name", "workload.scale", "workload.seed", "workload.vocab_size"):
            if changed(key):
                raise ConfigError(f"config key '{key}' has no effect with workload.path (the "
                                  "batches come from the file)")
    elif changed("workload.sequences_per_step"):
        raise ConfigError("config key 'workload.sequences_per_step' needs workload.path (a "
                          "generated workload makes whole batches)")
    if _get(cfg, "actor.adv_norm") is None:
        for key in ("actor.group_size",):
            if changed(key):
                raise ConfigError(f"config key '{key}' only groups records for actor.adv_norm, "
                                  "which is not set")
    else:
        a, b = _get(cfg, "actor.group_size"), _get(cfg, "actor.adv_norm.group_size")
        if a != b and 1 not in (a, b):
            raise ConfigError(f"config keys 'actor.group_size' ({a}) and "
                              f"'actor.adv_norm.group_size' ({b}) disagree")

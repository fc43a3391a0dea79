"""Validation of a run config: allowed values and ranges per key, and the rules between keys.
Each failure is one :class:`ConfigError` line naming the key. Part of the library: loading a
config imports neither torch nor ray."""
from __future__ import annotations

from omegaconf import OmegaConf

from dta.config.errors import ConfigError
from dta.config.walk import walk_options
from dta.options import AUTO
from dta.planning.memory import SHARDINGS
from dta.planning.state import OFFLOADS

# Allowed values. They mirror the library's registries (dta.model.models.FAMILIES / SIZES / DTYPES,
# dta.losses.REDUCTIONS / LOSSES; tests/test_config.py checks that they agree) so that loading
# a config does not import torch. The walk's settings are validated by dta.options.WalkOptions
# (dta.config.walk.walk_options), naming their keys.
CHOICES: dict[str, tuple] = {
    "model.family": ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "olmoe", "phi3",
                     "gemma", "gemma2", "gemma3", "granite", "cohere", "starcoder2", "olmo2",
                     "gpt2", "gpt_neox", "opt", "qwen3_5", "qwen3_5_moe", "qwen3_next"),
    "model.size": ("tiny", "small", "qwen3-0.6b", "qwen3-1.7b"),
    "model.dtype": ("float32", "float64", "bfloat16", "float16"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2", "flex_attention"),
    "walker.reduction": ("token_mean", "seq_mean", "sum"),
    "loss.name": ("nll", "ppo"),
    "optimizer.name": ("adamw", "sgd"),
    "train.sharding": (*SHARDINGS, AUTO),  # runtime.sharding registers one class each
    "train.offload": (*OFFLOADS, AUTO),
    "train.node_resident": (False, True, AUTO),
    "train.prefetch": (False, True, AUTO),
    "ray.placement": ("pack", "spread"),
    "actor.kl_estimator": ("k1", "k2", "k3"),
    "actor.adv_norm.mean_level": ("batch", "group", None),
    "actor.adv_norm.std_level": ("batch", "group", None),
}


# key -> (predicate, description); None values are allowed where the field is Optional.
_RANGES: dict[str, tuple] = {
    "optimizer.lr": (lambda v: v > 0, "> 0"),
    "optimizer.eps": (lambda v: v > 0, "> 0"),
    "optimizer.weight_decay": (lambda v: v >= 0, ">= 0"),
    "optimizer.max_grad_norm": (lambda v: v > 0, "> 0 (or null: no clipping)"),
    "loss.eps_clip": (lambda v: v > 0, "> 0"),
    "loss.eps_clip_high": (lambda v: v > 0, "> 0"),
    "loss.dual_clip": (lambda v: v > 1, "> 1"),
    "loss.behav_imp_weight_cap": (lambda v: v > 1, "> 1"),
    "actor.eps_clip": (lambda v: v > 0, "> 0"),
    "actor.eps_clip_higher": (lambda v: v > 0, "> 0"),
    "actor.c_clip": (lambda v: v > 1, "> 1"),
    "actor.temperature": (lambda v: v > 0, "> 0"),
    "actor.behav_imp_weight_cap": (lambda v: v > 1, "> 1"),
    "actor.group_size": (lambda v: v >= 1, ">= 1"),
    "actor.ppo_n_minibatches": (lambda v: v >= 1, ">= 1"),
    "actor.discount": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "actor.gae_lambda": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "actor.reward_clip": (lambda v: v > 0, "> 0"),
    "actor.kl_ctl": (lambda v: v >= 0, ">= 0"),
    "model.lora.r": (lambda v: v >= 0, ">= 0 (0: no LoRA)"),
    "model.lora.alpha": (lambda v: v > 0, "> 0"),
    "train.steps": (lambda v: v >= 1, ">= 1"),
    "train.checkpoint_every": (lambda v: v >= 0, ">= 0"),
    "train.keep_last": (lambda v: v >= 0, ">= 0 (0: keep all)"),
    "train.stop_grace_s": (lambda v: v > 0, "> 0 (seconds a stop signal waits for the step "
                                            "and its save)"),
    "train.memory_budget_gib": (lambda v: v > 0, "> 0 (or null: the device's memory)"),
    "train.host_memory_budget_gib": (lambda v: v > 0, "> 0 (or null: unbudgeted)"),
    "train.context_parallel": (lambda v: v == AUTO or (isinstance(v, int) and not isinstance(
        v, bool) and v >= 1), "an integer >= 1 (ranks per tree; 1: off) or auto"),
    "train.expert_parallel": (lambda v: v == AUTO or (isinstance(v, int) and not isinstance(
        v, bool) and v >= 1), "an integer >= 1 (1: off) or auto"),
    "train.shard_size": (lambda v: v == AUTO or (isinstance(v, int) and not isinstance(
        v, bool) and v >= 1), "an integer >= 1, null (all the workers) or auto"),
    "stream.target_sequences": (lambda v: v >= 0, ">= 0"),
    "stream.target_tokens": (lambda v: v >= 0, ">= 0"),
    "workload.sequences_per_step": (lambda v: v >= 0, ">= 0"),
    "workload.vocab_size": (lambda v: v >= 8, ">= 8"),
    "ray.num_workers": (lambda v: v >= 1, ">= 1"),
    "ray.cpus_per_worker": (lambda v: v > 0, "> 0"),
    "ray.gpus_per_worker": (lambda v: v >= 0, ">= 0"),
    "ray.object_store_memory": (lambda v: v >= 80 * 1024 ** 2, ">= 80 MiB (83886080)"),
    "ray.step_timeout_s": (lambda v: v > 0, "> 0"),
    "ray.torch_threads": (lambda v: v >= 0, ">= 0"),
}


def _get(cfg, key: str):
    return OmegaConf.select(cfg, key, throw_on_missing=False)


def validate_config(cfg) -> None:
    """Reject bad choices and out-of-range numbers, naming the key."""
    for key, allowed in CHOICES.items():
        if key == "model.size" and _get(cfg, "model.path"):
            continue  # a loaded model has no size
        if key.startswith("actor.adv_norm.") and _get(cfg, "actor.adv_norm") is None:
            continue
        value = _get(cfg, key)
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            raise ConfigError(f"bad value for config key '{key}': {value!r} is not one of "
                              f"{shown}")
    # actor.* first: the loss keys interpolate them, so a bad actor value is named as such
    for key in sorted(_RANGES, key=lambda k: not k.startswith("actor.")):
        ok, desc = _RANGES[key]
        value = _get(cfg, key)
        if value is not None and not ok(value):
            raise ConfigError(f"bad value for config key '{key}': {value!r} must be {desc}")
    betas = _get(cfg, "optimizer.betas")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ConfigError(f"bad value for config key 'optimizer.betas': "
                          f"{list(betas)!r} must be two numbers in [0, 1)")
    scale = str(_get(cfg, "workload.scale"))
    if scale not in ("tiny", "small", "full"):
        try:
            s = float(scale)
        except ValueError:
            s = -1.0
        if not 0 < s <= 1:
            raise ConfigError(f"bad value for config key 'workload.scale': {scale!r} must be "
                              "tiny, small, full or a number in (0, 1]")
    if _get(cfg, "loss.name") == "nll" and _get(cfg, "loss.decoupled"):
        raise ConfigError("bad value for config key 'loss.decoupled': the nll loss has no "
                          "decoupled form (set loss.name=ppo or actor.use_decoupled_loss=false)")
    walk_options(cfg)  # the walk settings (dta.options.WalkOptions), naming their keys
    cp, workers = _get(cfg, "train.context_parallel"), int(_get(cfg, "ray.num_workers"))
    if cp != AUTO and workers % int(cp):
        raise ConfigError(f"bad value for config key 'train.context_parallel': {cp} does not "
                          f"divide ray.num_workers={workers} (the data-parallel size is "
                          "ray.num_workers / train.context_parallel)")
    address = _get(cfg, "ray.address")
    if address is not None and not str(address).strip():
        raise ConfigError("bad value for config key 'ray.address': empty (use null for a "
                          "local instance)")

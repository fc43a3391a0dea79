"""Configuration of a training run: OmegaConf structured configs (dataclasses).

``load_config(path, overrides)`` merges, in order: the dataclass defaults (the embedded
default run: a tiny random-init Qwen3 on CPU, a τ²-airline-shaped batch, 2 CPU workers on a
local Ray instance) ← a YAML file ← ``key=value`` overrides (OmegaConf dot-list syntax). Unknown
keys, values of the wrong type, bad choices and out-of-range numbers are rejected with a
:class:`ConfigError` naming the key, before anything is built.

The ``actor`` section mirrors AReaL's ``PPOActorConfig`` keys. The PPO knobs of ``loss`` and
the walker's temperature default to interpolations of the actor's (``${actor.eps_clip}``...),
so ``actor.eps_clip=0.3`` changes the loss that ``dta train`` optimizes; setting
``loss.eps_clip`` directly overrides it. Interpolations are resolved by ``load_config``.

This module is part of the library: it never imports ray.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional

from omegaconf import II, DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    InterpolationResolutionError,
    OmegaConfBaseException,
    ValidationError,
)

from dta.config.errors import ConfigError
from dta.config.validate import CHOICES, _get, validate_config  # noqa: F401  (re-exported)
from dta.options import AUTO, WalkOptions
from dta.planning.memory import SHARDINGS as SHARDINGS

__all__ = ["ModelConfig", "WorkloadConfig", "WalkerConfig", "LossConfig", "OptimizerConfig",
           "TrainConfig", "StreamConfig", "RayConfig", "NormConfig", "ActorConfig", "Config",
           "ConfigError", "load_config", "default_config", "to_yaml", "validate_config"]


# -------------------------------------------------------------------------- sections --
@dataclass
class LoraKeys:
    """LoRA adapters (peft, the optional ``lora`` extra): r = 0 trains the whole model."""

    r: int = 0  # adapter rank; > 0 freezes the base and trains the adapters only
    alpha: float = 16.0  # scale alpha / r (alpha / sqrt(r) with rslora)
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj",
                                                               "o_proj"])
    dropout: float = 0.0  # only 0: a dropout mask differs between DFS and per-sequence training
    rslora: bool = False


@dataclass
class ModelConfig:
    family: str = "qwen3"  # llama | qwen2 | qwen3 (random init from `size`)
    size: str = "tiny"  # tiny | small | qwen3-0.6b | qwen3-1.7b
    path: Optional[str] = None  # a local HF model directory: loaded instead of built
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    seed: int = 0  # every worker builds its replica with this seed: identical weights
    lora: LoraKeys = field(default_factory=LoraKeys)


@dataclass
class WorkloadConfig:
    name: str = "tau2-airline"  # see experiments.workloads.make_workload
    scale: str = "small"  # tiny | small | full | a number in (0, 1]
    seed: int = 0  # step k trains the batch generated with seed + k
    path: Optional[str] = None  # a JSONL batch (dta.records.jsonl); replaces the generator
    vocab_size: Optional[int] = None  # generated token ids; default: the model's vocabulary
    sequences_per_step: int = 0  # with `path`: sequences per step (0: the whole file)


_WALK = WalkOptions()  # the walk settings' defaults (dta/options.py), not repeated here


@dataclass
class WalkerConfig:
    """The walk's settings (dta.options.WalkOptions; dta.config.walk builds it from them)."""

    policy: str = _WALK.policy  # retain | recompute
    logits_chunk: int = _WALK.logits_chunk
    temperature: float = II("actor.temperature")
    reduction: str = "token_mean"  # token_mean | seq_mean | sum
    min_shared: int = _WALK.min_shared
    # the longest piece of a node in one call (dta.planning.blocks): auto (the memory model's
    # choice for train.memory_budget_gib when set or with train.sharding=auto, else the
    # walker's default), 0 (nodes are never cut) or a number of tokens
    block_tokens: Any = AUTO


@dataclass
class LossConfig:
    name: str = "ppo"  # nll | ppo
    eps_clip: float = II("actor.eps_clip")
    eps_clip_high: Optional[float] = II("actor.eps_clip_higher")
    dual_clip: Optional[float] = II("actor.c_clip")
    decoupled: bool = II("actor.use_decoupled_loss")
    behav_imp_weight_cap: Optional[float] = II("actor.behav_imp_weight_cap")
    entropy_coef: float = 0.0


@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    eps: float = 1e-8
    max_grad_norm: Optional[float] = 1.0  # null: no clipping


@dataclass
class TrainConfig:
    steps: int = 5
    checkpoint_dir: Optional[str] = None  # one run per folder (see runtime/checkpoints/checkpoint.py)
    checkpoint_every: int = 1  # steps between checkpoints (0: only after the last step)
    keep_last: int = 2  # checkpoints kept (older ones deleted); 0: keep all
    resume: bool = False  # continue the run in checkpoint_dir (an error if there is none)
    # SIGTERM/SIGINT finish the step and save; past this (or on a second signal): stop at once
    stop_grace_s: float = 30.0
    skip_nonfinite: bool = False  # a non-finite gradient skips the update: go on (else: error)
    log_dir: Optional[str] = None  # per-step metrics.jsonl/.csv; default: checkpoint_dir
    export_hf: Optional[str] = None  # save_pretrained the trained model here at the end
    # with model.lora.r > 0: export_hf holds the adapter (PEFT format); true: merged weights
    export_merged: bool = False
    # How the workers hold the model: replicate (full replicas, gradient all-reduce) | zero1
    # (fp32 masters + optimizer state sharded, one reduce-scatter per step) | zero2 (params
    # resident, gradients reduce-scattered per call) | fsdp (FSDP2: parameters sharded too,
    # gathered per call) | auto (the cheapest that fits
    # memory_budget_gib, by dta.planning.memory).
    sharding: str = "replicate"
    memory_budget_gib: Optional[float] = None  # per worker, for sharding=auto (null: the device's)
    host_memory_budget_gib: Optional[float] = None  # per worker, for auto (null: unbudgeted)
    # Ranks per tree (docs/context-parallel.md): each group of this many workers walks the same
    # trees with their K/V spread over the group; the data-parallel size is ray.num_workers /
    # context_parallel (trees are balanced over the data-parallel groups). 1: off. auto: the
    # memory model's choice among 1, 2, 4, 8 dividing ray.num_workers for memory_budget_gib
    # (with the sharding mode and the block, as `dta plan --memory --context-parallel auto`).
    context_parallel: Any = 1
    # Ranks each MoE layer's routed experts are spread over (docs/expert-parallel.md): groups of
    # this many consecutive workers hold 1/expert_parallel of the experts each, the routed
    # tokens sent to their experts' owners and back. 1: off (every worker holds every expert).
    # auto: the memory model's choice (as `dta plan --memory --expert-parallel auto`).
    expert_parallel: Any = 1
    # fsdp under HSDP (docs/sharding.md): masters + optimizer over all the workers, the layers
    # gathered across the nodes once a step into a node-resident copy (hpZ) | auto
    node_resident: Any = False
    prefetch: Any = False  # fsdp: the next layer's all-gather issued before this one computes
    # HSDP (docs/sharding.md): zero1 / fsdp split the state over groups of this many
    # consecutive workers (a node) and replicate it across the groups; null: all the workers;
    # auto: the memory model's choice (all the workers, or one node).
    shard_size: Any = None
    # none | optimizer: the AdamW state and the fp32 master weights live in host memory and
    # are stepped there (docs/sharding.md) | gradients (zero2 / fsdp): that, and the walk's
    # per-call fp32 gradient sum on the host too | auto: the memory model's choice
    offload: str = "none"


@dataclass
class StreamConfig:
    """Asynchronous mode: a step starts when the rollouts received reach a target."""

    target_sequences: int = 0  # 0: no sequence target
    target_tokens: int = 0  # 0: no token target


@dataclass
class RayConfig:
    address: Optional[str] = None  # None: start a private local instance on 127.0.0.1
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    gpus_per_worker: Optional[float] = None  # None: 1 when the cluster has GPUs, else 0
    placement: str = "pack"  # the workers' placement group: pack (fewest nodes) | spread
    object_store_memory: int = 256 * 1024 ** 2  # bytes, local instance only
    namespace: str = "dta"
    temp_dir: Optional[str] = None  # local instance: default a fresh /tmp/dta-ray-* dir
    step_timeout_s: float = 1800.0  # a step that takes longer is reported as hung
    torch_threads: int = 0  # per worker; 0: cpus_per_worker (rounded, at least 1)
    log_to_driver: bool = False  # stream the workers' stdout/stderr to the driver


@dataclass
class NormConfig:
    """AReaL's NormConfig (advantage / reward normalization)."""

    mean_level: Optional[str] = "batch"  # batch | group | null
    std_level: Optional[str] = "batch"  # batch | group | null
    group_size: int = 1
    eps: float = 1e-5


@dataclass
class ActorConfig:
    """AReaL PPOActorConfig keys. ``dta train`` uses eps_clip, eps_clip_higher, c_clip,
    temperature, use_decoupled_loss, behav_imp_weight_cap (through the ``loss`` and ``walker``
    interpolations) and recompute_logprob; the others (rewards, advantages, minibatches, KL)
    are for the AReaL backend, whose rollouts arrive with advantages already computed."""

    group_size: int = 1
    ppo_n_minibatches: int = 1
    eps_clip: float = 0.2
    eps_clip_higher: Optional[float] = None
    c_clip: Optional[float] = None
    temperature: float = _WALK.temperature
    use_decoupled_loss: bool = False
    behav_imp_weight_cap: Optional[float] = None
    recompute_logprob: bool = False
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    reward_clip: float = 20.0
    mask_no_eos_with_zero: bool = False
    discount: float = 1.0
    gae_lambda: float = 1.0
    adv_norm: Optional[NormConfig] = None
    kl_ctl: float = 0.0
    kl_estimator: str = "k1"
    # MoE: the router's load-balancing loss of every sequence, computed exactly (docs/moe.md);
    # AReaL's spelling of the walk's router_aux_loss: a coefficient, 0 = off (its default,
    # "refuse": a model config that asks for it is then refused; dta.config.walk)
    router_aux_loss_coef: float = 0.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    walker: WalkerConfig = field(default_factory=WalkerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)


# ------------------------------------------------------------------------- loading --
def default_config() -> DictConfig:
    """The structured defaults (interpolations unresolved)."""
    return OmegaConf.structured(Config)


def _all_keys(node, prefix: str = "") -> list[str]:
    out = []
    for key in node.keys() if isinstance(node, DictConfig) else []:
        full = f"{prefix}{key}"
        out.append(full)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            out += _all_keys(child, full + ".")
    return out


def _key_error(exc: OmegaConfBaseException, source: str, base: DictConfig) -> ConfigError:
    full = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    where = f" (from {source})" if source else ""
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)) and not isinstance(
            exc, ValidationError):
        close = difflib.get_close_matches(str(full), _all_keys(base), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return ConfigError(f"unknown config key '{full}'{where}{hint}")
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ConfigError(f"bad value for config key '{full}'{where}: {msg}")


def _merge(base: DictConfig, other, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        raise _key_error(exc, source, base) from None


def _parse_overrides(overrides: Iterable[str]) -> DictConfig:
    items = list(overrides or [])
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"bad override {item!r}: expected key=value, "
                              "e.g. actor.eps_clip=0.3")
    try:
        return OmegaConf.from_dotlist(items)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad override: {exc}") from None


def load_config(path: str | os.PathLike | None = None,
                overrides: Iterable[str] = ()) -> DictConfig:
    """defaults ← YAML file at ``path`` ← ``key=value`` overrides; validated and resolved."""
    cfg = default_config()
    if path is not None:
        from dta.paths import check_path

        path = check_path(path, "file", "config file", error=ConfigError)
        try:
            loaded = OmegaConf.load(path)
        except Exception as exc:  # YAML syntax errors
            raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections")
        cfg = _merge(cfg, loaded, path)
    cfg = _merge(cfg, _parse_overrides(overrides), "overrides")
    try:
        OmegaConf.resolve(cfg)
    except (InterpolationResolutionError, ValidationError) as exc:
        raise _key_error(exc, "", cfg) from None
    validate_config(cfg)
    return cfg


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def as_dict(cfg) -> dict:
    out = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(out, dict):
        raise TypeError(f"a run config must be a mapping, got {type(out).__name__}")
    return out


def from_dict(data: dict) -> DictConfig:
    """A validated config from a plain dict (e.g. one shipped to a Ray worker)."""
    cfg = _merge(default_config(), OmegaConf.create(data), "dict")
    OmegaConf.resolve(cfg)
    validate_config(cfg)
    return cfg

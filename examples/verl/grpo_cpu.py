"""GRPO with the dta engine through verl's own config and engine interface, on CPU.

The config is examples/verl/tau2_grpo_dta.yaml (verl's ppo_trainer with ``strategy: dta``),
composed by Hydra as ``verl.trainer.main_ppo`` composes it; the actor and reference engines
are built from it as verl's ``ActorRolloutRefWorker.init_model`` builds them
(``omega_conf_to_dataclass`` -> ``EngineRegistry.new(model_type, engine_config.strategy, ...)``),
so the engine class comes from the one config value. Each step then does what verl's trainer
does with a rollout batch: GRPO advantages (verl's ``compute_grpo_outcome_advantage``),
``old_log_probs`` from the actor's ``infer_batch`` (``compute_log_prob``), the reference's
log-probs under the same interface, and one ``train_batch`` per mini-batch with verl's
``ppo_loss`` (KL loss on).

What differs from a verl run: verl 0.9.1 has no rollout engine that runs on CPU (vLLM, SGLang
and TensorRT-LLM only), so the rollout is replaced by recorded τ²-airline multi-turn agent
trajectories (``experiments.workloads``: a group of episodes per task, every row a later call
of a conversation whose earlier calls are other rows); no Ray (one process, a gloo group of
one). The model is a tiny random Qwen3 built locally unless ``--model`` names a local HF
directory. ``--json``: one JSON object (per-step metrics) as the last line.

    .venv/bin/python examples/verl/grpo_cpu.py --steps 2 [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))


def compose_config(model_path: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    # a caller in the same process (AReaL's config loader does) may have left Hydra's global
    # state initialized; composing this config needs it fresh
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=HERE, version_base=None):
        return compose(config_name="tau2_grpo_dta",
                       overrides=[f"actor_rollout_ref.model.path={model_path}", *overrides])


def build_engines(cfg):
    """The actor and reference engines as verl's worker builds them (engine_workers.py)."""
    from verl.trainer.config import CheckpointConfig
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.base import EngineRegistry

    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor.model_config = model
    engines = {}
    engine = EngineRegistry.new(model_type="language_model", backend=actor.engine.strategy,
                                model_config=model, engine_config=actor.engine,
                                optimizer_config=actor.optim,
                                checkpoint_config=actor.checkpoint or CheckpointConfig())
    engine.initialize()
    engines["actor"] = engine
    if actor.use_kl_loss:
        ref_cfg = cfg.actor_rollout_ref.ref
        from omegaconf import open_dict

        with open_dict(ref_cfg):
            ref_cfg.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
            ref_cfg.ppo_micro_batch_size_per_gpu = ref_cfg.pop(
                "log_prob_micro_batch_size_per_gpu", None) or 1
            ref_cfg.pop("log_prob_micro_batch_size", None)
            ref_cfg.use_dynamic_bsz = ref_cfg.pop("log_prob_use_dynamic_bsz", False)
            ref_cfg.ppo_max_token_len_per_gpu = ref_cfg.pop("log_prob_max_token_len_per_gpu",
                                                            None) or 16384
        ref = omega_conf_to_dataclass(ref_cfg)
        ref.engine.forward_only = True
        engines["ref"] = EngineRegistry.new(model_type="language_model",
                                            backend=ref.engine.strategy, model_config=model,
                                            engine_config=ref.engine, optimizer_config=None,
                                            checkpoint_config=CheckpointConfig())
        engines["ref"].initialize()
    return actor, engines


def grpo_batch(records, temperature: float):
    """The rollout batch: the trajectories, their outcome rewards at the last response token,
    GRPO advantages by group (verl's own estimator)."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from runtime.verl.records import records_to_verl

    td = records_to_verl(records, temperature=temperature)
    mask = td["response_mask"].to(torch.float32)
    rewards = torch.zeros_like(mask)
    last = mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)
    rewards[torch.arange(len(records)), last] = torch.tensor(
        [float(r["reward"]) for r in records])
    index = np.array([str(r["group_id"]) for r in records], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    td["advantages"] = adv
    return td


def run(args) -> dict:
    from functools import partial

    import torch
    import torch.distributed as dist
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from dta.model.models import build_model, save_word_tokenizer
    from experiments.workloads import make_workload
    from runtime.verl import use_cpu_platform

    torch.manual_seed(0)
    use_cpu_platform()
    work = tempfile.mkdtemp(prefix="verl-grpo-cpu-")
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=0,
                            world_size=1)
    try:
        path = args.model
        vocab = 512
        if path is None:
            path = os.path.join(work, "tiny-qwen3")
            build_model("qwen3", "tiny", dtype="float32", seed=0).save_pretrained(path)
            save_word_tokenizer(path, vocab)
        # CPU: float32 throughout (the yaml's bf16 is for GPUs), a larger step for a tiny model
        fp32 = [f"actor_rollout_ref.{role}.fsdp_config.{key}=fp32" for role in ("actor", "ref")
                for key in ("model_dtype", "mixed_precision.param_dtype")]
        cfg = compose_config(path, [*fp32, "actor_rollout_ref.actor.optim.lr=1e-3",
                                    *args.override])
        actor_cfg, engines = build_engines(cfg)
        actor = engines["actor"]
        loss = partial(ppo_loss, actor_cfg)
        temperature = float(cfg.actor_rollout_ref.rollout.temperature)
        mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size) * \
            int(cfg.actor_rollout_ref.rollout.n)
        history = []
        for step in range(args.steps):
            records = make_workload("tau2-airline", scale="tiny", seed=step,
                                    vocab_size=vocab).records
            td = grpo_batch(records, temperature)
            with actor.eval_mode():  # verl's compute_log_prob
                out = actor.infer_batch(td.clone())["model_output"]
            td["old_log_probs"] = no_padding_2_padding(out["log_probs"], td).float()
            if "ref" in engines:  # verl's compute_ref_log_prob
                with engines["ref"].eval_mode():
                    ref = engines["ref"].infer_batch(td.clone())["model_output"]
                td["ref_log_prob"] = no_padding_2_padding(ref["log_probs"], td).float()
            metrics = dict(step=step, sequences=len(records))
            with actor.train_mode():  # verl's update_actor: mini-batches of rollout.n groups
                for start in range(0, len(records), mini):
                    part = tu.index_select_tensor_dict(
                        td, list(range(start, min(start + mini, len(records)))))
                    tu.assign_non_tensor(part, global_batch_size=len(part))
                    res = actor.train_batch(part, loss_function=loss)
                    metrics.setdefault("loss", []).append(float(sum(res["loss"])))
                    metrics.setdefault("grad_norm", []).append(float(res["metrics"]["grad_norm"]))
                    metrics.setdefault("tree_token_ratio", []).append(
                        actor.last["tree_token_ratio"])
                metrics["lr"] = actor.lr_scheduler_step()
            history.append(metrics)
            if not args.json:
                print(f"step {step}: {len(records)} trajectories, loss "
                      f"{', '.join(f'{x:.3e}' for x in metrics['loss'])}, grad_norm "
                      f"{', '.join(f'{x:.4f}' for x in metrics['grad_norm'])}, prefix sharing "
                      f"{', '.join(f'{x:.2f}x' for x in metrics['tree_token_ratio'])}")
        return dict(engine=type(actor).__name__, strategy=actor_cfg.engine.strategy,
                    layout=actor.core.layout.record(),
                    walk_options={k: str(v) for k, v in actor.options.as_dict().items()},
                    steps=history)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--model", default=None, help="a local HF directory (default: a tiny "
                   "random Qwen3 built here)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more verl config overrides (Hydra syntax)")
    p.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = run(args)
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())

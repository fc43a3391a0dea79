"""AReaL's GRPO with DTA as the train engine on the τ²-shaped task
(:mod:`runtime.areal.examples.tau2_workflow`).

Smoke mode — CPU, a tiny random model built locally, the in-process smoke inference engine,
about a minute::

    python -m runtime.areal.examples.tau2_grpo --smoke --config configs/areal/tau2-grpo-smoke.yaml

Real mode — SGLang servers on GPUs, launched by AReaL's own launcher (SPMD), e.g. one node with
one inference GPU and one training GPU::

    python -m areal.infra.launcher.local runtime/areal/examples/tau2_grpo.py \\
        --config configs/areal/tau2-grpo.yaml actor.path=/models/Qwen3-1.7B

(or without the launcher, in AReaL's single-controller mode: ``python -m
runtime.areal.examples.tau2_grpo --config configs/areal/tau2-grpo.yaml scheduler.type=local``).
Every key is AReaL's ``PPOConfig`` key, plus the ``actor.dta`` block; ``key=value`` overrides
follow the file.
"""
from __future__ import annotations

import os
import sys

__all__ = ["make_smoke_model", "build_trainer", "main"]


def make_smoke_model(path: str, *, vocab_size: int = 512, seed: int = 0) -> str:
    """A tiny random Qwen3 (2 layers, hidden 64) and a word-level tokenizer, saved to ``path``
    — built from a config, nothing downloaded. Ids 0 and 1 are pad and eos."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dta.model.models import save_word_tokenizer

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return save_word_tokenizer(path, vocab_size)


def build_trainer(config, *, smoke: bool):
    """The ``DTAPPOTrainer`` and its workflow for the τ²-shaped task (one task per dataset
    item; ``train_dataset.batch_size`` tasks × ``gconfig.n_samples`` episodes per step)."""
    from transformers import AutoConfig

    from runtime.areal.examples.tau2_workflow import Tau2ShapedWorkflow, tau2_tasks
    from runtime.areal.trainer import DTAPPOTrainer

    n_tasks = 4 * config.train_dataset.batch_size
    trainer = DTAPPOTrainer(config, train_dataset=tau2_tasks(n_tasks),
                            inference_engine="smoke" if smoke else None)
    vocab = AutoConfig.from_pretrained(config.actor.path, local_files_only=True).vocab_size
    workflow = Tau2ShapedWorkflow(config.gconfig, vocab_size=vocab, seed=config.seed)
    return trainer, workflow


def main(argv: list[str]) -> None:
    from runtime.areal.ppo_config import load_dta_ppo_config

    smoke = "--smoke" in argv
    argv = [a for a in argv if a != "--smoke"]
    if smoke:
        os.environ.setdefault("AREAL_SPMD_MODE", "1")  # engines in this process
    config, _ = load_dta_ppo_config(argv)
    if smoke and not os.path.isdir(config.actor.path):
        make_smoke_model(config.actor.path)
    trainer, workflow = build_trainer(config, smoke=smoke)
    with trainer:
        trainer.train(workflow)


if __name__ == "__main__":
    main(sys.argv[1:])

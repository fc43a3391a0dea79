"""AReaL's own RL loop with DTA: ``DTAPPOTrainer(...).train()`` (AReaL's PPOTrainer, GRPO) with
the smoke inference engine on the τ²-shaped task, on CPU.

* 2 GRPO steps: the inference engine receives the weights of versions 1 and 2 by disk update
  (after AReaL's name-resolve "weights ready" record), the parameters change, DTA's tree
  statistics are in the stats the trainer commits;
* ``recover.mode=on``: a run stopped after step 1 resumes from AReaL's RecoverHandler (DCP
  checkpoint, dataloader, saver state) and its step-2 parameters are bit-identical to an
  uninterrupted run's;
* the ``actor.dta`` block is validated like every other key.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from runtime.areal.examples.tau2_grpo import build_trainer, make_smoke_model  # noqa: E402
from runtime.areal.ppo_config import load_dta_ppo_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_CONFIG = os.path.join(ROOT, "configs", "areal", "tau2-grpo-smoke.yaml")


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory):
    return make_smoke_model(str(tmp_path_factory.mktemp("smoke") / "model"), vocab_size=256)


@pytest.fixture
def spmd(monkeypatch):
    """The engines in this process (AReaL's SPMD mode), eager AReaL kernels."""
    import torch._dynamo

    monkeypatch.setenv("AREAL_SPMD_MODE", "1")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    with torch._dynamo.config.patch(disable=True):
        yield


def config(tmp_path, model, trial: str, *overrides: str):
    cfg, _ = load_dta_ppo_config([
        "--config", SMOKE_CONFIG, f"actor.path={model}", f"trial_name={trial}",
        f"cluster.fileroot={tmp_path}/fileroot",
        f"cluster.name_resolve.nfs_record_root={tmp_path}/name_resolve",
        "gconfig.n_samples=2", "gconfig.max_new_tokens=4", *overrides])
    return cfg


def run(cfg):
    """Train; returns (trainer, committed stats per step, final fp32 master weights)."""
    trainer, workflow = build_trainer(cfg, smoke=True)
    committed = []
    commit = trainer.stats_logger.commit

    def record(epoch, step, global_step, stats):
        committed.append((global_step, dict(stats)))
        return commit(epoch, step, global_step, stats)

    trainer.stats_logger.commit = record
    with trainer:
        before = [m.detach().clone() for m in trainer.actor.core.sharding.masters]
        trainer.train(workflow)
        after = [m.detach().clone() for m in trainer.actor.core.sharding.masters]
        updates = list(trainer.rollout.updates)
        trained = {n: p.detach().float() for n, p in trainer.actor.model.named_parameters()}
        served = {n: p.detach().clone() for n, p in trainer.rollout.model.named_parameters()}
    return dict(before=before, after=after, committed=committed, updates=updates,
                trained=trained, served=served)


def test_grpo_two_steps_then_resume_bit_identical(tmp_path, smoke_model, spmd):
    recover = ["recover.mode=on", "recover.freq_steps=1"]
    # an uninterrupted 2-step run, saving HF weights every step (AReaL's Saver would import
    # ArchonEngine -> triton here, which CPU machines lack)
    full = run(config(tmp_path, smoke_model, "full", *recover, "saver.freq_steps=1"))
    saved = tmp_path / "fileroot" / "checkpoints"
    assert len(list(saved.glob("*/dta-tau2-smoke/full/default/epoch0epochstep*globalstep*"
                               "/model.safetensors"))) == 2
    assert [u["version"] for u in full["updates"]] == [1, 2]
    assert all(u["record"].endswith(f"/update_weights_from_disk/{u['version'] - 1}")
               for u in full["updates"])
    assert not any(os.path.exists(u["path"]) for u in full["updates"])  # cleared after load
    for name, p in full["trained"].items():  # the inference engine serves the trained weights
        assert torch.equal(full["served"][name], p), name
    assert any(not torch.equal(a, b) for a, b in zip(full["before"], full["after"]))
    assert [s for s, _ in full["committed"]] == [0, 1]
    for _, stats in full["committed"]:
        assert stats["tree_token_ratio"] > 1.0  # the group shares its prompt
        assert stats["tree_sequences"] == 4  # 2 tasks x 2 samples
        assert stats["tree_unique_tokens"] < stats["tree_total_tokens"]
        assert stats["ppo_actor/update/update_successful"] == 1.0
    # the same run stopped after step 1 ...
    stopped = run(config(tmp_path, smoke_model, "resumed", *recover, "total_train_steps=1"))
    assert [u["version"] for u in stopped["updates"]] == [1]
    # ... and resumed: RecoverHandler loads the DCP checkpoint and republishes version 1
    resumed = run(config(tmp_path, smoke_model, "resumed", *recover))
    assert [u["version"] for u in resumed["updates"]] == [1, 2]
    assert [s for s, _ in resumed["committed"]] == [1]
    for a, b in zip(resumed["before"], stopped["after"]):
        assert torch.equal(a, b)  # step 1's weights, restored
    for a, b in zip(resumed["after"], full["after"]):
        assert torch.equal(a, b)  # step 2 bit-identical to the uninterrupted run


def test_reference_model_is_a_dta_engine(tmp_path, smoke_model, spmd):
    """With ``kl_ctl > 0`` and a ``ref`` block, the reference model is DTA too."""
    from runtime.areal import DTAPPOActor

    cfg = config(tmp_path, smoke_model, "ref", "total_train_steps=1", "actor.kl_ctl=0.1",
                 "+ref.backend=fsdp:d1", "+ref.experiment_name=dta-tau2-smoke",
                 "+ref.trial_name=ref", f"+ref.path={smoke_model}", "+ref.attn_impl=sdpa",
                 "+ref.dta.policy=recompute")
    trainer, workflow = build_trainer(cfg, smoke=True)
    with trainer:
        assert isinstance(trainer.ref, DTAPPOActor) and trainer.ref.optimizer is None
        assert trainer.ref.policy == "recompute"
        trainer.train(workflow)
        assert trainer.ref.export_stats()["tree_sequences"] == 4  # ref_logp walked the tree


def test_refusals(tmp_path, smoke_model, spmd):
    from areal.api.alloc_mode import ModelAllocation

    from runtime.areal import DTAPPOTrainer

    cfg = config(tmp_path, smoke_model, "bad")
    with pytest.raises(ValueError, match="'megatron'"):
        DTAPPOTrainer._create_train_engine(object.__new__(DTAPPOTrainer), cfg.actor,
                                           ModelAllocation.from_str("megatron:d1"))
    with pytest.raises(ValueError, match="inference_engine must be"):
        DTAPPOTrainer(cfg, train_dataset=[{"task_id": 0}] * 4, inference_engine="sglang")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AREAL_SPMD_MODE")  # AReaL's default: single controller
        with pytest.raises(ValueError, match="AREAL_SPMD_MODE=1"):
            DTAPPOTrainer(cfg, train_dataset=[{"task_id": 0}] * 4, inference_engine="smoke")
    cfg.critic = object()
    with pytest.raises(NotImplementedError, match="critic"):
        DTAPPOTrainer(cfg, train_dataset=[{"task_id": 0}] * 4)
    import torch.distributed as dist

    assert not dist.is_initialized()  # refused before any process group was made


def test_dta_block_is_validated_like_every_key(tmp_path, smoke_model):
    from omegaconf.errors import ConfigKeyError

    cfg = config(tmp_path, smoke_model, "t", "actor.dta.policy=recompute",
                 "actor.dta.logits_chunk=64", "actor.dta.sharding=fsdp")
    assert cfg.actor.dta.policy == "recompute" and cfg.actor.dta.logits_chunk == 64
    assert cfg.actor.dta.sharding == "fsdp"
    assert config(tmp_path, smoke_model, "t").actor.dta.sharding is None  # fsdp:dN decides
    with pytest.raises(ValueError, match="unknown DTA sharding 'zero3'"):
        config(tmp_path, smoke_model, "t", "actor.dta.sharding=zero3")
    with pytest.raises(ConfigKeyError, match="polcy"):
        config(tmp_path, smoke_model, "t", "+actor.dta.polcy=recompute")
    with pytest.raises(ValueError, match="actor.dta.policy: 'keep'"):
        config(tmp_path, smoke_model, "t", "actor.dta.policy=keep")


def test_real_mode_config_loads():
    """configs/areal/tau2-grpo.yaml (SGLang on GPUs; not run here) is a valid DTAPPOConfig."""
    cfg, _ = load_dta_ppo_config(["--config", os.path.join(ROOT, "configs", "areal",
                                                           "tau2-grpo.yaml")])
    assert cfg.rollout.backend == "sglang:d1" and cfg.actor.weight_update_mode == "xccl"
    assert cfg.actor.dta.policy == "recompute" and cfg.recover.mode == "on"

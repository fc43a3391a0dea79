"""DTA as a remote training worker in AReaL's single-controller mode, live (CPU).

AReaL's ``LocalScheduler`` starts an RPC worker process; ``DTAPPOActor.as_controller`` (AReaL's
``PPOActorController``) creates ``runtime.areal.actor.DTAPPOActor`` there by its import path
and drives it over RPC: process group, initialize, compute_logp, compute_advantages,
ppo_update, the LR scheduler, export_stats (with DTA's tree statistics), versions, destroy.

Marked ``slow`` (excluded from the default suite): it starts a worker process that imports
torch and areal, about 30 s on 2 busy cores. Run with ``pytest -m slow tests/test_areal_controller.py``.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("areal")
pytestmark = [pytest.mark.areal, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dta_actor_runs_as_a_remote_worker(tmp_path, monkeypatch):
    from areal.api.cli_args import OptimizerConfig, SchedulingSpec
    from areal.api.io_struct import FinetuneSpec
    from areal.infra.scheduler.local import LocalScheduler

    from runtime.areal import DTAOptions, DTAPPOActor
    from runtime.areal.examples.tau2_grpo import make_smoke_model
    from runtime.areal.ppo_config import DTAPPOActorConfig

    monkeypatch.delenv("AREAL_SPMD_MODE", raising=False)
    model = make_smoke_model(str(tmp_path / "model"), vocab_size=128)
    for sub in ("fileroot", "name_resolve"):
        (tmp_path / sub).mkdir()
    spec = SchedulingSpec(cpu=1, gpu=0, mem=4,
                          cmd=f"{sys.executable} -m areal.infra.rpc.rpc_server",
                          env_vars={"PYTHONPATH": ROOT, "TORCHDYNAMO_DISABLE": "1",
                                    "DTA_TEST_THREADS": "1"})
    config = DTAPPOActorConfig(backend="fsdp:d1", experiment_name="sc", trial_name="t0",
                               path=model, attn_impl="sdpa", optimizer=OptimizerConfig(lr=1e-3),
                               scheduling_spec=[spec], ppo_n_minibatches=1, kl_ctl=0.0,
                               dta=DTAOptions(policy="recompute"))
    scheduler = LocalScheduler(experiment_name="sc", trial_name="t0",
                               fileroot=str(tmp_path / "fileroot"),
                               nfs_record_root=str(tmp_path / "name_resolve"),
                               startup_timeout=300)
    controller = DTAPPOActor.as_controller(config, scheduler)
    controller.create_process_group()
    try:
        controller.initialize(role="actor", ft_spec=FinetuneSpec(
            total_train_epochs=1, dataset_size=4, train_batch_size=2))
        g = torch.Generator().manual_seed(0)
        batch = []
        for reward in (0.0, 1.0):
            mask = torch.zeros(1, 20, dtype=torch.int32)
            mask[:, 10:] = 1
            batch.append(dict(input_ids=torch.randint(2, 128, (1, 20), generator=g),
                              attention_mask=torch.ones(1, 20, dtype=torch.bool),
                              loss_mask=mask, logprobs=torch.full((1, 20), -4.0),
                              versions=torch.zeros(1, 20, dtype=torch.int32),
                              rewards=torch.tensor([reward])))
        logps = controller.compute_logp(batch)  # remote tensors (RTensor) on the controller
        assert [tuple(lp.shape) for lp in logps] == [(1, 20), (1, 20)]
        assert all(bool(torch.isfinite(lp.to_local()).all()) for lp in logps)
        for traj, lp in zip(batch, logps):
            traj["prox_logp"] = lp
        controller.ppo_update(controller.compute_advantages(batch))
        controller.step_lr_scheduler()
        stats = controller.export_stats()
        assert stats["ppo_actor/update/update_successful"] == 1.0
        assert stats["tree_sequences"] == 2.0 and stats["tree_total_tokens"] == 40.0
        controller.set_version(1)
        assert controller.get_version() == 1
    finally:
        controller.destroy()

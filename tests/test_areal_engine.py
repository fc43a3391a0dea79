"""The AReaL engine's own behaviour beyond the FSDPEngine comparisons of tests/test_areal.py
(its fixtures and per-sequence reference): sequences kept apart in forward_backward_batch, a
skipped update on a non-finite gradient norm, HF save/load with the optimizer state and tree
statistics, two data-parallel ranks against one, AReaL's PPOActor for 2 steps, the dta run
config driving the actor, bf16 compute with fp32 masters."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from areal.api.cli_args import (  # noqa: E402
    MicroBatchSpec,
    NormConfig,
    PPOActorConfig,
    RejectionSamplingConfig,
)
from areal.api.io_struct import SaveLoadMeta  # noqa: E402
from areal.utils.data import (  # noqa: E402
    Normalization,
    amend_position_ids,
    pack_tensor_dict,
    pad_mb_list,
    split_padded_tensor_dict_into_mb_list,
    unsqueeze_mb_list,
)

from dta.tree import PrefixTree  # noqa: E402
from runtime.areal import DTAOptions, DTAPPOActor, actor_config_from_dta, convert  # noqa: E402
from tests.test_areal import (  # noqa: E402
    RS,
    TEMPERATURE,
    VOCAB,
    _gather,
    eager_areal,  # noqa: F401  (a fixture)
    engine_config,
    grpo,
    ids_only,
    loss_weight_fn,
    make_train_batch,
    max_rel,
    model_dir,  # noqa: F401  (a fixture)
    new_engine,
    params_of,
    records,  # noqa: F401  (a fixture)
)


def test_forward_backward_batch_keeps_sequences_apart(model_dir, records, eager_areal):
    """The micro-batch interface (no prefix sharing) gives forward_batch's log-probs even
    with several sequences packed in one micro-batch."""
    eng = new_engine(engine_config(model_dir, 1))
    base = ids_only(convert.from_records(records[:4]))
    expected = eng.forward_batch(dict(base))
    data = amend_position_ids(dict(base))
    mb_list = split_padded_tensor_dict_into_mb_list(data, MicroBatchSpec(n_mbs=1))
    mb_list.mbs = [pack_tensor_dict(mb) for mb in mb_list.mbs]
    mb_list = unsqueeze_mb_list(pad_mb_list(mb_list, pad_value=0.0))
    seen = []

    def process(logits, ctx):
        labels = torch.roll(ctx["model_inputs"]["input_ids"][0], -1)
        lp, _ = _gather(logits, labels, TEMPERATURE)
        seen.append(lp[:len(lp) - ctx["pad_length"]])

    eng.forward_backward_batch(mb_list, process, forward_only=True)
    packed = torch.cat(seen)
    cu = mb_list.mbs[0]["cu_seqlens"].tolist()
    for k, i in enumerate(mb_list.forward_indices):
        n = cu[k + 1] - cu[k]
        seg = packed[cu[k]:cu[k + 1]]
        # all but the last position (its label is the next packed sequence's first token)
        assert float((seg[:n - 1] - expected[i, :n - 1]).abs().max()) < 2e-5
    eng.destroy()


def test_non_finite_gradient_skips_the_update(model_dir, records, eager_areal):
    """A group whose rewards are all equal, normalized with eps 0 (AReaL's Normalization),
    gets NaN advantages: the gradient is NaN, the step is skipped, the parameters stay and
    the next good batch trains."""
    n = len(records)
    eng = new_engine(engine_config(model_dir, n))
    base = convert.from_records(records)
    lp = eng.forward_batch(ids_only(base))
    batch = make_train_batch(records, lp)
    mask = batch["loss_mask"].float()
    norm = Normalization(NormConfig(mean_level="batch", std_level="batch", eps=0.0))
    bad = dict(batch, advantages=norm(torch.ones_like(mask) * mask, mask))
    assert torch.isnan(bad["advantages"]).any()
    before = params_of(eng.model)

    stats = eng.train_batch(bad, grpo(), loss_weight_fn)
    assert stats["update_successful"] == 0.0 and not math.isfinite(stats["grad_norm"])
    assert set(stats) == {"update_successful", "grad_norm", "lr", "num_micro_batches"}
    assert all(torch.equal(before[k], v) for k, v in params_of(eng.model).items())
    assert all(p.grad is None for p in eng.model.parameters())

    stats = eng.train_batch(dict(batch), grpo(), loss_weight_fn)
    assert stats["update_successful"] == 1.0 and math.isfinite(stats["grad_norm"])
    assert not all(torch.equal(before[k], v) for k, v in params_of(eng.model).items())
    eng.destroy()


def test_save_load_round_trip_and_tree_stats(model_dir, records, eager_areal, tmp_path):
    n = len(records)
    cfg = engine_config(model_dir, n)
    eng = new_engine(cfg)
    base = convert.from_records(records)
    batch = make_train_batch(records, eng.forward_batch(ids_only(base)))
    eng.train_batch(dict(batch), grpo(), loss_weight_fn)
    eng.lr_scheduler_step()

    stats = eng.export_stats()
    seqs = [np.asarray(r["input_ids"]) for r in records]
    tree = PrefixTree(seqs).stats()
    assert stats["tree_token_ratio"] == pytest.approx(tree.total_tokens / tree.unique_tokens)
    assert stats["tree_token_ratio"] > 1.0 and stats["tree_sequences"] == n

    path = str(tmp_path / "ckpt")
    eng.save(SaveLoadMeta(path=path, weight_format="hf", with_optim=True,
                          tokenizer=eng.tokenizer))
    assert {"config.json", "model.safetensors", "optim_world_size_1_rank_0.pt",
            "tokenizer.json"} <= set(os.listdir(path))

    other = new_engine(engine_config(path, n))  # a fresh engine on the saved directory
    assert max_rel(params_of(other.model), params_of(eng.model)) == 0.0
    other.load(SaveLoadMeta(path=path, weight_format="hf", with_optim=True))
    # the restored Adam moments: a second identical step stays identical
    batch2 = make_train_batch(records, eng.forward_batch(ids_only(base)), seed=1)
    eng.train_batch(dict(batch2), grpo(), loss_weight_fn)
    other.train_batch(dict(batch2), grpo(), loss_weight_fn)
    assert max_rel(params_of(other.model), params_of(eng.model)) == 0.0
    eng.destroy()
    other.destroy()


_DP_WORKER = r"""
import functools, os, sys, torch, torch._dynamo
torch._dynamo.config.disable = True
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from tests.test_areal import FT_SPEC, engine_config, grpo, loss_weight_fn, make_train_batch
from experiments.workloads import make_workload
from runtime.areal import DTATrainEngine, convert
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
records = make_workload("tau2-airline", scale="tiny", seed=0, vocab_size={vocab})
batch = make_train_batch(records.records, torch.full((len(records.records), 1), -6.0))
mine = {{k: v[rank::world] for k, v in batch.items()}}
engine = DTATrainEngine(engine_config({path!r}, 1, backend="fsdp:d2"))
engine.create_process_group()
engine.initialize(None, FT_SPEC)
assert engine.data_parallel_world_size == 2 and engine.data_parallel_rank == rank
assert engine.sharding == "fsdp"  # what AReaL's fsdp:d2 means (actor.dta.sharding unset)
stats = engine.train_batch(mine, grpo(), loss_weight_fn)
params = engine.full_state_dict()  # gathered: a collective on every rank
if rank == 0:
    torch.save(dict(stats=stats, params=params), {out!r})
engine.destroy()
"""


def test_two_data_parallel_ranks_match_one(model_dir, records, eager_areal, tmp_path):
    """2 gloo ranks (``fsdp:d2``: sharded with fsdp by default), each with half the sequences:
    the global loss weight is all-reduced and the gradients summed over the shards, so the
    step is the 1-rank step on the whole batch."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "rank0.pt")
    code = _DP_WORKER.format(root=root, vocab=VOCAB, path=model_dir, out=out)
    env = {**os.environ, "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=root,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    batch = make_train_batch(records, torch.full((len(records), 1), -6.0))
    eng = new_engine(engine_config(model_dir, 1))
    stats = eng.train_batch(batch, grpo(), loss_weight_fn)
    two = torch.load(out)
    assert two["stats"]["update_successful"] == 1.0
    assert abs(two["stats"]["grad_norm"] / stats["grad_norm"] - 1) < 1e-5
    assert max_rel(two["params"], params_of(eng.model)) < 1e-5
    eng.destroy()


def test_ppo_actor_updates_through_the_engine(model_dir, records, eager_areal):
    """AReaL's PPOActor, unchanged, for 2 steps (tau2 actor settings): rollout-form
    trajectories -> compute_logp (prox_logp) -> compute_advantages -> ppo_update."""
    cfg = engine_config(
        model_dir, 1, cls=PPOActorConfig, ppo_n_minibatches=2, eps_clip=0.4,
        use_decoupled_loss=True, recompute_logprob=True,
        rejection_sampling=RejectionSamplingConfig(**RS), kl_ctl=0.0, reward_scaling=10.0,
        reward_bias=-0.5, adv_norm=NormConfig(mean_level="batch", std_level="batch"))
    actor = new_engine(cfg, cls=DTAPPOActor)
    # one trajectory dict [G, S_g] per task group, as AReaL's rollout returns them
    groups: dict[int, list] = {}
    for rec in records:
        groups.setdefault(rec["group_id"], []).append(rec)
    data = []
    g = torch.Generator().manual_seed(0)
    for recs in groups.values():
        traj = convert.from_records(recs, rolled=False)
        traj.pop("advantages")
        traj["loss_mask"] = traj["loss_mask"].int()
        traj["rewards"] = (torch.rand(len(recs), generator=g) > 0.5).float()
        traj["versions"] = torch.where(traj["loss_mask"].bool(), 0, -1)
        data.append(traj)
    # behaviour log-probs near the model's (token-aligned, as the inference engine reports)
    for traj, lp in zip(data, actor.compute_logp(data)):
        behave = torch.roll(lp, 1, -1) + 0.2 * torch.randn(lp.shape, generator=g)
        traj["logprobs"] = torch.where(traj["loss_mask"].bool(), behave, 0.0)
    initial = params_of(actor.model)
    for step in range(2):
        batch = [dict(t) for t in data]
        for traj, lp in zip(batch, actor.compute_logp(batch)):
            traj["prox_logp"] = lp
        adv = actor.compute_advantages(batch)
        actor.ppo_update(adv)
        actor.step_lr_scheduler()
        actor.set_version(step + 1)
        stats = actor.export_stats()
        losses = [v for k, v in stats.items() if k.endswith("actor_loss/avg")]
        assert losses and all(math.isfinite(v) for v in losses), stats
        assert stats["ppo_actor/update/update_successful"] == 1.0
        assert math.isfinite(stats["ppo_actor/update/grad_norm"])
    assert actor.get_version() == 2
    assert max_rel(params_of(actor.model), initial) > 0
    actor.destroy()


def test_dta_run_config_drives_the_actor(model_dir, eager_areal):
    """configs/tau2-airline-grpo.yaml + `actor.eps_clip=0.3` as AReaL's PPOActorConfig: the
    override and the tau2 settings arrive (behav_imp_weight_cap 5 -> rejection sampling)."""
    from dta.config.schema import ConfigError, load_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    preset = os.path.join(root, "configs", "tau2-airline-grpo.yaml")
    cfg = load_config(preset, [f"model.path={model_dir}", "actor.eps_clip=0.3",
                               "walker.policy=recompute"])
    config, options = actor_config_from_dta(cfg)
    assert isinstance(config, PPOActorConfig) and config.path == model_dir
    assert config.eps_clip == 0.3 and config.eps_clip_higher == 0.4
    assert config.use_decoupled_loss and config.recompute_logprob
    rs = config.rejection_sampling
    assert (rs.metric, rs.upper, rs.level, rs.action) == ("ratio", 5.0, "token", "mask")
    assert config.adv_norm.mean_level == "group" and config.adv_norm.group_size == 8
    assert config.optimizer.lr == cfg.optimizer.lr and config.optimizer.gradient_clipping == 1.0
    assert options.policy == "recompute" and options.dtype is None
    assert options.block_tokens == 2048  # walker.block_tokens=auto without a budget
    assert actor_config_from_dta(load_config(preset, [f"model.path={model_dir}",
                                                      "walker.block_tokens=0"]))[1].block_tokens == 0
    with pytest.raises(ValueError, match="block_tokens"):
        DTAOptions(block_tokens=-1)
    assert actor_config_from_dta(load_config(preset, [f"model.path={model_dir}",
                                                      "model.dtype=float64"]))[1].dtype == "float64"
    with pytest.raises(ValueError, match="'model.path'"):
        actor_config_from_dta(load_config(preset))
    with pytest.raises(ConfigError, match="actor.eps_clp"):
        load_config(preset, ["actor.eps_clp=0.3"])
    actor = new_engine(config, options, cls=DTAPPOActor)
    assert actor.policy == "recompute" and actor.actor.config.eps_clip == 0.3
    actor.destroy()


def test_bfloat16_compute_with_float32_master_weights(model_dir, records, eager_areal):
    """AReaL's default precision (dtype bfloat16, optimizer_dtype float32): the optimizer
    steps float32 master copies, the model holds their bfloat16 cast."""
    n = len(records)
    eng = new_engine(engine_config(model_dir, n, dtype="bfloat16"))
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    assert all(m.dtype == torch.float32 for m in eng.core.sharding.masters)
    base = convert.from_records(records)
    lp = eng.forward_batch(ids_only(base))
    assert lp.dtype == torch.float32  # AReaL's log-probs are float32 whatever the model dtype
    before = [m.detach().clone() for m in eng.core.sharding.masters]
    stats = eng.train_batch(make_train_batch(records, lp), grpo(), loss_weight_fn)
    assert stats["update_successful"] == 1.0
    assert any(not torch.equal(a, m) for a, m in zip(before, eng.core.sharding.masters))
    for m, p in zip(eng.core.sharding.masters, eng.model.parameters()):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
    state = next(iter(eng.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32
    eng.destroy()

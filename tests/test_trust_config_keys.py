"""Every config key is used by `dta train` or rejected: a test walks the schema and every
shipped config. GRPO advantages come from rewards as AReaL's adv_norm computes them."""
import glob
import os

import numpy as np
import pytest
import torch

from dta.config.keys import KEY_USE, NOT_IN_DTA_TRAIN, check_dta_train
from dta.config.schema import ConfigError, NormConfig, _all_keys, default_config, load_config
from dta_cli.batches import BatchSource, BatchSourceError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `dta train` configs; configs/areal-*.yaml are AReaL PPOConfig files (AReaL's own schema,
# checked by AReaL's loader and tests/test_areal*.py)
CONFIGS = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                 if not os.path.basename(p).startswith("areal-"))


def leaf_keys(node, prefix=""):
    from omegaconf import DictConfig
    out = []
    for k in node:
        v = node[k]
        if isinstance(v, DictConfig):
            out += leaf_keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def test_every_schema_key_is_used_or_rejected():
    schema = set(_all_keys(default_config())) | {f"actor.adv_norm.{k}" for k in
                                                NormConfig.__dataclass_fields__}
    sections = {k for k in schema if any(o.startswith(k + ".") for o in schema)}  # model.lora too
    classified = set(KEY_USE) | set(NOT_IN_DTA_TRAIN)
    assert schema - sections - classified == set()
    assert not set(KEY_USE) & set(NOT_IN_DTA_TRAIN)
    assert classified <= schema


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_key_of_a_shipped_config_is_used_or_rejected(path):
    from omegaconf import OmegaConf
    cfg = load_config(path)
    check_dta_train(cfg)  # the shipped config passes
    for key in leaf_keys(OmegaConf.load(path)):
        assert key in KEY_USE or key in NOT_IN_DTA_TRAIN, key
        if key in NOT_IN_DTA_TRAIN:  # accepted only at its neutral value
            assert OmegaConf.select(cfg, key) == NOT_IN_DTA_TRAIN[key][0], key


@pytest.mark.parametrize("key", sorted(NOT_IN_DTA_TRAIN))
def test_unimplemented_key_is_rejected_naming_it(key):
    neutral = NOT_IN_DTA_TRAIN[key][0]
    other = {int: 2, float: 0.5, bool: True, str: "k2"}[type(neutral)]
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        check_dta_train(load_config(None, [f"{key}={other}"]))


@pytest.mark.parametrize("override, key", [
    (["loss.name=nll", "loss.entropy_coef=0.1"], "loss.entropy_coef"),
    (["actor.behav_imp_weight_cap=5"], "loss.behav_imp_weight_cap"),
    (["optimizer.name=sgd", "optimizer.eps=1e-6"], "optimizer.eps"),
    (["workload.path=x.jsonl", "workload.scale=tiny"], "workload.scale"),
    (["workload.sequences_per_step=4"], "workload.sequences_per_step"),
    (["actor.group_size=8"], "actor.group_size"),
])
def test_key_without_effect_in_context_is_rejected(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        check_dta_train(load_config(None, override))


def test_reward_keys_without_rewards_are_rejected(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"input_ids": [3, 4, 5], "advantages": 1.0}\n')
    cfg = load_config(None, [f"workload.path={path}", "actor.reward_scaling=2"])
    with pytest.raises(BatchSourceError, match="'actor.reward_scaling' has no effect"):
        BatchSource(cfg, 512).batch(0)


def test_grpo_advantages_match_areal_normalization(tmp_path):
    """dta train's advantages from JSONL rewards == AReaL's Normalization on the token-level
    rewards (consecutive groups of 3, as the records' group_id)."""
    import json

    from areal.api.cli_args import NormConfig as ArealNorm
    from areal.utils.data import Normalization
    rng = np.random.default_rng(0)
    lines, S = [], 12
    for i in range(6):
        n = int(rng.integers(4, S))
        mask = [0, 0] + [int(x) for x in rng.integers(0, 2, n - 3)] + [1]
        lines.append({"input_ids": rng.integers(3, 500, n).tolist(), "loss_mask": mask,
                      "reward": float(rng.random() * 2), "group_id": i // 3})
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = load_config(None, [f"workload.path={path}", "actor.reward_bias=-0.5",
                             "actor.reward_scaling=2", "actor.adv_norm.mean_level=group",
                             "actor.adv_norm.std_level=batch", "actor.adv_norm.group_size=3"])
    batch = BatchSource(cfg, 512).batch(0)
    M = torch.zeros(6, S, dtype=torch.float64)
    R = torch.zeros(6, S, dtype=torch.float64)
    for i, x in enumerate(lines):
        n = len(x["input_ids"])
        M[i, :n] = torch.tensor(x["loss_mask"], dtype=torch.float64)
        R[i, :n] = (x["reward"] - 0.5) * 2
    ref = Normalization(ArealNorm(mean_level="group", std_level="batch", group_size=3))(R * M, M)
    for i, x in enumerate(lines):
        n = len(x["input_ids"])
        got = batch.fields["advantages"][i] * batch.loss_mask(i)
        assert np.abs(got - ref[i, :n].double().numpy()).max() < 1e-6  # AReaL returns float32
    assert np.ptp([batch.fields["advantages"][i][-1] for i in range(6)]) > 0.5


def test_adv_norm_config_recomputes_generated_advantages():
    cfg = load_config(os.path.join(ROOT, "configs", "tau2-airline-grpo.yaml"),
                      ["model.size=tiny", "workload.scale=tiny"])
    src = BatchSource(cfg, 512)
    given = src.records(0)
    batch = src.batch(0)
    # every trained token's advantage is its group-normalized episode reward
    for i, rec in enumerate(given):
        m = batch.loss_mask(i) > 0
        vals = batch.fields["advantages"][i][m]
        assert np.ptp(vals) < 1e-12
    adv = [batch.fields["advantages"][i][-1] for i in range(len(given))]
    pairs = [(a, b) for a in range(len(given)) for b in range(len(given))
             if given[a]["group_id"] == given[b]["group_id"]
             and given[a]["reward"] > given[b]["reward"]]
    assert pairs and all(adv[a] > adv[b] for a, b in pairs)  # a better reward, a larger advantage
    with pytest.raises(BatchSourceError, match="has its own 'advantages'"):
        import json
        import tempfile
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write(json.dumps({"input_ids": [3, 4, 5], "reward": 1.0, "advantages": 1.0}) + "\n")
        BatchSource(load_config(None, [f"workload.path={f.name}",
                                       "actor.adv_norm.mean_level=batch"]), 512).batch(0)

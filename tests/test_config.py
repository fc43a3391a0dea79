"""Run configuration: defaults <- YAML <- overrides, strict keys and values, `dta train`'s
parser (no Ray here)."""
from __future__ import annotations

import os

import pytest
import yaml

from dta.config.loss import loss_kwargs
from dta.config.schema import ConfigError, as_dict, from_dict, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml"))


def config_path(name: str) -> str:
    return os.path.join(ROOT, "configs", name)


def test_presets_exist():
    assert {"default.yaml", "tau2-airline-grpo.yaml", "sft.yaml",
            "gpu-qwen3-0.6b.yaml"} <= set(CONFIGS)


def test_default_yaml_is_the_embedded_default():
    assert as_dict(load_config(config_path("default.yaml"))) == as_dict(load_config())


@pytest.mark.parametrize("name", CONFIGS)
def test_override_reaches_actor_and_loss(name):
    base = load_config(config_path(name))
    cfg = load_config(config_path(name), ["actor.eps_clip=0.3"])
    assert cfg.actor.eps_clip == 0.3
    # The loss follows the actor key (an interpolation), so `dta train` optimizes with it.
    assert cfg.loss.eps_clip == 0.3 and loss_kwargs(cfg).get("eps_clip", 0.3) == 0.3
    assert base.actor.eps_clip != 0.3


def test_presets_differ_where_they_should():
    grpo = load_config(config_path("tau2-airline-grpo.yaml"))
    assert grpo.loss.decoupled is True and grpo.loss.eps_clip == 0.4
    assert grpo.loss.behav_imp_weight_cap == 5.0
    assert load_config(config_path("sft.yaml")).loss.name == "nll"
    gpu = load_config(config_path("gpu-qwen3-0.6b.yaml"))
    assert gpu.model.size == "qwen3-0.6b" and gpu.ray.gpus_per_worker == 1


def test_explicit_loss_key_beats_the_actor_key():
    cfg = load_config(None, ["actor.eps_clip=0.1", "loss.eps_clip=0.5"])
    assert cfg.actor.eps_clip == 0.1 and cfg.loss.eps_clip == 0.5


def test_later_override_wins_and_types_convert():
    cfg = load_config(None, ["ray.num_workers=3", "ray.num_workers=4", "optimizer.lr=3e-5"])
    assert cfg.ray.num_workers == 4 and cfg.optimizer.lr == pytest.approx(3e-5)
    assert isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize("override, key", [
    ("walker.polcy=retain", "walker.polcy"),
    ("model.sise=tiny", "model.sise"),
    ("trainer.steps=3", "trainer"),
])
def test_unknown_key_is_named(override, key):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(None, [override])


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'walker.policy'"):
        load_config(None, ["walker.polcy=retain"])


def test_unknown_key_in_a_yaml_file_names_key_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("walker:\n  polcy: retain\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert "'walker.polcy'" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("override, key", [
    ("walker.policy=foo", "walker.policy"),
    ("walker.reduction=mean", "walker.reduction"),
    ("loss.name=dpo", "loss.name"),
    ("model.family=gpt5", "model.family"),
    ("optimizer.lr=0", "optimizer.lr"),
    ("optimizer.lr=-1e-4", "optimizer.lr"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("train.steps=0", "train.steps"),
    ("train.steps=1.5", "train.steps"),
    ("ray.num_workers=0", "ray.num_workers"),
    ("actor.c_clip=0.5", "actor.c_clip"),
    ("actor.eps_clip=abc", "actor.eps_clip"),
    ("optimizer.betas=[0.9]", "optimizer.betas"),
    ("workload.scale=2", "workload.scale"),
    ("ray.object_store_memory=1000", "ray.object_store_memory"),
])
def test_bad_value_is_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(None, [override])


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["actor.eps_clip"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/dta.yaml")


def test_dict_round_trip():
    cfg = load_config(config_path("tau2-airline-grpo.yaml"), ["ray.num_workers=3"])
    assert as_dict(from_dict(as_dict(cfg))) == as_dict(cfg)


def test_config_module_imports_neither_ray_nor_torch():
    import subprocess
    import sys

    code = ("import sys, dta.config.schema; dta.config.schema.load_config(); "
            "sys.exit(1 if {'ray', 'torch'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_choices_match_the_library_registries():
    from dta.config.schema import CHOICES
    from dta.losses import LOSSES, REDUCTIONS
    from dta.model.models import DTYPES, FAMILIES, SIZES
    from dta.walk import POLICIES

    assert set(CHOICES["model.family"]) == set(FAMILIES)
    assert set(CHOICES["model.size"]) == set(SIZES)
    assert set(CHOICES["model.dtype"]) == set(DTYPES)
    assert "walker.policy" not in CHOICES  # dta.options.WalkOptions validates it
    assert set(POLICIES) == {"retain", "recompute"}
    assert set(CHOICES["walker.reduction"]) == set(REDUCTIONS)
    assert set(CHOICES["loss.name"]) == set(LOSSES)


# ----------------------------------------------------------------- the CLI parser --
def _train_parser():
    from dta_cli import train

    parser = argparse.ArgumentParser(prog="dta train")
    train.add_arguments(parser)
    return parser, train


def test_cli_print_config_takes_the_override(capsys):
    from dta_cli.main import main

    argv = ["train", "--config", config_path("tau2-airline-grpo.yaml"), "--print-config",
            "actor.eps_clip=0.3", "ray.num_workers=3"]
    assert main(argv) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["actor"]["eps_clip"] == 0.3 and printed["loss"]["eps_clip"] == 0.3
    assert printed["ray"]["num_workers"] == 3
    assert printed["loss"]["decoupled"] is True  # from the file


def test_cli_typo_fails_naming_the_key(capsys):
    from dta_cli.main import main

    assert main(["train", "--print-config", "walker.polcy=retain"]) == 2
    assert "unknown config key 'walker.polcy'" in capsys.readouterr().err


@pytest.mark.parametrize("name", CONFIGS)
def test_cli_actor_typo_with_a_config_file_fails_before_running(name, capsys):
    """`dta train --config configs/<name>.yaml actor.eps_clp=0.3` (no --print-config) stops at
    the config, naming the key and the one meant, before Ray or a model is started."""
    from dta_cli.main import main

    assert main(["train", "--config", config_path(name), "actor.eps_clp=0.3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'actor.eps_clp'" in err and "did you mean 'actor.eps_clip'" in err


def test_module_entrypoints_parse_like_the_registry(capsys):
    """`python -m dta_cli.train` (a Ray job's entrypoint) takes the same arguments."""
    from dta_cli import jobs, train

    assert train.main(["--print-config", "actor.eps_clip=0.25"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["loss"]["eps_clip"] == 0.25
    with pytest.raises(SystemExit):
        jobs.main(["submit"])  # --address is required

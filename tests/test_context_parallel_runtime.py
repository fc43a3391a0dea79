"""train.context_parallel in the Ray runtime (docs/context-parallel.md): the setting is one
config key validated where the config is; ``dta train ray.num_workers=4
train.context_parallel=2`` (two data-parallel groups of two ranks whose K/V are spread over
the pair) ends with the same parameter norm as ``ray.num_workers=2`` (slow: two local Ray
runs), and ``--json`` reports the groups."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dta.config.schema import ConfigError, load_config


def test_the_setting_is_validated_with_the_config():
    assert load_config(None, []).train.context_parallel == 1
    cfg = load_config(None, ["ray.num_workers=4", "train.context_parallel=2"])
    assert cfg.train.context_parallel == 2
    for bad, match in ((["train.context_parallel=0"], ">= 1"),
                       (["ray.num_workers=4", "train.context_parallel=3"],
                        "3 does not divide ray.num_workers=4")):
        with pytest.raises(ConfigError, match="config key 'train.context_parallel'.*" + match):
            load_config(None, bad)


def _train(*overrides) -> dict:
    out = subprocess.run([sys.executable, "-m", "dta_cli", "train", "--json", "--no-progress",
                          "train.steps=2", "walker.block_tokens=64",
                          *overrides], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_dta_train_context_parallel_equals_data_parallel():
    cp = _train("ray.num_workers=4", "train.context_parallel=2")
    dp = _train("ray.num_workers=2")
    assert cp["context_parallel"] == 2 and cp["data_parallel"] == 2
    assert cp["context_parallel_groups"] == [[0, 1], [2, 3]]
    assert min(cp["context_parallel_sent_bytes"]) > 0  # the path attention was exchanged
    assert dp["context_parallel"] == 1 and dp["data_parallel"] == 2
    assert abs(cp["param_norm"] - dp["param_norm"]) <= 1e-5 * dp["param_norm"]
    assert cp["loss"] == pytest.approx(dp["loss"], rel=1e-5)

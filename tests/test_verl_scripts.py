"""The verl example (examples/verl/grpo_cpu.py: verl's config with ``strategy: dta`` composed
by Hydra, the engines built as verl's worker builds them, a GRPO step) and the benchmark
(experiments/bench_verl.py) run end to end, tiny, with ``--json``."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.test_verl import VOCAB  # noqa: F401  (skips the module where verl is absent)

pytestmark = pytest.mark.verl
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_example_grpo_step_through_verl_config(capsys):
    spec = importlib.util.spec_from_file_location(
        "grpo_cpu", os.path.join(ROOT, "examples", "verl", "grpo_cpu.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "1", "--json"])
    res = _last_json(capsys)
    assert res["engine"] == "DTAEngineWithLMHead" and res["strategy"] == "dta"
    assert res["walk_options"]["policy"] == "recompute"  # from the yaml's dta: block
    assert res["walk_options"]["block_tokens"] == "2048"
    assert res["layout"] == {"world": 1, "context_parallel": 1, "data_parallel": 1,
                             "sharding": "replicate", "expert_parallel": 1, "shard_size": 1,
                             "offload": "none", "node_resident": False,
                             "prefetch": False}  # one process: nothing to shard
    (step,) = res["steps"]
    assert step["sequences"] == 9 and step["grad_norm"][0] > 0
    assert step["tree_token_ratio"][0] > 2.0  # multi-turn rows share prefixes


def test_bench_verl_tiny(capsys):
    from experiments import bench_verl

    bench_verl.main(["--scale", "tiny", "--model-size", "tiny", "--rounds", "1", "--json"])
    res = _last_json(capsys)
    assert set(res["median_s"]) == {"dta", "fsdp_rmpad", "fsdp_padded"}
    assert set(res["speedup_vs_dta"]) == {"fsdp_rmpad", "fsdp_padded"}
    want = res["loss"]["fsdp_rmpad"]
    for k, v in res["loss"].items():  # the same loss on the same batch and weights
        assert abs(v - want) <= 1e-4 * abs(want), (k, v, want)
    assert res["sequences"] == 9 and res["dta_walked_tokens"] < res["total_tokens"]

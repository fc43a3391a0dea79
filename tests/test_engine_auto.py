"""``train.sharding=auto`` prices context parallelism (runtime/engine/resolve.py): with
``train.context_parallel=2`` the run picks what ``dta plan --memory --context-parallel 2`` picks
for the same batch and budget -- mode, memory policy, block (by the planner's modeled step
time) --, its report says C=2 was priced, and the same budget priced at C=1 (the old bug:
``plan_memory`` called without the context-parallel size) fits nothing;
``train.context_parallel=auto`` takes the planner's C. Slow: the same through
``dta train --json`` on two local Ray workers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dta.config.schema import load_config

# workload "small" (35 sequences, an 854-token path) on the tiny Qwen3 in float32 under
# retain: ~8 MiB per rank (4 ranks; ~10 MiB on 2) fits only with the path spread over 2 ranks
BUDGET_GIB = {4: 0.0078, 2: 0.0098}


def _records_file(tmp_path):
    from dta.records.jsonl import write_jsonl
    from dta_cli.batches import BatchSource

    cfg = load_config(None, ["workload.scale=small"])
    path = tmp_path / "batch.jsonl"
    records = [{k: v for k, v in r.items() if k != "reward"}  # advantages given, no reward
               for r in BatchSource(cfg, 512).records(0)]
    write_jsonl(path, records)
    return str(path)


def _train_overrides(path, workers, cp):
    return [f"workload.path={path}", "model.size=tiny", "model.dtype=float32",
            "walker.policy=retain", "train.sharding=auto", f"ray.num_workers={workers}",
            f"train.context_parallel={cp}", f"train.memory_budget_gib={BUDGET_GIB[workers]}"]


def _plan(capsys, path, workers, cp) -> dict:
    from dta_cli.main import main

    # the layouts a run prices today (no train.expert_parallel / shard_size / offload keys
    # yet: runtime.engine.auto.price's defaults), pinned so that dta plan prices the same
    assert main(["plan", "--input", path, "--workers", str(workers), "--memory", "--model",
                 "tiny", "--budget-gib", str(BUDGET_GIB[workers]), "--policy", "retain",
                 "--compute-dtype", "float32", "--context-parallel", str(cp), "--json",
                 "--expert-parallel", "1", "--shard-size", str(workers), "--offload",
                 "none"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]


def _resolve(path, workers, cp):
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime import Trainer

    trainer = Trainer(load_config(None, _train_overrides(path, workers, cp)))  # no Ray
    trainer.resolve_sharding(BatchSource(trainer.cfg, trainer.vocab_size).batch(0))
    return trainer.settings


def test_auto_prices_context_parallel_as_dta_plan_does(tmp_path, capsys):
    from runtime.ray_runtime import TrainingError

    path = _records_file(tmp_path)
    settings = _resolve(path, 4, 2)
    plan = _plan(capsys, path, 4, 2)
    report = settings.report
    assert plan["chosen"] is not None and plan["context_parallel"] == 2
    assert (settings.layout.sharding, settings.walk.policy, settings.walk.block_tokens) == \
        (plan["chosen"], plan["policy"], plan["block_tokens"])
    assert settings.layout.context_parallel == report["context_parallel"] == 2
    assert report["priced_context_parallel"] == [2]
    assert {e["context_parallel"] for e in report["estimates"]} == {2}
    assert (report["chosen"], report["block_tokens"], report["path_tokens"]) == \
        (plan["chosen"], plan["block_tokens"], plan["path_tokens"])
    # the same budget priced at C=1 (the bug) does not give this choice: nothing fits
    one = _plan(capsys, path, 4, 1)
    assert one["chosen"] is None
    with pytest.raises(TrainingError, match="no mode fits"):
        _resolve(path, 4, 1)


def test_auto_context_parallel_is_the_planner_s_choice(tmp_path, capsys):
    """train.context_parallel=auto: 1, 2 and 4 (dividing 4 workers) priced, the planner's
    choice taken, as dta plan --context-parallel auto makes it -- C > 1, nothing fits at 1."""
    path = _records_file(tmp_path)
    settings = _resolve(path, 4, "auto")
    plan = _plan(capsys, path, 4, "auto")
    assert settings.report["priced_context_parallel"] == [1, 2, 4]
    C = settings.layout.context_parallel
    assert C == plan["context_parallel"] > 1 and settings.layout.data_parallel == 4 // C
    assert (settings.layout.sharding, settings.walk.block_tokens) == \
        (plan["chosen"], plan["block_tokens"])


@pytest.mark.slow  # two local Ray workers, one step
def test_dta_train_json_reports_the_priced_context_parallel(tmp_path, capsys):
    path = _records_file(tmp_path)
    plan = _plan(capsys, path, 2, 2)
    assert _plan(capsys, path, 2, 1)["chosen"] is None  # C=2 is what makes it fit
    out = subprocess.run([sys.executable, "-m", "dta_cli", "train", "--json", "--no-progress",
                          "train.steps=1", *_train_overrides(path, 2, 2)],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    auto = summary["sharding_auto"]
    assert auto["context_parallel"] == 2 and auto["priced_context_parallel"] == [2]
    assert {e["context_parallel"] for e in auto["estimates"]} == {2}
    assert summary["sharding"] == auto["chosen"] == plan["chosen"] is not None
    assert auto["block_tokens"] == plan["block_tokens"]
    assert summary["context_parallel"] == 2 and summary["data_parallel"] == 1

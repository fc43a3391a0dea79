"""``dta train`` on Ray resumes under another cluster shape (issue 48): a run saved at step 2
by ``ray.num_workers=4 train.context_parallel=2 train.sharding=fsdp`` continues with
``ray.num_workers=2 train.context_parallel=1 train.sharding=zero1 train.resume=true`` from
step 2 (the driver's data position) to step 4; its exported weights (float64) equal an
uninterrupted 4-step fsdp run's, relative L2 <= 1e-12 (measured 7e-18 on 2026-12-05). The
optimizer state and the other directions: tests/test_resume_layouts.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["workload.scale=tiny", "model.dtype=float64", "walker.block_tokens=16",
        "ray.object_store_memory=104857600", "optimizer.lr=1e-3", "optimizer.max_grad_norm=0.5"]
FSDP = ["ray.num_workers=4", "train.context_parallel=2", "train.sharding=fsdp"]
ZERO1 = ["ray.num_workers=2", "train.context_parallel=1", "train.sharding=zero1"]


def train(tmp_path, *args) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-m", "dta_cli", "train", "--no-progress", "--json",
                          *BASE, *args], capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"summary": json.loads(run.stdout.strip().splitlines()[-1]), "stderr": run.stderr}


def weights(folder: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.slow  # three dta train runs, 4 Ray workers on 2 cores: ~3-5 min
@pytest.mark.ray
def test_dta_train_saved_by_fsdp_4_c2_resumes_as_zero1_on_2(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = train(tmp_path, *FSDP, "train.steps=2", f"train.checkpoint_dir={a}")
    assert saved["summary"]["sharding"] == "fsdp" and saved["summary"]["completed_steps"] == 2
    resumed = train(tmp_path, *ZERO1, "train.steps=4", f"train.checkpoint_dir={a}",
                    "train.resume=true", f"train.export_hf={tmp_path / 'resumed'}")
    s = resumed["summary"]
    assert s["sharding"] == "zero1" and s["first_step"] == 2 and s["completed_steps"] == 4, s
    assert "resumed run" in resumed["stderr"]
    straight = train(tmp_path, *FSDP, "train.steps=4", f"train.checkpoint_dir={b}",
                     f"train.export_hf={tmp_path / 'straight'}")
    got, ref = weights(str(tmp_path / "resumed")), weights(str(tmp_path / "straight"))
    assert set(got) == set(ref)
    num = sum(float((got[k].double() - ref[k].double()).pow(2).sum()) for k in ref)
    den = sum(float(ref[k].double().pow(2).sum()) for k in ref)
    err = (num / den) ** 0.5
    norms = (s["param_norm"], straight["summary"]["param_norm"])
    print(f"dta train: fsdp 4 x C=2 saved at step 2, zero1 on 2 resumed to step 4: weights "
          f"vs the uninterrupted fsdp run, relative L2 {err:.2g}; param norms {norms}")
    assert err <= 1e-12

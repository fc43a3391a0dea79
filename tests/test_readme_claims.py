"""README claims whose full tests are long (``-m slow``), each with a small default-suite case
(issue 31): a two-node Ray cluster, `dta train` on a full disk then resumed, hybrid MoE and
Qwen3-Next packs in float64, and `dta plan`'s choice for Qwen3-14B at τ² full scale.

The slow versions: tests/test_ray_nodes.py (4 workers, placement), tests/test_trust_failures.py
(`dta train` full-disk cases), tests/test_hybrid_packs.py (every pack policy),
tests/test_memory_model.py (the plan's every row)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dta.config.schema import load_config
from tests.test_hybrid_packs import _check, reference  # noqa: F401 (the fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["workload.scale=tiny", "ray.object_store_memory=104857600", "optimizer.lr=1e-3"]
GIB = 2 ** 30


def _needs_namespaces():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) (private network, PID and mount namespaces)")


def _rel_l2(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


# ------------------------------------------------------------ two-node Ray cluster --
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_two_node_cluster_smoke_equals_one_process(tmp_path):
    """README: `dta train --address` places workers on a cluster's nodes (tested on a real
    two-node cluster, every listener on loopback). Two raylets in a private network and PID
    namespace (scripts/ray_two_nodes.py); 2 workers spread over both nodes, one step; the
    exported parameters equal one worker's step on the same batch in this process."""
    _needs_namespaces()
    from safetensors.torch import load_file

    from dta_cli.batches import BatchSource
    from tests.workers import local_worker

    out, export = tmp_path / "result.json", tmp_path / "spread"
    run = (f"{sys.executable} -m dta_cli train --address {{address}} --no-progress --json "
           + " ".join(TINY) + f" train.steps=1 ray.num_workers=2 ray.placement=spread "
           f"train.export_hf={export}")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "ray_two_nodes.py"),
                           "--out", str(out), "--cpus-per-node", "2", "--object-store-mib",
                           "100", "--run", run],
                          cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=560)
    result = json.loads(out.read_text())
    (r,) = result["runs"]
    assert done.returncode == 0 and "error" not in result and r["rc"] == 0, \
        (result.get("error"), r["stderr_tail"], done.stderr[-2000:])
    nodes = result["nodes"]
    assert len(set(nodes)) == 2  # two raylets: a real two-node cluster
    assert result["listeners"] and result["beyond_loopback"] == []
    summary = r["json"]
    assert summary["placement"] == "spread" and sorted(summary["worker_nodes"]) == sorted(nodes)
    assert summary["nodes"] == 2 and summary["rendezvous"].startswith("tcp://127.0.0.1:")

    cfg = load_config(None, TINY)
    threads = torch.get_num_threads()
    try:
        one = local_worker(cfg)  # one worker over the whole batch, no Ray
        before = {k: v.clone() for k, v in one.model.state_dict().items()}
        one.step(0, BatchSource(cfg, 512).batch(0), None)
    finally:
        torch.set_num_threads(threads)
    state = {k: v.detach() for k, v in one.model.state_dict().items()}
    two = load_file(str(export / "model.safetensors"))
    assert _rel_l2(two, state) <= 1e-5
    update = lambda p: {k: p[k].double() - before[k].double() for k in p}  # noqa: E731
    assert _rel_l2(update(two), update(state)) <= 1e-4 and _rel_l2(state, before) > 1e-4


# ------------------------------------------------------- full disk, then resumed --
@pytest.mark.ray
def test_dta_train_full_disk_then_resume(tmp_path):
    """README: a full disk during a save leaves the previous checkpoint and `latest` intact:
    free space and resume. `dta train` (Ray, 1 worker) on a 2.5 MiB tmpfs in a private mount
    namespace (tests/fulldisk_resume.py): step 1's checkpoint fits, step 2's does not; the
    error is one line; the disk grows and train.resume=true finishes step 2."""
    _needs_namespaces()
    run = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable,
                          os.path.join(ROOT, "tests", "fulldisk_resume.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=400,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    full, resumed = facts["full"], facts["resumed"]
    errors = [line for line in full["stderr"].splitlines() if "error" in line]
    assert full["rc"] == 1 and len(errors) == 1, full["stderr"]
    ck = f"{tmp_path}/disk/ck"
    assert errors[0].startswith(f"dta train: error: saving checkpoint step-000002 in '{ck}' "
                                "failed on worker 0 (pid ")
    assert "OSError: [Errno 28] No space left on device: " in errors[0]
    assert f"the newest complete checkpoint is still '{ck}/step-000001'" in errors[0]
    assert full["latest"].endswith("step-000001") and full["verified_step"] == 1
    assert not [f for f in full["files"] if f.startswith(".")]  # no half checkpoint left
    assert resumed["rc"] == 0, resumed["stderr"]
    assert resumed["summary"]["first_step"] == 1 and resumed["summary"]["completed_steps"] == 2
    assert "step-000002" in resumed["files"] and "step-000001" not in resumed["files"]


# ----------------------------------------------------------- hybrid MoE packs --
@pytest.mark.parametrize("reference", ["qwen3_5_moe", "qwen3_next"], indirect=True)
def test_hybrid_moe_families_in_packs_float64(reference):
    """README: hybrids are walked in packs, exact in float64 for qwen3_5_moe and qwen3_next:
    the default pack policy (auto) under both memory policies (every policy: -m slow)."""
    _check(reference, "auto")


# ------------------------------------------------------------ dta plan, 14B --
def test_dta_plan_qwen3_14b_full_scale_needs_blocks(capsys):
    """README: `dta plan --workload tau2-airline --scale full --workers 8 --memory --model
    qwen3-14b --budget-gib 80 --offload none` picks fsdp / recompute / blocks of 2,048;
    without blocks no mode fits (fsdp needs ~89 GiB of the usable 72). With the optimizer
    offload priced too (the default, --offload auto) an offloaded layout is faster by the
    model. The planner only, no model."""
    from dta.planning.memory import SHAPES, plan_memory
    from dta_cli.main import main

    args = ["plan", "--workload", "tau2-airline", "--scale", "full", "--workers", "8",
            "--memory", "--model", "qwen3-14b", "--budget-gib", "80", "--json"]
    assert main(args) == 0
    auto = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert main(args + ["--offload", "none"]) == 0
    mem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert (mem["chosen"], mem["policy"], mem["block_tokens"]) == ("fsdp", "recompute", 2048)
    assert auto["offload"] == "optimizer" and auto["step_seconds"] < mem["step_seconds"]
    assert mem["path_tokens"] == 15562 and mem["node_tokens"] == 5534
    unblocked = plan_memory(SHAPES["qwen3-14b"], 8, 80 * GIB, path_tokens=mem["path_tokens"],
                            call_tokens=mem["node_tokens"], blocks=(None,))
    assert unblocked.chosen is None
    fsdp = min((e for e in unblocked.tried if e.sharding == "fsdp"), key=lambda e: e.total)
    assert 88 * GIB < fsdp.total < 90 * GIB and fsdp.total > mem["usable_bytes"]

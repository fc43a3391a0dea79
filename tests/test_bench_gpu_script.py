"""experiments/bench/gpu.sh, on CPU with tiny sizes (the script's header cites this file): the
checks stage (split attention per backend, float32 verify, bf16 fidelity, no dense mask over
cached keys), the benchmark, the layouts (memory per sharding layout on one rank, fsdp's
all-gathers with and without prefetch in a profile of rank 0 of 2) and the blocks run
complete and end in one JSON line."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile

from tests.test_bench_run import ROOT, _env, check_summary


def test_gpu_script_cpu_path(tmp_path):
    env = dict(_env(), DEVICE="cpu", SIZES="tiny", SCALE="tiny", DTYPE="float32", REPEATS="1",
               MODES="microbatch,treemask,dfs-retain", PYTHON=sys.executable, BUDGET_S="560",
               LAYOUTS_SCALE="tiny",
               CHECK_FAMILIES="qwen3", BLOCKS="0 4096", BLOCKS_SIZE="tiny", BLOCKS_SCALE="0.05",
               WHEELS=str(tmp_path / "no-wheels"))  # a checkout's .whl/ is for the GPU machine
    # as under the device tool: $OUT set, the folder written beside it and handed back packed
    # (at most 8 files come back from $OUT)
    out = tmp_path / "OUT"
    out.mkdir()
    env.update(OUT=str(out), TMPDIR=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "experiments/bench/gpu.sh")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=640)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-results.tar.gz", "gpu.json", "summary.md"]
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        assert "gpu-run/checks/checks.json" in tar.getnames()
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    tmp_path = tmp_path / "gpu-run"
    assert line == json.loads((tmp_path / "gpu.json").read_text())
    assert line["env"]["device"] == "cpu" and line["checks_rc"] == 0 and line["checks_passed"]
    checks = line["checks"]
    assert checks["dense_path_masks"] == 0 and len(checks["attention"]) == 8
    assert all(r["ok"] and r["kernels"] == ["cpu_flash", "cpu_flash"] for r in checks["attention"])
    (m,) = checks["models"]
    assert m["verify_float32"]["passed"] and m["fidelity_bf16"]["passed"]
    d = json.loads((tmp_path / "tiny-sdpa.json").read_text())
    check_summary(d, ["microbatch", "treemask", "dfs-retain"])
    assert line["bench"]["tiny-sdpa"]["headline"] == d["headline"]
    assert line["blocks_rc"] == 0 and len(line["blocks"]["results"]) == 2 and "none" in line["blocks"]["results"]
    assert line["layouts_rc"] == 0, line["layouts_rc"]
    lay = line["layouts"]
    assert [r["layout"] for r in lay["memory"]] == ["replicate", "zero1", "zero2", "fsdp",
                                                    "fsdp+prefetch", "fsdp+offload",
                                                    "fsdp+gradients"]
    held = {r["layout"]: r["state_bytes"]["params"] for r in lay["memory"]}
    assert held["fsdp"] < held["fsdp+prefetch"] <= held["zero2"]  # one layer more gathered
    grads = {r["layout"]: r["state_bytes"]["grads"] for r in lay["memory"]}
    # the gradient sums on the host: the fp32 layer sum leaves the device's gradients
    assert grads["fsdp+gradients"] < grads["fsdp+offload"], grads
    off, on = lay["overlap"]
    assert not off["prefetch"] and on["prefetch"] and "error" not in off and "error" not in on
    assert on["all_gathers"] == off["all_gathers"] > 0  # the same gathers, issued earlier
    assert 0 <= on["overlap_fraction"] <= 1 and 0 <= off["overlap_fraction"] <= 1
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        assert "gpu-run/layouts/fsdp-prefetch-True.json.gz" in tar.getnames()
    summary = (tmp_path / "summary.md").read_text()
    assert "## layouts" in summary and "fsdp+prefetch" in summary
    assert "## checks" in summary and ("tiny-sdpa" in summary or "qwen3-tiny" in summary)


def test_gpu_script_stops_on_wheels_it_cannot_install(tmp_path):
    """WHEELS (what gpu-wheels.sh prepares for a machine without the registry): a wheel that
    does not install stops the script with one line, before any stage runs."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "broken-0.1-py3-none-any.whl").write_bytes(b"not a zip")
    env = dict(_env(), DEVICE="cpu", PYTHON=sys.executable, WHEELS=str(wheels))
    proc = subprocess.run(["bash", str(ROOT / "experiments/bench/gpu.sh"), str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"installing the wheels in {wheels} failed" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()

"""The Ray runtime loses nothing and trusts nothing blindly: Ctrl-C (SIGINT) leaves a
resumable checkpoint, a second run in a folder is refused before Ray starts, a skipped
(non-finite) update is an error naming the step, `dta train --address 127.0.0.1:PORT`
joins a loopback-only head, and nothing the runtime creates is writable by others.

One private local Ray instance serves the in-process tests (``ray.init`` reused by every
Trainer); the join test starts its own head in a child process and stops exactly it."""
from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import warnings

import pytest

from dta.config.schema import load_config
from dta_cli.batches import BatchSource
from runtime.checkpoints import checkpoint as ckpt
from runtime.checkpoints.checkpoint import CheckpointError
from runtime.errors import TrainingError
from runtime.ray_runtime.cluster import start_or_join
from runtime.ray_runtime.run import Interrupted, NonFiniteUpdateWarning, run_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["workload.scale=tiny", "ray.num_workers=1", "ray.object_store_memory=104857600",
        "optimizer.lr=1e-3"]
HEAD = """
import os, sys
from dta.config.schema import load_config
from runtime.ray_runtime.cluster import start_or_join
h = start_or_join(load_config(None, ["ray.num_workers=1", "ray.object_store_memory=104857600"]).ray)
print(json.dumps({"address": h.address, "token": os.environ.get("RAY_AUTH_TOKEN_PATH"),
                  "temp_dir": h.temp_dir}), flush=True)
sys.stdin.read()  # until the test closes stdin
h.shutdown()
""".replace("import os, sys", "import json, os, sys")


def cfg(*overrides):
    return load_config(None, TINY + list(overrides))


def others_writable(*roots) -> list[str]:
    bad = []
    for root in roots:
        for base, dirs, files in os.walk(root):
            for name in dirs + files + ["."]:
                path = os.path.join(base, name)
                st = os.lstat(path)
                if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
                    bad.append(f"{path} {oct(st.st_mode & 0o777)}")
    return bad


def test_failed_start_leaves_nothing_behind(tmp_path):
    """Workers that cannot start (more GPUs asked than the instance has): the error names the
    key, and Ray, its private temp folder and its token are gone afterwards."""
    import ray

    from runtime.ray_runtime.driver import Trainer

    if ray.is_initialized():  # pragma: no cover - the module's own instance comes later
        pytest.fail("this test needs to start its own Ray instance")
    before = {n for n in os.listdir("/tmp") if n.startswith(("dta-ray-", "dta-auth-", "dta-pg-"))}
    trainer = Trainer(cfg("ray.gpus_per_worker=64"))
    with pytest.raises(TrainingError, match="ray.gpus_per_worker"):
        trainer.start()
    assert not ray.is_initialized() and trainer.cluster is None
    after = {n for n in os.listdir("/tmp") if n.startswith(("dta-ray-", "dta-auth-", "dta-pg-"))}
    assert after - before == set()
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ or os.path.exists(os.environ["RAY_AUTH_TOKEN_PATH"])


def test_folders_of_a_killed_run_are_swept(tmp_path):
    from runtime.ray_runtime.cluster import OWNER_FILE, owner_record, private_dir, sweep_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = private_dir("dta-ray-", str(tmp_path))
    with open(os.path.join(stale, OWNER_FILE), "w") as f:
        f.write(owner_record(dead.pid))  # its creator is gone (killed with SIGKILL, say)
    # a run inside another pid namespace (unshare -p) shares /tmp: its pid means nothing here
    elsewhere = private_dir("dta-ray-", str(tmp_path))
    with open(os.path.join(elsewhere, OWNER_FILE), "w") as f:
        f.write(f"{dead.pid} pid:[1]")
    old = private_dir("dta-ray-", str(tmp_path))
    with open(os.path.join(old, OWNER_FILE), "w") as f:
        f.write(str(dead.pid))  # no namespace recorded: cannot be judged, left alone
    live = private_dir("dta-auth-", str(tmp_path))  # created by this (live) process
    foreign = tmp_path / "dta-pg-foreign"
    foreign.mkdir()  # no owner file: not made by this code, never touched
    assert stat.S_IMODE(os.stat(live).st_mode) == 0o700
    assert sweep_stale((str(tmp_path),)) == [stale]
    assert os.path.isdir(live) and foreign.is_dir() and not os.path.exists(stale)
    assert os.path.isdir(elsewhere) and os.path.isdir(old)


@pytest.fixture(scope="module")
def ray_local():
    handle = start_or_join(cfg().ray)
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.mark.ray
def test_sigint_leaves_a_resumable_checkpoint(ray_local, tmp_path):
    d = str(tmp_path / "ckpt")
    c = cfg("train.steps=6", f"train.checkpoint_dir={d}", "train.checkpoint_every=0")

    def ctrl_c(stats):
        if stats.step == 1:  # Ctrl-C while the run goes: finish the step, save, stop
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Interrupted) as info:
        run_training(c, BatchSource(c, 512), progress=False, log=lambda m: None, on_step=ctrl_c)
    assert info.value.exit_code == 130 and "SIGINT" in str(info.value)
    assert ckpt.latest_checkpoint(d).endswith("step-000002")  # periodic saves were off
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored
    # a second, fresh run in the same folder is refused before anything starts
    with pytest.raises(CheckpointError, match="already holds run"):
        run_training(c, BatchSource(c, 512), progress=False, log=lambda m: None)
    resumed = cfg("train.steps=3", f"train.checkpoint_dir={d}", "train.resume=true")
    out = run_training(resumed, BatchSource(resumed, 512), progress=False, log=lambda m: None)
    assert out["first_step"] == 2 and out["steps"] == 1 and out["completed_steps"] == 3
    assert out["run_id"] == ckpt.read_run(d)["run_id"]
    rows = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [0, 1, 2]  # written as the run went, resumed included
    assert open(os.path.join(d, "metrics.csv")).readline().startswith("step,loss,")
    assert others_writable(d) == []
    assert others_writable(ray_local.temp_dir) == []


@pytest.mark.ray
def test_resume_of_a_missing_folder_is_an_error(ray_local, tmp_path):
    c = cfg(f"train.checkpoint_dir={tmp_path / 'typo'}", "train.resume=true")
    with pytest.raises(CheckpointError, match="does not exist"):
        run_training(c, BatchSource(c, 512), progress=False, log=lambda m: None)


@pytest.mark.ray
def test_nonfinite_update_fails_naming_the_step_unless_skipping(ray_local, tmp_path):
    blow_up = ["optimizer.name=sgd", "optimizer.lr=1e36", "optimizer.max_grad_norm=null",
               "train.steps=3"]
    c = cfg(*blow_up)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteUpdateWarning)
        with pytest.raises(TrainingError, match=r"step [12]: the gradient norm is (nan|inf)"):
            run_training(c, BatchSource(c, 512), progress=False, log=lambda m: None)
    c = cfg(*blow_up, "train.skip_nonfinite=true", f"train.export_hf={tmp_path / 'hf'}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_training(c, BatchSource(c, 512), progress=False, log=lambda m: None)
    assert out["steps"] == 3 and any(issubclass(w.category, NonFiniteUpdateWarning) for w in caught)
    assert os.path.isfile(tmp_path / "hf" / "config.json")  # train.export_hf: save_pretrained
    assert others_writable(tmp_path / "hf") == []


@pytest.mark.ray
def test_cli_joins_a_loopback_only_head(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT}
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        env.pop(k, None)
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        info = json.loads(head.stdout.readline())
        client = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": info["token"]}
        d = tmp_path / "ckpt"
        run = subprocess.run([sys.executable, "-m", "dta_cli", "train", "--address",
                              info["address"], "--no-progress", "--json", *TINY,
                              "train.steps=2", f"train.checkpoint_dir={d}"],
                             capture_output=True, text=True, env=client, cwd=str(tmp_path),
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        assert summary["steps"] == 2 and summary["checkpoint"].endswith("step-000002")
        assert others_writable(d) == []
        assert others_writable(info["temp_dir"]) == []
    finally:
        head.stdin.close()
        head.wait(timeout=60)
    assert not os.path.exists(info["temp_dir"]) and not os.path.exists(info["token"])


def test_cli_with_nothing_listening_fails_at_once_with_a_clear_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    run = subprocess.run([sys.executable, "-m", "dta_cli", "train", "--address",
                          f"127.0.0.1:{port}", "--no-progress"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=str(tmp_path), timeout=120)
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert run.returncode == 1 and len(errors) == 1, run.stderr
    assert f"cannot join the Ray cluster at '127.0.0.1:{port}': nothing answers" in errors[0]


@pytest.mark.ray
def test_a_failure_inside_a_worker_is_one_line_with_its_cause(ray_local, tmp_path):
    """Save, load: what was being done, by which worker, the cause (an OSError with its path),
    no Ray actor repr or colour codes; the worker's traceback stays chained for --debug."""
    from ray.exceptions import RayTaskError

    from runtime.errors import WorkerError
    from runtime.ray_runtime.driver import Trainer

    c = cfg()
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "ckpt")
    with Trainer(c, log=lambda m: None) as trainer:
        trainer.step(BatchSource(c, 512).batch(0), 0)
        with pytest.raises(WorkerError) as info:
            trainer.save(bad)
        text = str(info.value)
        assert text.startswith(f"saving checkpoint step-000001 in {bad!r} failed on worker 0 "
                               "(pid ") and "\n" not in text
        assert f"NotADirectoryError: [Errno 20] Not a directory: {bad!r}" in text
        assert "\x1b[" not in text and "repr=" not in text and "actor_id" not in text
        assert "no checkpoint was written" in text
        remote = info.value.__cause__  # what --debug shows: the worker's own traceback
        assert isinstance(remote, RayTaskError) and "save_checkpoint" in str(remote)
        assert trainer.broken is None  # one rank raised; the workers are fine
        assert trainer.save(str(tmp_path / "good")).endswith("step-000001")
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        (foreign / "notes.txt").write_text("mine")
        with pytest.raises(CheckpointError, match="not a DTA run folder"):
            trainer.save(str(foreign))  # the Python API too, before any worker writes
        assert os.listdir(foreign) == ["notes.txt"]
        with pytest.raises(WorkerError, match=r"^loading checkpoint '.*/nowhere' failed on "
                                              r"worker 0 \(pid \d+ on [\d.]+\): \w+Error: "):
            trainer.load(str(tmp_path / "nowhere"))

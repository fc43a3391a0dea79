"""A stop signal ends `dta train` as a cluster job expects (issue 55).

SIGTERM (what Slurm, Kubernetes and spot preemption send) and SIGINT (Ctrl-C) to a running
``dta train``: it finishes the step in flight, saves it, shuts its private Ray down and prints
one line -- the signal, the step, the checkpoint and the command that resumes the run --,
exits 128 + signal (143 / 130), prints no native stack dump of Ray's, leaves no process of
the run, and the printed command continues from the newest complete checkpoint. A grace
period (``train.stop_grace_s``) bounds it: past it the run stops at once, naming the newest
complete checkpoint. A ``dta submit`` job stopped with Ray's job stop gets the same.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from runtime.ray_runtime.reaper import MARKER, instance_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = ["--no-progress", "workload.scale=tiny", "ray.num_workers=1",
       "ray.object_store_memory=104857600", "train.steps=100000", "train.checkpoint_every=0"]


def _env():
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    env.pop(MARKER, None)
    return env


def _rows(d) -> int:
    path = os.path.join(d, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def _train_until(tmp_path, d, rows, *extra):
    """`dta train` on the embedded default (tiny), running until ``rows`` steps are logged;
    (process, its descendants seen, its Ray instance's marker, log path)."""
    log = tmp_path / "train.log"
    driver = subprocess.Popen([sys.executable, "-m", "dta_cli", "train", *RUN,
                               f"train.checkpoint_dir={d}", *extra], env=_env(),
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=str(tmp_path))
    seen, token = {}, None
    end = time.monotonic() + 300
    while time.monotonic() < end:
        assert driver.poll() is None, log.read_text()[-3000:]
        for p in psutil.Process(driver.pid).children(recursive=True):
            seen.setdefault(p.pid, p)
            try:
                token = token or p.environ().get(MARKER)
            except psutil.Error:
                pass
        if token and _rows(d) >= rows:
            return driver, seen, token, log
        time.sleep(0.3)
    driver.kill()
    raise AssertionError("dta train did not train within 300 s: " + log.read_text()[-3000:])


def _left(seen: dict, token: str, timeout: float = 30.0) -> list:
    """What is still running of the run (its processes seen, its instance's marker)."""
    end = time.monotonic() + timeout
    while True:
        alive = [p for p in seen.values() if p.is_running() and
                 p.status() != psutil.STATUS_ZOMBIE] + instance_processes(token)
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.3)


def _stop(sig, tmp_path, *extra):
    d = str(tmp_path / "ck")
    driver, seen, token, log = _train_until(tmp_path, d, 2, *extra)
    driver.send_signal(sig)
    rc = driver.wait(timeout=180)
    text = log.read_text()
    assert "received at time" not in text and "***" not in text, text[-3000:]  # no native dump
    assert _left(seen, token) == [], "processes of the run survived"
    return rc, text.strip().splitlines()[-1], d


@pytest.mark.ray
@pytest.mark.parametrize("sig", [signal.SIGTERM,
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_stop_signal_saves_the_step_and_the_printed_command_resumes(tmp_path, sig):
    rc, line, d = _stop(sig, tmp_path)
    assert rc == 128 + sig, line
    m = re.fullmatch(rf"dta train: stopped by {sig.name} after step (\d+) \(\d+ steps this "
                     rf"run\): step \d+ saved in (\S+); resume with: (dta train .*)", line)
    assert m, line
    step, saved, command = int(m.group(1)), m.group(2), m.group(3)
    assert saved == os.path.join(d, f"step-{step:06d}") and os.path.isdir(saved), line
    assert command.endswith(f"train.checkpoint_dir={d} train.resume=true"), command
    # the printed command continues the run from that checkpoint
    argv = shlex.split(command)[2:] + [f"train.steps={step + 1}", "--json"]
    out = subprocess.run([sys.executable, "-m", "dta_cli", "train", *argv], env=_env(),
                         capture_output=True, text=True, timeout=400, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["first_step"], summary["steps"], summary["completed_steps"]) == \
        (step, 1, step + 1)
    assert f"resumed run" in out.stderr and saved in out.stderr


@pytest.mark.slow
@pytest.mark.ray
def test_past_the_grace_period_the_run_stops_at_once(tmp_path):
    """train.stop_grace_s shorter than a step: stopped at once, the newest complete
    checkpoint named (every step saved here), exit 143, nothing left."""
    rc, line, d = _stop(signal.SIGTERM, tmp_path, "train.checkpoint_every=1",
                        "train.stop_grace_s=0.05")
    assert rc == 143, line
    m = re.fullmatch(r"dta train: stopped at once by SIGTERM \(train.stop_grace_s=0.05 s "
                     r"passed\) during step (\d+): the newest complete checkpoint is (\S+); "
                     r"resume with: dta train .* train.resume=true", line)
    assert m, line
    step, newest = int(m.group(1)), m.group(2)  # the signal came in a step or in its save
    assert newest in (os.path.join(d, f"step-{k:06d}") for k in (step, step - 1)), line
    assert os.path.isdir(newest), line


# ------------------------------------------------------------------ dta submit --
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(900)
def test_ray_job_stop_saves_the_step_and_the_printed_submit_resumes(tmp_path):
    """`dta jobs stop` (Ray's job stop: SIGTERM to the entrypoint, SIGKILL after
    RAY_JOB_STOP_WAIT_TIME_S, which `dta submit` sets to train.stop_grace_s + 30): the job's
    log ends with the stop line naming the `dta submit` that resumes it, which does."""
    import shutil
    import tempfile

    from tests.test_runtime import _free_port, _kill, _started_processes

    temp_dir = tempfile.mkdtemp(prefix="dta-head-", dir="/tmp")
    token = os.path.join(temp_dir, "auth_token")
    with open(token, "w") as f:
        f.write("ab" * 32)
    os.chmod(token, 0o600)
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in _env().items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN_PATH=token, RAY_USAGE_STATS_ENABLED="0",
               PATH=bindir + os.pathsep + env.get("PATH", ""))
    dash = _free_port()
    head = subprocess.Popen(
        [os.path.join(bindir, "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
         f"--port={_free_port()}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={_free_port()}",
         f"--ray-client-server-port={_free_port()}", f"--temp-dir={temp_dir}", "--num-cpus=2",
         f"--object-store-memory={100 * 2 ** 20}", "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    started = []
    address = f"http://127.0.0.1:{dash}"
    dta = [sys.executable, "-m", "dta_cli"]
    d = str(tmp_path / "ck")
    try:
        out, _ = head.communicate(timeout=180)
        assert head.returncode == 0, out[-3000:]
        started = _started_processes(head.pid, temp_dir)
        sub = subprocess.run(dta + ["submit", "--address", address, "--no-wait", *RUN[1:],
                                    f"train.checkpoint_dir={d}"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert sub.returncode == 0, sub.stdout[-3000:] + sub.stderr[-3000:]
        job = re.search(r"submitted job (\S+)", sub.stdout).group(1)
        end = time.monotonic() + 400
        while _rows(d) < 2:
            assert time.monotonic() < end, "the job did not train within 400 s"
            time.sleep(0.5)
        stop = subprocess.run(dta + ["jobs", "stop", job, "--address", address], env=env,
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        end = time.monotonic() + 120
        while True:
            status = subprocess.run(dta + ["jobs", "status", job, "--address", address],
                                    env=env, capture_output=True, text=True, timeout=60)
            if "STOPPED" in status.stdout or time.monotonic() > end:
                break
            time.sleep(1)
        assert "STOPPED" in status.stdout, status.stdout
        logs = subprocess.run(dta + ["jobs", "logs", job, "--address", address], env=env,
                              capture_output=True, text=True, timeout=60).stdout
        assert "received at time" not in logs, logs[-3000:]
        m = re.search(r"dta train: stopped by SIGTERM after step (\d+) \(\d+ steps this run\): "
                      r"step \d+ saved in (\S+); resume with: (dta submit .*)", logs)
        assert m, logs[-3000:]
        step, command = int(m.group(1)), m.group(3)
        assert os.path.isdir(m.group(2)) and command.endswith("train.resume=true"), command
        again = subprocess.run(dta + shlex.split(command)[1:] + [f"train.steps={step + 1}",
                                                                  "--timeout", "400"],
                               env=env, cwd=ROOT, capture_output=True, text=True, timeout=500)
        assert again.returncode == 0 and "SUCCEEDED" in again.stdout, again.stdout[-3000:]
        assert f"(step {step})" in again.stdout, again.stdout[-3000:]  # resumed from it
    finally:
        if head.poll() is None:
            head.kill()
        _kill(started + _started_processes(head.pid, temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)

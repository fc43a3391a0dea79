"""The private Ray instance dies with its driver (issue 48; runtime/ray_runtime/reaper.py).

- the watcher on a dummy instance (no Ray, seconds): a "driver" process starts the watcher,
  then, with the marker set, a child that ignores SIGTERM and a grandchild whose environment
  does not carry the marker (as the raylet's agents, which rewrite their title) orphaned
  when its parent dies; SIGKILL the driver: within seconds none of them is left, the
  instance's folder is removed, the watcher is gone, and a process of another instance (its
  own marker) is untouched. Stopped by the driver instead (``stop_watcher``): the instance's
  processes are killed, the driver lives on, its folder stays.
- ``dta train`` on Ray (slow): SIGKILL the driver while its 2 workers train; 30 s later no
  process of that run is left (the ones seen while it trained -- the driver's descendants --
  and every process carrying its marker) and its private folders are gone.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from runtime.ray_runtime.reaper import MARKER, instance_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from runtime.ray_runtime.reaper import MARKER, start_watcher, stop_watcher
    token, folder, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    watcher = start_watcher(token, [folder])
    os.environ[MARKER] = token
    stubborn = ("import signal, subprocess, sys, os, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "env = {k: v for k, v in os.environ.items() if k != 'DTA_RAY_INSTANCE'}; "
                "g = subprocess.Popen([sys.executable, '-c', "
                "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(600)'], env=env, start_new_session=True); "
                "print(g.pid, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE,
                             start_new_session=True, text=True)
    grandchild = int(child.stdout.readline())
    os.environ.pop(MARKER)
    time.sleep(1.5)  # the watcher has seen the tree
    print(json.dumps({"child": child.pid, "grandchild": grandchild,
                      "watcher": watcher.pid}), flush=True)
    if mode == "stop":
        stop_watcher(watcher)
        print("stopped", flush=True)
    time.sleep(600)
""")


def _start_driver(tmp_path, token, mode):
    folder = tmp_path / f"instance-{token}"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop(MARKER, None)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, token, str(folder), mode],
                            stdout=subprocess.PIPE, text=True, env=env)
    pids = json.loads(proc.stdout.readline())
    return proc, pids, folder


def _gone(pids, timeout=15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.2)
    return False


def _other_instance():
    """A process of another instance (another token): the watcher must leave it alone."""
    env = {**os.environ, MARKER: "another-instance"}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)


def test_a_sigkilled_driver_leaves_nothing_of_its_instance(tmp_path):
    other = _other_instance()
    proc, pids, folder = _start_driver(tmp_path, "fate-kill", "kill")
    try:
        assert [p.pid for p in instance_processes("fate-kill")] == [pids["child"]]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _gone([pids["child"], pids["grandchild"], pids["watcher"]]), pids
        assert not folder.exists()
        assert other.poll() is None  # another instance's process lives on
    finally:
        for p in (pids["child"], pids["grandchild"]):
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)
        other.kill()
        other.wait()


def test_a_stopped_watcher_kills_what_is_left_and_spares_the_driver(tmp_path):
    proc, pids, folder = _start_driver(tmp_path, "fate-stop", "stop")
    try:
        assert proc.stdout.readline().strip() == "stopped"  # stop_watcher returned
        assert _gone([pids["child"], pids["grandchild"], pids["watcher"]], timeout=1.0), pids
        assert proc.poll() is None and folder.exists()  # the driver is not the instance
    finally:
        proc.kill()
        proc.wait()
        for p in (pids["child"], pids["grandchild"]):
            if psutil.pid_exists(p):
                os.kill(p, signal.SIGKILL)


# ----------------------------------------------------------------- dta train on Ray --
@pytest.mark.slow
@pytest.mark.ray
def test_dta_train_sigkilled_leaves_no_process_of_the_run(tmp_path):
    """``dta train`` (2 workers, many steps) SIGKILLed while it trains (~40-60 s)."""
    d = str(tmp_path / "ck")
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop(MARKER, None)
    argv = [sys.executable, "-m", "dta_cli", "train", "--no-progress", "workload.scale=tiny",
            "ray.num_workers=2", "ray.object_store_memory=104857600", "train.steps=100000",
            "train.checkpoint_every=0", f"train.checkpoint_dir={d}"]
    log = open(tmp_path / "train.log", "w")
    driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=str(tmp_path))
    seen: dict[int, psutil.Process] = {}
    token = None
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end:  # its workers are training: rows in metrics.jsonl
            assert driver.poll() is None, open(tmp_path / "train.log").read()[-3000:]
            for p in psutil.Process(driver.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
                try:
                    token = token or p.environ().get(MARKER)
                except psutil.Error:
                    pass
            rows = os.path.join(d, "metrics.jsonl")
            if token and os.path.exists(rows) and sum(1 for _ in open(rows)) >= 2:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("dta train did not start training within 300 s")
        for p in psutil.Process(driver.pid).children(recursive=True):
            seen.setdefault(p.pid, p)
        names = sorted({p.name() for p in seen.values() if p.is_running()})
        assert any("raylet" in n for n in names) and any("gcs" in n for n in names), names
        folders = set()  # the instance's private folders: its temp dir and its token's
        for p in seen.values():
            try:
                folders |= set(re.findall(r"/tmp/dta-ray-[A-Za-z0-9_]+", " ".join(p.cmdline())))
                token_path = p.environ().get("RAY_AUTH_TOKEN_PATH")
                if token_path:
                    folders.add(os.path.dirname(token_path))
            except psutil.Error:
                pass
        assert any("dta-ray-" in f for f in folders), folders
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        deadline = killed + 30
        while time.monotonic() < deadline:
            left = [p for p in seen.values() if p.is_running()] + instance_processes(token)
            if not left:
                break
            time.sleep(0.5)
        left = [(p.pid, p.name()) for p in seen.values() if p.is_running()]
        left += [(p.pid, p.name()) for p in instance_processes(token)]
        print(f"dta train SIGKILLed: {len(seen)} processes of the run seen ({names}); "
              f"none left after {time.monotonic() - killed:.1f} s" if not left else
              f"left after 30 s: {left}")
        assert not left, left
        assert not [f for f in folders if os.path.exists(f)], folders
    finally:
        if driver.poll() is None:
            driver.kill()
        for p in seen.values():
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass
        log.close()

"""The private Ray instance dies with its driver, whatever kills the driver.

A local instance (:func:`runtime.ray_runtime.cluster.start_or_join`) is started by the
driver's ``ray.init``; Ray fate-shares its head processes with the driver, but not all of
them: SIGKILL the driver (the OOM killer, a scheduler's kill) and the raylet's
DashboardAgent and RuntimeEnv agent live on, re-parented to init (they ignore SIGTERM).

So the instance's processes carry a marker in their environment,
``DTA_RAY_INSTANCE=<token>`` (set by the driver just for ``ray.init``: the GCS, raylet,
dashboard, log monitor and, through the raylet, every worker inherit it; the agents rewrite
their title over it and are found as the raylet's descendants, remembered after it dies),
and a small watcher -- this module, run as its own process in its own session (a Ctrl-C to
the driver's terminal or a kill of its process group does not reach it) -- lists them every
second and looks at the driver five times a second:

- the driver dies (its pid is gone, a zombie, or another process now): the watcher sends
  SIGTERM to every process of the instance, SIGKILL to what is left after a grace period,
  repeats until none is left (workers may still be spawned meanwhile), removes the
  instance's private folders, and exits;
- the driver shuts the instance down (``ClusterHandle.shutdown``: it writes ``stop`` to the
  watcher's stdin after ``ray.shutdown()``): the watcher kills what ``ray.shutdown`` left
  (never the driver) and exits.

Processes are found by the marker in ``/proc/<pid>/environ`` (this user's only) and as
descendants of those, never by name, so another run's Ray instance on the same machine is
never touched. Standard library and psutil only: it starts fast and imports neither Ray nor
torch.
"""
from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import psutil

MARKER = "DTA_RAY_INSTANCE"
POLL_S = 0.2  # how often the watcher looks at the driver
TRACK_S = 1.0  # how often it lists the instance's processes
GRACE_S = 2.0
DEADLINE_S = 20.0

__all__ = ["MARKER", "Tracker", "instance_processes", "reap", "start_watcher", "stop_watcher"]


def instance_processes(token: str, *, exclude=()) -> list[psutil.Process]:
    """This user's processes whose environment carries ``DTA_RAY_INSTANCE=<token>`` (those
    Ray started with the driver's environment; a process that rewrites its title -- the
    raylet's agents -- no longer shows it: :class:`Tracker` finds those as descendants)."""
    needle = f"{MARKER}={token}".encode()
    uid, skip, out = os.getuid(), {os.getpid(), *exclude}, []
    for pid in psutil.pids():
        if pid in skip:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            out.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            continue  # gone meanwhile, or not readable: not ours
    return out


class Tracker:
    """The processes of one instance: those carrying its marker and all their descendants,
    remembered while they live (``psutil.Process``: a reused pid is another process), so
    that one orphaned when its parent died (re-parented to init) is still found."""

    def __init__(self, token: str, exclude=()):
        self.token, self.exclude = token, {os.getpid(), *exclude}
        self.known: dict[int, psutil.Process] = {}

    def track(self) -> list[psutil.Process]:
        """The instance's processes now (and remember them)."""
        found: dict[int, psutil.Process] = {}

        def add(p: psutil.Process) -> None:
            if p.pid in self.exclude or p.pid in found:
                return
            found[p.pid] = p
            try:
                for child in p.children(recursive=True):
                    if child.pid not in self.exclude:
                        found.setdefault(child.pid, child)
            except psutil.Error:
                pass

        for p in instance_processes(self.token, exclude=self.exclude):
            add(p)
        for p in list(self.known.values()):
            if _alive(p):  # the same process (psutil checks its start time)
                add(p)
        self.known = {pid: p for pid, p in found.items() if _alive(p)}
        return list(self.known.values())


def _alive(p: psutil.Process) -> bool:
    """Running, and not a zombie (dead, waiting for its parent to reap it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait(procs, timeout: float) -> list[psutil.Process]:
    """Those of ``procs`` still alive after at most ``timeout`` seconds."""
    end = time.monotonic() + timeout
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < end:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


def reap(tracker: Tracker, *, grace_s: float = GRACE_S, deadline_s: float = DEADLINE_S) -> int:
    """SIGTERM every process of the instance, SIGKILL what outlives ``grace_s``, until none
    is left twice in a row (or ``deadline_s`` passed); returns how many were signalled."""
    seen: set[tuple[int, float]] = set()
    end, empty = time.monotonic() + deadline_s, 0
    while time.monotonic() < end and empty < 2:
        procs = tracker.track()
        if not procs:
            empty += 1
            time.sleep(POLL_S)
            continue
        empty = 0
        for p in procs:
            try:
                seen.add((p.pid, p.create_time()))
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
        for p in _wait(procs, grace_s):
            try:
                p.kill()
            except psutil.Error:
                pass
        _wait(procs, grace_s)
    return len(seen)


def _driver_alive(pid: int, created: float) -> bool:
    try:
        driver = psutil.Process(pid)
        return abs(driver.create_time() - created) < 1e-3 and _alive(driver)
    except psutil.Error:
        return False


def watch(pid: int, created: float, token: str, folders: list[str]) -> None:
    """Wait for the driver ``pid`` (started at ``created``) to die or to say ``stop`` on
    stdin, keeping track of the instance's processes; then reap them (and remove the
    folders when the driver died)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    tracker = Tracker(token, exclude=(pid,))
    stopped, stdin, last, eof = False, sys.stdin.buffer, 0.0, False
    while _driver_alive(pid, created):
        if time.monotonic() - last >= TRACK_S:
            tracker.track()
            last = time.monotonic()
        if eof:  # the driver is dying (the kernel closed its end), or dropped the pipe:
            time.sleep(POLL_S)  # its pid decides
            continue
        ready, _, _ = select.select([stdin], [], [], POLL_S)
        if ready:
            data = os.read(stdin.fileno(), 64)
            if data.startswith(b"stop"):
                stopped = True
                break
            eof = not data
    driver_gone = not stopped
    reap(tracker)
    if driver_gone:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------ the driver's side --
def start_watcher(token: str, folders: list[str]) -> subprocess.Popen:
    """Start the watcher of this process's instance ``token`` (call it before the marker is
    set: the watcher does not carry it); ``folders`` are removed if this process dies."""
    me = psutil.Process()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.ray_runtime.reaper", "--pid", str(me.pid),
         "--created", repr(me.create_time()), "--token", token, *folders],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True, env=env, cwd="/")


def stop_watcher(watcher: subprocess.Popen | None, timeout_s: float = DEADLINE_S + 5) -> None:
    """After ``ray.shutdown()``: the watcher kills what is left of the instance (never this
    process) and exits; this waits for it."""
    if watcher is None:
        return
    try:
        watcher.stdin.write(b"stop\n")
        watcher.stdin.close()
    except OSError:
        pass
    try:
        watcher.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        watcher.kill()
        watcher.wait()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--created", type=float, required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("folders", nargs="*")
    args = ap.parse_args(argv)
    watch(args.pid, args.created, args.token, args.folders)


if __name__ == "__main__":
    main()

"""A real two-node Ray cluster on one machine, sealed off: run commands against it.

    sudo python scripts/ray_two_nodes.py --out result.json \\
        --run "python -m dta_cli train --address {address} --json ray.num_workers=4"

Two raylets (``ray start --head`` and ``ray start --address``) on 127.0.0.1, each with
``--cpus-per-node`` CPUs and a small object store, inside a private network, PID and mount
namespace (``unshare -n -p -f --mount-proc``, so it needs root): the namespace has only
``lo``, so nothing can listen beyond loopback, and its processes die with it. The second
raylet needs ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` (Ray otherwise refuses a second node on
one machine). Token authentication uses a private token file.

Each ``--run`` command (``{address}`` is replaced by the GCS address) runs in turn while the
listening sockets of the namespace are sampled with ``ss`` every 0.25 s. The result (JSON,
to ``--out`` and as the last line of stdout): the cluster's node ids, every listening
address seen, those beyond loopback, and for each run its exit code, the last JSON line of
its stdout and the tail of its stderr. Exit code 0 when every run succeeded and every
listener was on loopback.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

PORT = 6379  # fixed: the namespace has its own ports
INSIDE = "--inside-namespace"
LOOPBACK_PREFIXES = ("127.", "[::ffff:127.", "[::1]", "::1", "::ffff:127.")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="append", default=[], metavar="CMD",
                   help="a command to run against the cluster ({address}: the GCS address); "
                        "repeatable, run in order")
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--object-store-mib", type=int, default=100)
    p.add_argument("--out", metavar="FILE", help="write the result JSON here as well")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument(INSIDE, dest="inside", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.run:
        p.error("give at least one --run command")
    return args


# ------------------------------------------------------------------------- outside --
def outside(argv) -> int:
    """Make a private folder, re-run this script as PID 1 of fresh namespaces, clean up."""
    if os.geteuid() != 0:
        print("ray_two_nodes: error: needs root (unshare -n -p -f --mount-proc)",
              file=sys.stderr)
        return 2
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        print("ray_two_nodes: error: needs the `unshare` and `ip` commands", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="dta-2node-", dir="/tmp")  # short: Ray's socket paths
    try:
        cmd = ["unshare", "-n", "-p", "-f", "--mount-proc", sys.executable,
               os.path.abspath(__file__), *argv, INSIDE, work]
        return subprocess.run(cmd).returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -------------------------------------------------------------------------- inside --
def listeners() -> set[str]:
    out = subprocess.run(["ss", "-ltunH"], capture_output=True, text=True).stdout
    return {line.split()[4] for line in out.splitlines() if len(line.split()) > 4}


def on_loopback(addr: str) -> bool:
    return addr.startswith(LOOPBACK_PREFIXES)


def ray_env(work: str) -> dict:
    token = os.path.join(work, "auth_token")
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=token, HOME=work)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    return env


def start_nodes(args, env: dict, work: str) -> list[str]:
    """Start the two raylets and wait until the GCS lists both alive; their node ids."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={args.cpus_per_node}",
              f"--object-store-memory={args.object_store_mib * 2 ** 20}",
              "--disable-usage-stats"]
    head = [ray, "start", "--head", f"--port={PORT}", "--include-dashboard=false",
            f"--temp-dir={os.path.join(work, 'ray')}", *common]
    second = [ray, "start", f"--address=127.0.0.1:{PORT}", *common]
    for cmd in (head, second):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} failed: {(done.stdout + done.stderr)[-2000:]}")
    probe = ("import json, time, ray\n"
             f"ray.init(address='127.0.0.1:{PORT}', _node_ip_address='127.0.0.1', "
             "log_to_driver=False, logging_level='ERROR')\n"
             "for _ in range(240):\n"
             "    alive = [n['NodeID'] for n in ray.nodes() if n['Alive']]\n"
             "    if len(alive) >= 2: break\n"
             "    time.sleep(0.25)\n"
             "print(json.dumps(alive))\n")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"listing the nodes failed: {done.stderr[-2000:]}")
    nodes = json.loads(done.stdout.strip().splitlines()[-1])
    if len(nodes) != 2:
        raise RuntimeError(f"expected 2 alive nodes, the GCS lists {nodes}")
    return nodes


def run_one(command: str, env: dict, work: str, k: int, timeout: float, seen: set) -> dict:
    argv = [a.replace("{address}", f"127.0.0.1:{PORT}") for a in shlex.split(command)]
    out_path, err_path = os.path.join(work, f"run{k}.out"), os.path.join(work, f"run{k}.err")
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err)
        while proc.poll() is None:
            seen.update(listeners())
            if time.monotonic() - t0 > timeout:
                proc.kill()
            time.sleep(0.25)
    with open(out_path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    with open(err_path) as f:
        stderr = f.read()
    parsed = None
    if lines:
        try:
            parsed = json.loads(lines[-1])
        except ValueError:
            pass
    return {"command": " ".join(argv), "rc": proc.returncode, "json": parsed,
            "wall_s": round(time.monotonic() - t0, 1), "stderr_tail": stderr[-3000:]}


def inside(args) -> int:
    if os.getpid() != 1:
        print("ray_two_nodes: error: run without --inside-namespace", file=sys.stderr)
        return 2
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    import psutil

    interfaces = sorted(psutil.net_if_addrs())
    if interfaces != ["lo"]:
        print(f"ray_two_nodes: error: not a private network namespace ({interfaces})",
              file=sys.stderr)
        return 2
    env = ray_env(args.inside)
    result = {"address": f"127.0.0.1:{PORT}", "nodes": [], "runs": []}
    seen: set[str] = set()
    try:
        result["nodes"] = start_nodes(args, env, args.inside)
        seen.update(listeners())
        for k, command in enumerate(args.run):
            result["runs"].append(run_one(command, env, args.inside, k, args.timeout, seen))
            seen.update(listeners())
    except Exception as exc:  # report it: the processes die with the namespace anyway
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["listeners"] = sorted(seen)
    result["beyond_loopback"] = sorted(a for a in seen if not on_loopback(a))
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)
    ok = ("error" not in result and not result["beyond_loopback"] and
          all(r["rc"] == 0 for r in result["runs"]))
    return 0 if ok else 1  # PID 1 exits: the kernel kills every process of the namespace


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return inside(args) if args.inside else outside(argv)


if __name__ == "__main__":
    sys.exit(main())

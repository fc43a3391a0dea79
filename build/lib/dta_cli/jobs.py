"""`dta submit` and `dta jobs`: training runs as Ray jobs, through Ray's Job SDK.

``dta submit --address URL [--config FILE] [key=value ...]`` resolves the config locally
(bad keys fail here, before anything is sent), ships the resolved YAML in the job's
``working_dir``, submits ``python -m dta_cli.train --config dta-config.yaml --address auto``,
follows the job's logs and exits 0 only if the job SUCCEEDED (``--no-wait``: print the job id
and return). ``dta jobs status|logs|stop JOB_ID --address URL`` inspects or stops a job.

URL is the dashboard's HTTP address (``http://127.0.0.1:8265``). Ray 2.60 clusters use token
authentication by default: export ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` (or
``RAY_AUTH_TOKEN``) with the cluster's token before running these commands.

Security: whoever can reach the dashboard port can submit a job, i.e. run arbitrary code as
the user running Ray. Keep it on 127.0.0.1 (``--dashboard-host 127.0.0.1``) and reach remote
clusters through an SSH tunnel; never disable token auth on a reachable port.
"""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time

from dta.paths import check_path

CONFIG_NAME = "dta-config.yaml"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def _common(parser) -> None:
    parser.add_argument("--address", required=True, metavar="URL",
                        help="the Ray dashboard address, e.g. http://127.0.0.1:8265")


def add_submit_arguments(parser) -> None:
    _common(parser)
    parser.add_argument("--config", metavar="FILE", help="YAML config (see configs/)")
    parser.add_argument("--no-wait", action="store_true",
                        help="print the job id and return without following the job")
    parser.add_argument("--job-id", metavar="ID", help="submission id (default: Ray's)")
    parser.add_argument("--python", default="python", metavar="EXE",
                        help="Python of the cluster that has dta installed (default: python)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="stop the job and fail after S seconds")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def add_jobs_arguments(parser) -> None:
    parser.add_argument("action", choices=("status", "logs", "stop", "list"))
    parser.add_argument("job_id", nargs="?", metavar="JOB_ID")
    _common(parser)
    parser.add_argument("--follow", action="store_true", help="logs: follow until the job ends")


AGENT_WAIT_S = 60  # a new head's job agent may not be up yet: how long submit waits for it


def _submit(client, **job):
    """``client.submit_job(**job)``, waiting (at most AGENT_WAIT_S) while the head answers that
    no job agent is available yet -- Ray's agent starts after the head and says "try again
    later"; any other error is raised at once."""
    deadline, told = time.monotonic() + AGENT_WAIT_S, False
    while True:
        try:
            return client.submit_job(**job)
        except RuntimeError as exc:
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            if not told:
                print("dta submit: the head's job agent is not up yet; waiting for it",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(1.0)


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as exc:
        hint = ""
        text = str(exc)
        if "401" in text or "403" in text or "auth" in text.lower():
            hint = (" (token auth: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH to the "
                    "cluster's token)")
        raise SystemExit(f"dta: cannot reach the Ray job API at {address}: {text}{hint}")


def _follow(client, job_id: str, out=None) -> None:
    import asyncio

    out = out or sys.stdout

    async def tail():
        async for lines in client.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(tail())


def _wait(client, job_id: str, timeout: float | None) -> str:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = client.get_job_status(job_id)
        status = str(getattr(status, "value", status))
        if status in TERMINAL:
            return status
        if deadline is not None and time.monotonic() > deadline:
            client.stop_job(job_id)
            return f"TIMEOUT (stopped after {timeout:g} s)"
        time.sleep(0.5)


def ship_paths(cfg, cwd: str | None = None):
    """Make every path of ``cfg`` absolute (relative to ``cwd``, the caller's folder — on the
    cluster a relative path would land in Ray's package cache) and check it here, before the
    job is shipped; returns ``cfg``. The cluster must see the same paths (a shared or local
    filesystem)."""
    from dta.config.schema import ConfigError

    cwd = cwd or os.getcwd()

    def absolute(key):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is None:
            return None
        path = os.path.normpath(os.path.join(cwd, os.path.expanduser(str(value))))
        setattr(getattr(cfg, section), name, path)
        return path

    model = absolute("model.path")
    if model is not None:
        check_path(model, "dir", "config key 'model.path':", error=ConfigError)
    data = absolute("workload.path")
    if data is not None:
        check_path(data, "file", "config key 'workload.path':", error=ConfigError)
        from dta.records.jsonl import read_jsonl

        read_jsonl(data)  # bad records fail here (file, line, field), not on the cluster
    ckpt_dir = absolute("train.checkpoint_dir")
    if ckpt_dir is not None:
        if cfg.train.resume and not os.path.lexists(ckpt_dir):
            raise ConfigError(f"train.resume=true but train.checkpoint_dir {ckpt_dir!r} does "
                              "not exist")
        check_path(ckpt_dir, "dir", "config key 'train.checkpoint_dir':", write=True,
                   create=not cfg.train.resume, error=ConfigError)
        from runtime.checkpoints.claim import in_use_message, live_owner  # no torch, no Ray
        from runtime.checkpoints.folders import foreign_folder

        refused = foreign_folder(ckpt_dir)
        if refused:
            raise ConfigError(f"train.checkpoint_dir: {refused}")
        owner = live_owner(ckpt_dir)
        if owner is not None:
            raise ConfigError(f"train.checkpoint_dir: {in_use_message(ckpt_dir, owner)}")
        held = os.path.isdir(ckpt_dir) and any(  # a run folder whose first save failed
            n == "latest" or n.startswith("step-") for n in os.listdir(ckpt_dir))  # is free
        if not cfg.train.resume and held:
            raise ConfigError(f"train.checkpoint_dir {ckpt_dir!r} already holds a run; resume "
                              "it (train.resume=true) or choose an empty folder")
    for key in ("train.log_dir", "train.export_hf"):
        path = absolute(key)
        if path is not None:
            check_path(path, "dir", f"config key '{key}':", create=True, write=True,
                       error=ConfigError)
    log_dir = cfg.train.log_dir
    if log_dir is not None and log_dir != ckpt_dir:  # a log folder of its own: claimed too
        from runtime.checkpoints.claim import in_use_message, live_owner

        owner = live_owner(log_dir)
        if owner is not None:
            raise ConfigError(in_use_message(log_dir, owner, key="train.log_dir"))
    return cfg


def run_submit(args) -> int:
    from dta.config.keys import check_dta_train
    from dta.config.schema import to_yaml
    from dta_cli.common import load_run_config

    cfg = load_run_config(args, "submit")
    if cfg is None:
        return 2
    check_dta_train(cfg)
    ship_paths(cfg)
    print("dta submit: paths made absolute: " + ", ".join(
        f"{k}={v}" for k, v in (("model.path", cfg.model.path), ("workload.path", cfg.workload.path),
                                ("train.checkpoint_dir", cfg.train.checkpoint_dir),
                                ("train.log_dir", cfg.train.log_dir),
                                ("train.export_hf", cfg.train.export_hf)) if v) or
          "dta submit: no paths in the config", file=sys.stderr)
    client = _client(args.address)
    workdir = tempfile.mkdtemp(prefix="dta-job-")
    try:
        with open(os.path.join(workdir, CONFIG_NAME), "w") as f:
            f.write(to_yaml(cfg))
        entrypoint = " ".join([shlex.quote(args.python), "-m", "dta_cli.train", "--config",
                               CONFIG_NAME, "--address", "auto", "--no-progress"])
        runtime_env = {"working_dir": workdir,
                       "env_vars": {"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}}
        job_id = _submit(client, entrypoint=entrypoint, runtime_env=runtime_env,
                         submission_id=args.job_id, metadata={"tool": "dta", "command": "train"})
    finally:
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)  # uploaded by submit_job
    print(f"submitted job {job_id}", flush=True)
    if args.no_wait:
        return 0
    try:
        _follow(client, job_id)
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on (dta jobs stop {job_id} "
              f"--address {args.address})", file=sys.stderr)
        return 130
    except Exception as exc:  # log streaming is best effort; the status is what counts
        print(f"dta submit: could not follow the logs ({exc})", file=sys.stderr)
    status = _wait(client, job_id, args.timeout)
    print(f"job {job_id}: {status}", flush=True)
    return 0 if status == "SUCCEEDED" else 1


def run_jobs(args) -> int:
    client = _client(args.address)
    if args.action == "list":
        for job in client.list_jobs():
            print(f"{job.submission_id}\t{job.status}\t{job.entrypoint}")
        return 0
    if not args.job_id:
        print(f"dta jobs {args.action}: JOB_ID is required", file=sys.stderr)
        return 2
    try:
        if args.action == "status":
            info = client.get_job_info(args.job_id)
            status = str(getattr(info.status, "value", info.status))
            print(f"{args.job_id}: {status}" + (f" ({info.message})" if info.message else ""))
            return 0
        if args.action == "logs":
            if args.follow:
                _follow(client, args.job_id)
            else:
                sys.stdout.write(client.get_job_logs(args.job_id))
            return 0
        stopped = client.stop_job(args.job_id)
        print(f"{args.job_id}: {'stop requested' if stopped else 'already finished'}")
        return 0
    except RuntimeError as exc:  # the SDK raises RuntimeError for unknown job ids
        print(f"dta jobs {args.action}: {exc}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    """``python -m dta_cli.jobs submit|jobs ...``: these two commands without the full
    ``dta`` registry."""
    import argparse

    parser = argparse.ArgumentParser(prog="dta", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_submit_arguments(sub.add_parser("submit", help="submit a training run as a Ray job"))
    add_jobs_arguments(sub.add_parser("jobs", help="status | logs | stop | list of Ray jobs"))
    from dta_cli.common import add_debug_argument, run_guarded

    for p in sub.choices.values():
        add_debug_argument(p)
    args = parser.parse_args(argv)
    return run_guarded(run_submit if args.command == "submit" else run_jobs, args, args.command)


if __name__ == "__main__":
    sys.exit(main())

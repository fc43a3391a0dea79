"""`dta train`: balanced data-parallel DFS training on Ray.

With no arguments it runs the embedded default (configs/default.yaml: a tiny random-init
Qwen3, τ²-airline-shaped batches, 2 CPU workers on a private local Ray instance bound to
127.0.0.1). ``--config FILE`` and ``key=value`` overrides change it; ``--address`` joins a
running cluster instead (``auto`` inside a Ray job).
"""
from __future__ import annotations

import sys


def add_arguments(parser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="YAML config merged over the defaults (see configs/)")
    parser.add_argument("--address", metavar="URL",
                        help="join this Ray cluster (default: start a private local instance "
                             "on 127.0.0.1; 'auto' inside a Ray job)")
    parser.add_argument("--json", action="store_true",
                        help="print the summary as one JSON object on the last line")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (after overrides) and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. actor.eps_clip=0.3 ray.num_workers=4")


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def print_summary(summary: dict, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, highlight=False)
    if not summary.get("steps"):
        console.print("no steps were run")
        return
    t = Table(title=f"dta train: {summary['steps']} steps on {summary['workers']} workers")
    t.add_column("step", justify="right")
    t.add_column("loss", justify="right")
    t.add_column("grad norm", justify="right")
    t.add_column("time", justify="right")
    first = summary["first_step"]
    for k, (loss, norm, s) in enumerate(zip(summary["loss"], summary["grad_norm"],
                                             summary["step_s"])):
        t.add_row(str(first + k), f"{loss:.5f}", f"{norm:.4f}", f"{s:.2f} s")
    console.print(t)
    console.print(f"backend {summary.get('backend', '?')}; plan {summary.get('plan_method')}")
    if summary.get("worker_nodes"):
        console.print(f"workers on {summary['nodes']} Ray node(s) (ray.placement="
                      f"{summary.get('placement')}; rendezvous "
                      f"{summary.get('rendezvous') or 'none, one worker'}): "
                      + ", ".join(n[:8] for n in summary["worker_nodes"]))
    tot, uniq, fwd = summary["tokens_total"], summary["tokens_unique"], summary["tokens_forwarded"]
    console.print(f"tokens: {tot:,} total (unpacked), {uniq:,} unique in the batch trees "
                  f"(sharing ratio {summary['sharing_ratio']:.2f}x); forwarded by the workers "
                  f"{fwd:,} ({summary['duplicated_tokens']:,} duplicated across workers), "
                  f"saved {summary['tokens_saved']:,} ({summary['effective_ratio']:.2f}x)")
    console.print(f"step time: median {summary['step_s_median']:.2f} s, mean "
                  f"{summary['step_s_mean']:.2f} s; imbalance (max/mean planned cost) "
                  f"{summary['imbalance_mean']:.3f}")
    peaks = ", ".join(_gib(p) for p in summary["peak_memory_bytes"])
    console.print(f"peak memory per worker ({summary.get('peak_memory_kind')}): {peaks}")
    if summary.get("sharding"):
        held = ", ".join("?" if b is None else _size(b["params"] + b["grads"] + b["optimizer"])
                         + (f" (+ {_size(b['host'])} host)" if b.get("host") else "")
                         for b in summary.get("state_bytes") or [])
        console.print(f"sharding {summary['sharding']}: params + grads + optimizer per worker "
                      f"{held}; parameter norm {summary.get('param_norm', float('nan')):.6f}")
    if summary.get("prefetch_overlaps"):
        console.print(f"prefetch: {summary['prefetch_overlaps']}")
    auto = summary.get("sharding_auto")
    if auto:  # what the memory model chose, and at which context-parallel size it priced
        console.print(f"memory model ({_size(auto['budget_bytes'])} budget per worker, "
                      f"{_size(auto['usable_bytes'])} usable): {auto['choice']}, priced at "
                      f"context parallel {'/'.join(map(str, auto['priced_context_parallel']))}")
    if "ray_start_s" in summary:
        console.print(f"startup: Ray {summary['ray_start_s']:.1f} s, workers "
                      f"{summary.get('workers_start_s', 0):.1f} s")


def _size(n: int) -> str:
    """Bytes as GiB, or MiB below 1 GiB (a tiny model's state would print as 0.00 GiB)."""
    return _gib(n) if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def resume_command(args) -> str:
    """The command line that continues this run (the line a stop signal ends it with); in a
    job of ``dta submit``, the submit command it set."""
    import os
    import shlex

    from dta_cli.jobs import RESUME_ENV

    if os.environ.get(RESUME_ENV):
        return os.environ[RESUME_ENV]
    argv = ["dta", "train"]
    if args.config:
        argv += ["--config", args.config]
    if args.address:
        argv += ["--address", args.address]
    argv += [o for o in args.overrides if o.split("=", 1)[0].lstrip("+~") != "train.resume"]
    return shlex.join(argv + ["train.resume=true"])


def run(args) -> int:
    from dta.config.schema import to_yaml
    from dta_cli.common import load_run_config

    cfg = load_run_config(args, "train")
    if cfg is None:
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0

    from runtime.ray_runtime.cluster import probe_address

    address = args.address or cfg.ray.address
    if address:
        print(f"dta train: checking the Ray address {address}", file=sys.stderr, flush=True)
        probe_address(address)  # fails within seconds, before torch and Ray are imported

    from dta.batch import BatchError
    from dta_cli.batches import BatchSource
    from runtime.ray_runtime import TrainingError, run_training
    from runtime.ray_runtime.cluster import ClusterError
    from runtime.ray_runtime.model_info import model_limits
    from runtime.ray_runtime.run import Interrupted

    try:
        source = BatchSource(cfg, model_limits(cfg)[0])
        summary = run_training(cfg, source, address=args.address,
                               progress=not args.no_progress,
                               resume_command=resume_command(args))
    except Interrupted as exc:
        print(f"dta train: {exc}", file=sys.stderr)
        return exc.exit_code
    except (BatchError, TrainingError, ClusterError, ValueError, FileNotFoundError) as exc:
        if getattr(args, "debug", False):
            raise  # --debug: the traceback (a worker's failure: the worker's own, chained)
        print(f"dta train: error: {exc}", file=sys.stderr)
        return 1
    print_summary(summary)
    if args.json:
        from dta_cli.common import emit_json

        emit_json(summary)
    return 0


def main(argv=None) -> int:
    """``python -m dta_cli.train``: the same command without the full ``dta`` registry
    (used as a Ray job's entrypoint, where only this command is needed)."""
    import argparse

    from dta_cli.common import add_debug_argument, run_guarded

    parser = argparse.ArgumentParser(prog="dta train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    add_debug_argument(parser)
    return run_guarded(run, parser.parse_args(argv), "train")


if __name__ == "__main__":
    sys.exit(main())

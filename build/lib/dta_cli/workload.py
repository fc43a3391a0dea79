"""`dta workload`: generate a τ²-shaped (or GRPO) batch, print its sharing statistics, and
optionally write it as JSONL (the format of ``dta.records.jsonl``)."""
from __future__ import annotations

import argparse
import sys

from dta_cli.common import emit_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="tau2-airline", metavar="NAME",
                        help="tau2-airline | tau2-retail | tau2-telecom | tau2-mock (suffixes "
                             "-concat, -nothink) | grpo-synthetic (default: tau2-airline)")
    parser.add_argument("--scale", default="full",
                        help="full | small | tiny | a number in (0, 1] (default: full)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=None, metavar="G",
                        help="rollouts per task (default: the scale's; 8 at full)")
    parser.add_argument("--tasks", type=int, default=None, metavar="B",
                        help="tasks (groups) per batch (default: the scale's; 16 at full)")
    parser.add_argument("--export", choices=("per-call", "concat"), default=None,
                        help="tau2: one sequence per agent call (default) or per episode")
    parser.add_argument("--no-thinking", action="store_true",
                        help="tau2: calls output no thinking")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="token ids stay below this (default: 151936, Qwen3)")
    parser.add_argument("--out", default=None, metavar="FILE.jsonl", help="write the batch here")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the statistics as the last line")


def _overrides(args: argparse.Namespace) -> dict:
    kw = {}
    for opt, key in (("group_size", "group_size"), ("tasks", "tasks"), ("export", "export"),
                     ("vocab_size", "vocab_size")):
        if getattr(args, opt) is not None:
            kw[key] = getattr(args, opt)
    if args.no_thinking:
        kw["thinking"] = False
    return kw


def _print_table(st: dict, params: dict, out_path: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{st['workload']}  (scale {params.get('scale')}, seed {params.get('seed')})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    rows = [
        ("tasks × group size", f"{params.get('tasks')} × {params.get('group_size')}"),
        ("sequences", f"{st['sequences']:,}"),
        ("total tokens", f"{st['total_tokens']:,}"),
        ("unique tree tokens", f"{st['unique_tokens']:,}"),
        ("sharing ratio", f"{st['sharing_ratio']:.2f}×"),
        ("trainable share of total / unique",
         f"{st['trainable_share_total']:.1%} / {st['trainable_share_unique']:.1%}"),
    ]
    for key, label in (("prompt_tokens", "prompt"), ("completion_tokens", "completion"),
                       ("sequence_tokens", "sequence")):
        p = st[key]
        rows.append((f"{label} p50 / p90 / max",
                     f"{p['p50']:,.0f} / {p['p90']:,.0f} / {p['max']:,}"))
    for r in rows:
        table.add_row(*r)
    console = Console()
    console.print(table)
    if out_path:
        console.print(f"wrote {st['sequences']:,} records to {out_path}")


def run(args: argparse.Namespace) -> int:
    from dta.paths import check_path
    from experiments.workloads import make_workload

    try:
        if args.out:  # before the batch is generated
            check_path(args.out, "file", "--out", create=True, write=True)
        scale = float(args.scale) if args.scale not in ("full", "small", "tiny") else args.scale
        wl = make_workload(args.workload, scale=scale, seed=args.seed,
                           progress=not args.json and sys.stderr.isatty(), **_overrides(args))
    except (ValueError, TypeError) as e:
        print(f"dta workload: {e}", file=sys.stderr)
        return 2
    if args.out:
        wl.to_jsonl(args.out)
    st = wl.stats()
    if args.json:
        emit_json({**st, "params": wl.params, "out": args.out})
    else:
        _print_table(st, wl.params, args.out)
    return 0

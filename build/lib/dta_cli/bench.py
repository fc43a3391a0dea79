"""`dta bench`: memory/throughput benchmark of the training modes (padded, microbatch,
dense tree mask, DFS node by node, packed DFS retain/recompute) on one τ²-shaped batch or on
your own (``--input FILE.jsonl``, e.g. from `dta import`; ``--max-sequences`` /
``--max-tokens`` cut it by whole groups and episodes; ``--model PATH`` a local model), each
(mode, repeat) in a fresh process, modes interleaved; JSON, Markdown table and plots under
--out. The options and the harness live in ``experiments.bench`` (config, cli, inputs, run)."""
from __future__ import annotations

import argparse
import sys

from dta_cli.common import emit_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from experiments.bench.cli import add_arguments as add

    add(parser)


def run(args: argparse.Namespace) -> int:
    from dta.paths import check_path
    from experiments.bench.cli import config_from_args
    from experiments.bench.run import compact
    from experiments.bench.run import run as run_bench

    try:
        if args.input:  # the user's paths, before anything is built or run
            check_path(args.input, "file", "--input")
        if args.model_path:
            check_path(args.model_path, "dir", "--model",
                       hint="a local Hugging Face model folder: DTA never downloads one")
        if args.out:
            check_path(args.out, "dir", "--out", create=True, write=True)
        cfg = config_from_args(args)
        results = run_bench(cfg, progress=not args.json and sys.stderr.isatty())
    except ValueError as e:
        print(f"dta bench: {e}", file=sys.stderr)
        return 2
    summary = compact(results)
    if args.json:
        emit_json(summary)
    else:
        from pathlib import Path

        print(Path(results["out"], "results.md").read_text())
        print(f"results: {results['out']}")
    bad = [m for p in results["points"] for m, v in p["summary"]["modes"].items()
           if v["status"] in ("WRONG", "FAILED")]
    return 1 if bad else 0

"""The `dta` command: DFS tree training, its checks, benchmarks and runtime.

The outermost layer, on top of the `dta` library, `runtime` and `experiments`.

Each subcommand lives in its own module of this package and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Commands that report figures take
``--json`` and then print one JSON object as the last line of their output.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Modules are imported lazily so that `dta verify` does not
# pay for importing Ray, and a missing optional extra fails only the command that needs it.
COMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("dta_cli.verify", "train a batch by DFS and unpacked; report relative errors"),
    "workload": ("dta_cli.workload", "generate a tau2-shaped batch, print its sharing stats"),
    "import": ("dta_cli.importer", "conversations (tau2 results, OpenAI chat) -> training records"),
    "plan": ("dta_cli.plan", "pack a batch into budgets or balance it over workers"),
    "bench": ("dta_cli.bench", "memory/throughput benchmark of all training modes"),
    "train": ("dta_cli.train", "run DFS training (local Ray by default)"),
    "submit": ("dta_cli.jobs", "submit a training run as a Ray job and follow it"),
    "jobs": ("dta_cli.jobs", "status | logs | stop of a submitted Ray job"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the invoked command's module is imported (its options added)."""
    parser = argparse.ArgumentParser(prog="dta", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name != command:
            continue
        # Command modules import their heavy dependencies (torch, ray) inside run().
        module = importlib.import_module(module_name)
        from dta_cli.common import add_debug_argument

        add_debug_argument(p)
        # A module that serves several commands (submit / jobs) picks by name.
        add = getattr(module, f"add_{name}_arguments", None) or module.add_arguments
        add(p)
        p.set_defaults(_run=getattr(module, f"run_{name}", None) or module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    from dta.versions import untested
    from dta_cli.common import run_guarded

    for line in untested():  # one line per package outside the tested range; the command runs
        print(f"dta {args.command}: warning: {line}", file=sys.stderr)

    return run_guarded(args._run, args, args.command)


if __name__ == "__main__":
    sys.exit(main())

"""Options shared by several commands: model, workload, JSON output."""
from __future__ import annotations

import json
import sys

from dta.records.jsonl import json_safe


def add_model_arguments(p) -> None:
    from dta.model.families import FAMILIES  # metadata only: no torch import

    g = p.add_argument_group("model")
    g.add_argument("--family", default="qwen3", choices=sorted(FAMILIES), metavar="FAMILY",
                   help="random-init model family: " + " | ".join(sorted(FAMILIES)))
    g.add_argument("--size", default="tiny", help="tiny | small | qwen3-0.6b | qwen3-1.7b")
    g.add_argument("--model-path", default=None, help="a local HF model directory (overrides --family)")
    g.add_argument("--dtype", default="float32", help="float32 | float64 | bfloat16")
    g.add_argument("--seed", type=int, default=0)


def add_workload_arguments(p, default: str = "tau2-airline", scale: str = "tiny") -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default=default, help="a generator name (see `dta workload`)")
    g.add_argument("--scale", default=scale, help="tiny | small | full | a float in (0, 1]")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--input", default=None, metavar="FILE.jsonl",
                   help="your own rollouts, one JSON object per line (input_ids, optional "
                        "loss_mask, advantages, logprobs, group_id); overrides --workload")


def check_input_paths(args) -> None:
    """``--model-path`` (a folder) and ``--input`` (a file), before anything is built."""
    from dta.paths import check_path

    if getattr(args, "model_path", None):
        check_path(args.model_path, "dir", "--model-path",
                   hint="a local Hugging Face model folder: DTA never downloads one")
    if getattr(args, "input", None):
        check_path(args.input, "file", "--input")


def make_model(args):
    from dta.model.models import build_model, load_model

    if args.model_path:
        return load_model(args.model_path, dtype=args.dtype)
    return build_model(args.family, args.size, dtype=args.dtype, seed=args.seed,
                       matrix=bool(getattr(args, "matrix", False)))


def load_records(args, vocab_size: int) -> list[dict]:
    """Records from --input or from the named generator, with ids inside the vocabulary."""
    if args.input:
        from dta.records.jsonl import read_jsonl

        return read_jsonl(args.input)
    from experiments.workloads import make_workload

    return make_workload(args.workload, scale=args.scale, seed=args.workload_seed,
                         vocab_size=vocab_size).records


def strict_json(obj) -> str:
    """One line of strict JSON (RFC 8259): a non-finite number is written as null."""
    return json.dumps(json_safe(obj), allow_nan=False)


def emit_json(obj: dict) -> None:
    """The last line of output: one strict-JSON object (NaN/inf written as null)."""
    sys.stdout.flush()
    print(strict_json(obj), flush=True)


def add_debug_argument(parser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (default: one line)")


def run_guarded(run, args, command: str) -> int:
    """``run(args)`` with errors as one line on stderr (``--debug``: the traceback)."""
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        if getattr(args, "debug", False):
            raise
        print(f"dta {command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the CLI boundary: one line, not a traceback
        if getattr(args, "debug", False):
            raise
        print(f"dta {command}: error: {one_line(exc)}", file=sys.stderr)
        if not _is_input_error(exc):
            print(f"dta {command}: (an unexpected {type(exc).__name__}; run with --debug for "
                  "the traceback)", file=sys.stderr)
        return 1


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")[0].split()) or type(exc).__name__
    return text[:2000]


def _is_input_error(exc: BaseException) -> bool:
    """Errors about the user's input or environment (their message is the whole story)."""
    return isinstance(exc, (ValueError, OSError, RuntimeError, KeyError, LookupError))


def load_run_config(args, command: str):
    """The run config from --config and key=value overrides, or None after printing the
    error (which names the key) for `command`."""
    from dta.config.schema import ConfigError, load_config
    from dta.paths import check_path

    try:
        if args.config is not None:
            check_path(args.config, "file", "--config", error=ConfigError)
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"dta {command}: {exc}", file=sys.stderr)
        return None

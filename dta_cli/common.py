"""Options shared by several commands: model, workload, JSON output."""
from __future__ import annotations

import json
import sys


def add_model_arguments(p) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--family", default="qwen3", help="llama | qwen2 | qwen3 (random init)")
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


def make_model(args):
    from dta.models import build_model, load_model

    if args.model_path:
        return load_model(args.model_path, dtype=args.dtype)
    return build_model(args.family, args.size, dtype=args.dtype, seed=args.seed)


def load_records(args, vocab_size: int) -> list[dict]:
    """Records from --input or from the named generator, with ids inside the vocabulary."""
    if args.input:
        from dta.jsonl import read_jsonl

        return read_jsonl(args.input)
    from experiments.workloads import make_workload

    return make_workload(args.workload, scale=args.scale, seed=args.workload_seed,
                         vocab_size=vocab_size).records


def emit_json(obj: dict) -> None:
    """The last line of output: one JSON object."""
    sys.stdout.flush()
    print(json.dumps(obj, default=float))


def load_run_config(args, command: str):
    """The run config from --config and key=value overrides, or None after printing the
    error (which names the key) for `command`."""
    from dta.config import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"dta {command}: {exc}", file=sys.stderr)
        return None

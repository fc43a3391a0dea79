"""The benchmark's command-line options, shared by ``python -m experiments.bench.run`` and
``dta bench`` (``dta_cli/bench.py`` builds on this module; experiments never import dta_cli).
It builds a :class:`~experiments.bench.config.BenchConfig` and does not import the harness
(:mod:`experiments.bench.run` imports this module for its ``main``)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--workload", default="tau2-airline", help="workload name (default: tau2-airline)")
    a("--scale", default="small", help="full | small | tiny | a number in (0, 1] (default: small)")
    a("--seed", type=int, default=0, help="workload seed")
    a("--tasks", type=int, default=None, metavar="B", help="override the tasks (groups) per batch")
    a("--group-size", type=int, default=None, metavar="G", help="override the group size")
    a("--input", default=None, metavar="FILE.jsonl",
      help="your own batch (dta.records.jsonl records, e.g. from `dta import`) instead of --workload")
    a("--max-sequences", type=int, default=None, metavar="N",
      help="--input: keep at most N sequences, by whole groups then whole episodes, in file order")
    a("--max-tokens", type=int, default=None, metavar="T",
      help="--input: keep at most T tokens, by whole groups then whole episodes, in file order")
    a("--model", default=None, metavar="PATH", dest="model_path",
      help="a local Hugging Face model directory (its weights); default: a random-init "
           "--family / --model-size")
    a("--vocab-size", type=int, default=None, metavar="V",
      help="random-init model: its vocabulary size instead of --model-size's (e.g. your "
           "tokenizer's, so that the ids of an --input batch are covered)")
    a("--family", default="qwen3", help="llama | qwen2 | qwen3 (default: qwen3)")
    a("--model-size", default="small",
      help="tiny | small | qwen3-0.6b | qwen3-1.7b (random init; default: small)")
    a("--dtype", default="float32", help="float32 | bfloat16 | float16 | float64")
    a("--device", default="cpu", help="cpu | cuda")
    a("--attn", default="sdpa", help="sdpa | flash_attention_2 | flex_attention (tree-mask modes "
                                     "always use sdpa / flex_attention; DFS packs with branches "
                                     "need sdpa, eager or flex_attention)")
    a("--loss", default=None, choices=("ppo", "nll"),
      help="token loss (global token mean; default: ppo, or with --input nll unless every record "
           "has advantages and logprobs)")
    a("--modes", default=None,
      help="comma-separated modes (default: padded,microbatch,treemask,dfs-node,dfs-retain,"
           "dfs-recompute; also treemask-flex on a GPU; hybrid GDN families: without treemask)")
    a("--repeats", type=int, default=3, help="rounds of all modes (default: 3)")
    a("--threads", type=int, default=2, help="torch threads in every child (default: 2)")
    a("--warmup", choices=("small", "full", "none"), default="small",
      help="warm-up step before the timed one: on a 2-sequence cut of the batch (default), "
           "on the full batch (GPU: autotuning, FlexAttention compilation), or none")
    a("--in-process", action="store_true",
      help="all runs of a point in one worker process (no model load per run; CUDA peaks stay "
           "per run, CPU RSS peaks do not): the GPU script's setting")
    a("--microbatch-tokens", type=int, default=None,
      help="padded-token budget of a micro-batch (default: the longest sequence: one at a time)")
    a("--pad-batch", type=int, default=0,
      help="sequences per padded batch in mode padded (default 0: all in one batch)")
    a("--tree-tokens", type=int, default=32768,
      help="unique-token budget of one packed tree row in mode treemask (default: 32768)")
    a("--logits-chunk", type=int, default=1024, help="LM-head rows per chunk (all modes)")
    a("--packing", default="auto",
      help="pack policy of modes dfs-retain / dfs-recompute: node | siblings | subtrees | auto "
           "| tree (default: auto, the cost model's choice; dfs-node is always node by node)")
    a("--pack-tokens", type=int, default=None,
      help="token cap of one DFS pack (default: the walker's, dta.planning.packs.default_cap: "
           "512 under retain; under recompute max(512, longest sequence // 2))")
    a("--head-rows", type=int, default=None,
      help="DFS: queued LM-head rows that force a flush (default: --logits-chunk)")
    a("--timeout", type=float, default=600.0,
      help="seconds per worker process (one run; all runs of a point with --in-process) "
           "before it is killed")
    a("--grad-tol", type=float, default=None,
      help="relative L2 gradient error above which a mode is WRONG (default by dtype: "
           "float32 1e-4, bfloat16 5e-2, float64 1e-10)")
    a("--sweep", choices=("batch", "sharing"), default=None,
      help="batch: vary the task count; sharing: vary group size / thinking")
    a("--sweep-values", default=None,
      help="batch: task counts (default 1,2,4); sharing: group sizes or nothink[@G] "
           "(default 2,4,nothink@4)")
    a("--out", default=None, help="output directory (default: results/bench-<date>)")
    a("--json", action="store_true", help="print one JSON object as the last line")


def config_from_args(args: argparse.Namespace):
    from experiments.bench.config import BenchConfig
    from experiments.bench.modes import DEFAULT_MODES

    overrides = {k: v for k, v in (("tasks", args.tasks), ("group_size", args.group_size))
                 if v is not None}
    modes = tuple(m.strip() for m in args.modes.split(",")) if args.modes else DEFAULT_MODES
    if not args.modes:
        from dta.model.models import build_config
        from dta.model.recurrent import is_hybrid

        if is_hybrid(build_config(args.family, args.model_size)):  # no tree mask for a recurrence
            modes = tuple(m for m in modes if not m.startswith("treemask"))
    return BenchConfig(
        workload=args.workload, scale=args.scale, seed=args.seed, family=args.family,
        size=args.model_size, dtype=args.dtype, device=args.device, attn=args.attn,
        loss=args.loss, modes=modes, repeats=args.repeats, threads=args.threads,
        warmup=args.warmup, in_process=args.in_process, microbatch_tokens=args.microbatch_tokens,
        pad_batch=args.pad_batch, tree_tokens=args.tree_tokens, logits_chunk=args.logits_chunk,
        packing=args.packing, pack_tokens=args.pack_tokens, head_rows=args.head_rows,
        timeout=args.timeout, grad_tol=args.grad_tol, sweep=args.sweep,
        sweep_values=args.sweep_values, overrides=overrides, out=args.out, input=args.input,
        max_sequences=args.max_sequences, max_tokens=args.max_tokens, model_path=args.model_path,
        vocab_size=args.vocab_size)

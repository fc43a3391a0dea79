"""`dta plan`: build one global prefix tree for a batch, pack it into fixed budgets
(``--capacity``) and/or balance it over workers (``--workers``), and report the plan.

Input is a generated workload (``--workload NAME --scale S --seed N``, from
``experiments.workloads``) or a JSONL batch (``--input FILE.jsonl``, the format of
``dta.records.jsonl``). ``--json`` prints one JSON object as the last line: ``bins`` (count),
``bin_tokens``, ``lower_bound``, ``gap``, ``plan_ms`` (all planning after the tree build),
``sharing`` (where the sharing comes from: :mod:`dta.planning.sharing`), ``flop_ratio`` (the
tree's ideal FLOP saving for ``--model``),
``bin_sequences``; with ``--workers``: ``workers``, ``worker_cost``, ``worker_tokens``,
``imbalance``, ``duplicated_tokens``, ``worker_sequences``; with ``--memory``: ``memory``
(per-rank bytes of each sharding mode; every data-parallel x context-parallel x mode x policy
x block candidate priced in memory and modeled step time, and the fastest that fits
``--budget-gib``, which implies ``--memory``: docs/planning.md). With ``--input`` alone, the
sharing breakdown only.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from dta_cli.common import emit_json
from dta_cli.plan_memory import memory_report

METHODS = ("inorder", "bfd", "dfs")  # dta.planning.PACKERS (checked at run time)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dta.options import WalkOptions
    from dta.planning.cp import CP_SCHEME, CP_SCHEMES
    from dta.planning.memory import SHARDINGS
    from dta.planning.shapes import SHAPES
    from dta.planning.state import OFFLOADS
    from dta.planning.timing import PEAK_TFLOPS, Hardware

    src = parser.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None, metavar="NAME",
                     help="generated batch, e.g. tau2-airline (default when no --input)")
    src.add_argument("--input", default=None, metavar="FILE.jsonl", help="a JSONL batch")
    parser.add_argument("--scale", default="full", help="workload scale (default: full)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--tasks", type=int, default=None, metavar="B",
                        help="workload: tasks (groups) per batch (default: the scale's)")
    parser.add_argument("--capacity", type=int, default=None, metavar="N",
                        help="pack into bins of N unique tokens")
    parser.add_argument("--method", default="dfs", choices=METHODS,
                        help="packing method (default: dfs)")
    parser.add_argument("--workers", type=int, default=None, metavar="W",
                        help="balance the batch over W workers")
    parser.add_argument("--model", default="qwen3-1.7b",
                        help="cost model for --workers (and --memory): a size of dta.model.models (e.g. "
                             f"qwen3-0.6b), a named shape ({', '.join(SHAPES)}), a Hugging "
                             "Face config.json path, or 'tokens' (default: qwen3-1.7b)")
    parser.add_argument("--art-sharing", action="store_true",
                        help="stop sharing before the first trainable token (ART's accounting)")
    min_shared = WalkOptions.default("min_shared")  # the walk's (dta/options.py)
    parser.add_argument("--min-shared", type=int, default=min_shared, metavar="N",
                        help=f"do not share segments shorter than N tokens (default: {min_shared})")
    mem = parser.add_argument_group("memory (with --workers W)")
    mem.add_argument("--memory", action="store_true",
                     help="per-rank memory of each sharding mode for --model at W workers "
                          "(dta.planning.memory), and the mode that fits --budget-gib")
    mem.add_argument("--budget-gib", type=float, default=None, metavar="G",
                     help="per-GPU memory budget for the mode choice (e.g. 80, 141)")
    mem.add_argument("--host-budget-gib", type=float, default=None, metavar="G",
                     help="host memory per GPU (e.g. 256: 2 TiB over 8 GPUs): a layout whose "
                          "host bytes (offloaded state, AdamW's step counters) exceed it is "
                          "refused, with the reason (default: unbudgeted)")
    mem.add_argument("--sharding", default="auto", choices=("auto",) + SHARDINGS,
                     help="the sharding mode priced (default: auto, every one)")
    mem.add_argument("--compute-dtype", default="bfloat16",
                     choices=("bfloat16", "float16", "float32", "float64"),
                     help="compute dtype (fp32 masters under 16 bits; default: bfloat16)")
    mem.add_argument("--policy", default="auto", choices=("auto", "retain", "recompute"),
                     help="walker memory policy priced (default: auto, both: the choice is by "
                          "modeled throughput among those that fit)")
    mem.add_argument("--block-tokens", type=int, default=None, metavar="B",
                     help="price blocks of B tokens (0: nodes uncut; default: none, 8192 .. "
                          "1024, and 512 when nothing fits with a longer one)")
    mem.add_argument("--headroom", type=float, default=None, metavar="F",
                     help="share of --budget-gib left free for the CUDA context, allocator "
                          "fragmentation and communication buffers (default: 0.1)")
    mem.add_argument("--context-parallel", default="auto", metavar="C",
                     help="ranks per tree (docs/planning.md; default: auto, every C of "
                          "1, 2, 4, 8, 16 dividing W)")
    mem.add_argument("--context-parallel-scheme", default=CP_SCHEME, choices=CP_SCHEMES,
                     help="how a group of C ranks divides its tree (dta.planning.cp; default: "
                          f"{CP_SCHEME}: rows outside attention, heads inside)")
    mem.add_argument("--expert-parallel", default="auto", metavar="E",
                     help="ranks an MoE layer's routed experts are divided over (default: auto, "
                          "every E dividing W and the experts; 1 for a dense model)")
    mem.add_argument("--shard-size", default="auto", metavar="S",
                     help="ranks zero1/fsdp shard the state over, replicated across W / S "
                          "groups (HSDP; default: auto, W and one node, --gpus-per-node, "
                          "where it divides W)")
    mem.add_argument("--offload", default="auto", choices=("auto",) + OFFLOADS,
                     help="keep the optimizer state and masters in host memory and step "
                          "there (optimizer), and the calls' gradient sum too (gradients: "
                          "fsdp, zero2); default: auto, each: a candidate is offloaded more "
                          "only where it does not fit with less")
    for flag, what in (("--node-resident", "fsdp gathers from a copy held in the node "
                                           "(hpZ; --shard-size below W)"),
                       ("--prefetch", "fsdp's next-layer all-gather overlaps the current "
                                      "layer's compute")):
        mem.add_argument(flag, default="auto", choices=("auto", "on", "off"),
                         help=f"{what} (default: auto, both where they apply)")
    mem.add_argument("--lora-r", type=int, default=0, metavar="R",
                     help="price a LoRA run: rank-R adapters, the base frozen (replicate and "
                          "zero1; grads and optimizer count the adapters only)")
    mem.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
                     help="adapted modules for --lora-r (default: q_proj,k_proj,v_proj,o_proj)")
    hw = Hardware()
    tm = parser.add_argument_group("time model (with --memory; docs/planning.md)")
    peaks = ", ".join(f"{k} {v:g}" for k, v in PEAK_TFLOPS.items())
    tm.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                    help=f"dense peak TFLOP/s per GPU (default: an H100 SXM's by --compute-dtype: "
                         f"{peaks})")
    tm.add_argument("--utilization", type=float, default=None, metavar="U",
                    help=f"share of the peak the walk sustains (default: {hw.utilization:g})")
    tm.add_argument("--intra-node-gbs", type=float, default=None, metavar="GBS",
                    help=f"GB/s a GPU sends at inside a node (default: {hw.intra_node_gbs:g}, "
                         "NVLink 4 per direction)")
    tm.add_argument("--inter-node-gbs", type=float, default=None, metavar="GBS",
                    help=f"GB/s a GPU sends at across nodes (default: {hw.inter_node_gbs:g}, "
                         "one 400 Gb/s NIC per GPU)")
    tm.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                    help=f"GPUs per node (default: {hw.gpus_per_node})")
    tm.add_argument("--latency-us", type=float, default=None, metavar="US",
                    help=f"microseconds per collective call (default: {hw.latency_us:g})")
    tm.add_argument("--host-link-gbs", type=float, default=None, metavar="GBS",
                    help=f"GB/s a GPU moves to or from host memory, --offload (default: "
                         f"{hw.host_link_gbs:g}, PCIe Gen5 shared in a node)")
    tm.add_argument("--host-adam-gparams", type=float, default=None, metavar="G",
                    help=f"billions of parameters a second the host's AdamW steps per GPU, "
                         f"--offload (default: {hw.host_adam_gparams:g})")
    tm.add_argument("--host-add-gelems", type=float, default=None, metavar="G",
                    help=f"billions of fp32 elements a second the host adds into its gradient "
                         f"sum per GPU, --offload gradients (default: {hw.host_add_gelems:g})")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the plan as the last line")


def _records(args):
    if args.input:
        from dta.records.jsonl import read_jsonl
        return read_jsonl(args.input), args.input
    from experiments.workloads import make_workload
    name = args.workload or "tau2-airline"
    kw = {"tasks": args.tasks} if args.tasks else {}
    w = make_workload(name, scale=args.scale, seed=args.seed, **kw)
    return w.records, f"{name} (scale {args.scale}, seed {args.seed})"


def _cost_model(name: str):
    from dta.planning import CostModel
    if name == "tokens":
        return CostModel.tokens_only()
    if name.endswith(".json"):
        with open(name, encoding="utf-8") as f:
            return CostModel.from_config(json.load(f), name=name)
    from dta.model.models import SIZES
    from dta.planning.memory import SHAPES
    if name in SHAPES:
        return CostModel.from_config(SHAPES[name], name=name)
    if name not in SIZES:
        raise ValueError(f"unknown model {name!r}; choose from tokens, a config.json, "
                         f"{', '.join(SIZES)}")
    return CostModel.from_config(SIZES[name], name=name)


def _sharing(args, records, tree) -> dict:
    """Where the sharing comes from (chains, groups, the batch) and the FLOP ratio of the
    tree for --model (unpacked FLOPs / DFS FLOPs)."""
    from dta.planning import ideal_speedup
    from dta.planning.sharing import format_breakdown, sharing_breakdown

    breakdown = sharing_breakdown(records)
    print("\n".join(format_breakdown(breakdown)))
    model = _cost_model(args.model)
    ratio = float(ideal_speedup(tree, model))
    print(f"  FLOP ratio for {model.name} (one sequence at a time / the tree): {ratio:.2f}x")
    return dict(sharing=breakdown, flop_model=model.name, flop_ratio=round(ratio, 4))


def _summary(values) -> str:
    import numpy as np
    v = np.asarray(values, dtype=float)
    return f"min {v.min():,.0f}  mean {v.mean():,.0f}  max {v.max():,.0f}"


def _listing(values, fmt="{:,.0f}", limit=16) -> str:
    shown = ", ".join(fmt.format(v) for v in values[:limit])
    return shown + (f", ... ({len(values) - limit} more)" if len(values) > limit else "")


def run(args: argparse.Namespace) -> int:
    from dta.planning import PACKERS, PlanningError, balance, bin_pack, build_tree

    if args.capacity is None and args.workers is None and not args.input:
        print("dta plan: give --capacity N (packing) and/or --workers W (balancing), or "
              "--input FILE for its sharing breakdown", file=sys.stderr)
        return 2
    try:
        from dta.paths import check_path

        if args.input:  # the user's paths, before anything is read or built
            check_path(args.input, "file", "--input")
        if args.model.endswith(".json"):
            check_path(args.model, "file", "--model")
        if args.method not in PACKERS:
            raise PlanningError(f"unknown method {args.method!r}; choose from {sorted(PACKERS)}")
        records, label = _records(args)
        if not records:
            raise PlanningError(f"empty batch: {label} has no sequences")
        seqs = [r["input_ids"] for r in records]
        masks = None
        if args.art_sharing:
            missing = [i for i, r in enumerate(records) if r.get("loss_mask") is None]
            if missing:
                raise PlanningError(f"--art-sharing needs loss_mask; missing on sequence(s) "
                                    f"{missing[:10]}")
            masks = [r["loss_mask"] for r in records]
        groups = [("seq", i) if r.get("group_id") is None else r["group_id"]
                  for i, r in enumerate(records)]
        t0 = time.perf_counter()
        tree = build_tree(seqs, masks, art_sharing=args.art_sharing, min_shared=args.min_shared)
        build_ms = (time.perf_counter() - t0) * 1e3
        st = tree.stats()
        out = dict(input=label, sequences=st.sequences, total_tokens=st.total_tokens,
                   unique_tokens=st.unique_tokens, sharing_ratio=round(st.sharing_ratio, 4),
                   art_sharing=args.art_sharing, build_ms=round(build_ms, 2))
        print(f"{label}: {st.sequences:,} sequences, {st.total_tokens:,} tokens, "
              f"{st.unique_tokens:,} unique in one tree ({st.sharing_ratio:.2f}x), "
              f"{st.nodes:,} nodes; tree built in {build_ms:.1f} ms")
        out.update(_sharing(args, records, tree))
        plan_ms = 0.0
        if args.capacity is not None:
            p = bin_pack(tree, args.capacity, args.method, groups=groups)
            plan_ms += p.plan_ms
            print(f"packing ({p.method}, capacity {p.capacity:,}): {p.n_bins} bins, lower bound "
                  f"{p.lower_bound} (gap {p.gap:+.1%}), planned in {p.plan_ms:.1f} ms")
            print(f"  bin tokens: {_summary(p.bin_tokens)}; fill "
                  f"{sum(p.bin_tokens) / (p.n_bins * p.capacity):.1%}")
            print(f"  per bin: {_listing(p.bin_tokens)}")
            out.update(capacity=p.capacity, method=p.method, bins=p.n_bins,
                       bin_tokens=p.bin_tokens, lower_bound=p.lower_bound,
                       gap=round(p.gap, 6), pack_plan_ms=round(p.plan_ms, 3),
                       bin_sequences=p.bins)
        if args.workers is not None:
            model = _cost_model(args.model)
            a = balance(tree, args.workers, model)
            plan_ms += a.plan_ms
            print(f"balance over {args.workers} workers (cost: {model.name}, {model.unit}): "
                  f"imbalance {a.imbalance:.4f} (max/mean), {a.duplicated_tokens:,} duplicated "
                  f"tokens, planned in {a.plan_ms:.1f} ms")
            print(f"  worker tokens: {_listing(a.worker_tokens)}")
            print(f"  worker cost:   {_listing(a.worker_cost, '{:.3g}')}")
            out.update(workers=args.workers, cost_model=model.name, cost_unit=a.cost_unit,
                       worker_cost=a.worker_cost, worker_tokens=a.worker_tokens,
                       imbalance=round(a.imbalance, 6), duplicated_tokens=a.duplicated_tokens,
                       balance_plan_ms=round(a.plan_ms, 3), worker_sequences=a.workers)
        if args.memory or args.budget_gib is not None:
            if args.workers is None:
                raise ValueError("--memory needs --workers W")
            out["memory"] = memory_report(args, tree)
        out["plan_ms"] = round(plan_ms, 3)
    except (PlanningError, ValueError, OSError) as e:
        print(f"dta plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        emit_json(out)
    return 0

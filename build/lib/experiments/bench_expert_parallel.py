"""Expert parallelism on CPU: what each rank of an expert-parallel run holds, computes and
sends for one training step (docs/expert-parallel.md).

One global batch: ``--groups`` prompts of ``--prompt`` tokens, each with ``--rollouts``
rollouts of ``--rollout`` tokens (loss on the rollouts), every token's routing replayed
(uniform over the experts: ``dta.model.routing.synthetic_routing``), float32, recompute,
blocks of ``--block`` tokens, on a Qwen3-MoE model (``--model``: the "small" shapes with 8
experts, top-2). For each world W / expert-parallel size E (``--layouts``, default
``1/1 2/2 4/4 4/1``) W gloo ranks train it through the engine core (``runtime.engine``:
each rank walks its data-parallel share, the calls matched by the lockstep), and each rank
reports, for one step:

* ``expert_bytes``: the bytes of its expert weights (its slices);
* ``expert_flops``: the FLOPs of expert computations it ran -- its experts on the rows it
  received, forward and the served backward -- counted by
  ``torch.utils.flop_counter.FlopCounterMode`` around exactly those computations
  (``ExpertSlice.exchange_forward`` / ``exchange_backward``), and ``flops``: all of its
  FLOPs in the step (a separate, counted step);
* ``sent_bytes``: what it sent to the other ranks in the step (expert exchanges, forward,
  backward and served, headers included) and ``routed_rows``: the (token, k) rows it routed
  to their owners (each forward's rows -- re-forwards included -- and each backward's rows
  of output gradient: ``ExpertParallel.routed_rows``);
* ``cpu_s``: the CPU seconds of its process in the (uncounted) step.

E = 1 runs the same code on a group of one (``parallelize_experts`` with a one-rank
``ExpertParallel``: every row to itself). ``4/1`` is data parallelism alone on 4 ranks: the
expert FLOPs per rank fall with the ranks, whatever E; what expert parallelism divides is the
expert weights (and their gradients and optimizer state).

The same is run at a second path length: rollouts of ``--rollout / 2`` tokens, twice as many
(the tokens walked are kept): bytes sent per step, per row routed, then show whether
communication follows the tokens routed or the path.

Checks (``--json``'s ``passed``): at E = 4 (4 ranks) the per-rank expert weights and expert
FLOPs <= 0.30x of E = 1 on one rank; the step's loss equal to E = 1's (float32, relative
1e-5); bytes sent per routed row within 10 % between the two path lengths at every E > 1.

    python -m experiments.bench_expert_parallel [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

TARGET = {4: 0.30}
MODELS = {  # the "small" shapes with 8 routed experts; the tests' tiny one with 4
    "small-moe8": dict(vocab_size=32000, hidden_size=256, intermediate_size=704,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=32768, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=256),
    "tiny-moe4": dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=4096, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32),
}


def _batch(vocab: int, layers: int, k: int, experts: int, groups: int, prompt: int,
           rollout: int, rollouts: int):
    import numpy as np

    from dta.batch import Batch
    from dta.model.routing import synthetic_routing

    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(groups):
        shared = rng.integers(3, vocab, prompt)
        seqs += [np.concatenate([shared, rng.integers(3, vocab, rollout)])
                 for _ in range(rollouts)]
    mask = np.r_[np.zeros(prompt), np.ones(rollout)]
    routed = synthetic_routing(seqs, layers, k, experts, seed=0)
    return Batch.from_records([{"input_ids": s, "loss_mask": mask, "routed_experts": r}
                               for s, r in zip(seqs, routed)])


class _ExpertFlops:
    """FlopCounterMode around each expert computation (a fresh counter per call: entering
    one clears it), summed."""

    def __init__(self):
        self.total = 0

    def __enter__(self):
        from torch.utils.flop_counter import FlopCounterMode

        from dta.model.expert_parallel import ExpertSlice

        self.saved = ExpertSlice.exchange_forward, ExpertSlice.exchange_backward

        def counted(fn):
            def run(*args, **kwargs):
                with FlopCounterMode(display=False) as c:
                    out = fn(*args, **kwargs)
                self.total += c.get_total_flops()
                return out
            return run

        ExpertSlice.exchange_forward, ExpertSlice.exchange_backward = map(counted, self.saved)
        return self

    def __exit__(self, *exc):
        from dta.model.expert_parallel import ExpertSlice

        ExpertSlice.exchange_forward, ExpertSlice.exchange_backward = self.saved


def _rank(group, experts_per_rank: int, model: str, block: int, batches: list[dict]):
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from dta.losses import NLL, batch_totals
    from dta.model.expert_parallel import ExpertParallel, expert_parallel_of, parallelize_experts
    from dta.model.models import build_model
    from dta.options import WalkOptions
    from dta.planning.workers import assign_workers
    from dta.tree import PrefixTree
    from runtime.engine import EngineCore, ParallelLayout, settle

    E, W, rank = experts_per_rank, dist.get_world_size(group), dist.get_rank(group)
    singles = [dist.new_group([r]) for r in range(W)]  # every rank makes every group

    def build(dtype):
        m = build_model("qwen3_moe", MODELS[model], dtype=dtype, seed=0)
        m.config._experts_implementation = "eager"
        if E == 1:  # the same code on a group of one
            parallelize_experts(m, ExpertParallel(singles[rank]))
        return m

    layout = ParallelLayout.make(world=W, expert_parallel=E, rank=rank)
    walk = settle(WalkOptions(policy="recompute", block_tokens=block), layout).walk
    core = EngineCore(build, layout=layout, walk=walk, compute_dtype="float32",
                      make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0)).parallelize()
    ep = expert_parallel_of(core.model)
    out = {"rank": rank, "expert_bytes": sum(p.numel() * p.element_size()
                                             for p in ep.expert_parameters()), "paths": []}
    cfg = core.model.config
    for spec in batches:
        batch = _batch(cfg.vocab_size, cfg.num_hidden_layers, cfg.num_experts_per_tok,
                       cfg.num_experts, **spec)
        ids = assign_workers(PrefixTree(batch.input_ids), W).workers[rank]
        mine, totals = batch.subset(ids) if ids else None, batch_totals(batch)
        tiny = batch.subset([0]) if rank == 0 else None  # what a first backward loads
        core.train_step(tiny, NLL(), totals=batch_totals(batch.subset([0])), max_grad_norm=None)
        with FlopCounterMode(display=False) as counter, _ExpertFlops() as experts:
            core.train_step(mine, NLL(), totals=totals, max_grad_norm=None)
        sent0, rows0 = ep.sent_bytes, ep.routed_rows
        t0, c0 = time.perf_counter(), time.process_time()
        res = core.train_step(mine, NLL(), totals=totals, max_grad_norm=None)
        step_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        loss = torch.tensor([res.loss], dtype=torch.float64)
        dist.all_reduce(loss, group=group)
        out["paths"].append(dict(
            spec, path_tokens=spec["prompt"] + spec["rollout"], flops=counter.get_total_flops(),
            expert_flops=experts.total, sent_bytes=ep.sent_bytes - sent0,
            routed_rows=ep.routed_rows - rows0, step_s=step_s, cpu_s=cpu_s,
            loss=float(loss[0]), tokens=int(np.sum([len(s) for s in batch.input_ids]))))
    return out


def run(layouts: list[tuple[int, int]], model: str, block: int, batches: list[dict]
        ) -> list[dict]:
    from dta.local_ranks import run_group

    return [dict(world=w, expert_parallel=e, ranks=run_group(_rank, w, e, model, block, batches,
                                                             timeout=3600))
            for w, e in layouts]


def _summary(r: dict, base: dict, i: int) -> dict:
    ranks = [x["paths"][i] for x in r["ranks"]]
    b = [x["paths"][i] for x in base["ranks"]]
    rows, sent = sum(x["routed_rows"] for x in ranks), sum(x["sent_bytes"] for x in ranks)
    return dict(world=r["world"], expert_parallel=r["expert_parallel"],
                rollout=ranks[0]["rollout"], path_tokens=ranks[0]["path_tokens"],
                expert_bytes=[x["expert_bytes"] for x in r["ranks"]],
                expert_bytes_ratio=max(x["expert_bytes"] for x in r["ranks"])
                / max(x["expert_bytes"] for x in base["ranks"]),
                expert_flops=[x["expert_flops"] for x in ranks],
                expert_flops_ratio=max(x["expert_flops"] for x in ranks)
                / max(max(x["expert_flops"] for x in b), 1),
                flops=[x["flops"] for x in ranks],
                flops_ratio=max(x["flops"] for x in ranks) / max(max(x["flops"] for x in b), 1),
                sent_bytes=[x["sent_bytes"] for x in ranks],
                routed_rows=[x["routed_rows"] for x in ranks],
                sent_per_row=sent / max(rows, 1), cpu_s=[x["cpu_s"] for x in ranks],
                step_s=[x["step_s"] for x in ranks], loss=ranks[0]["loss"],
                loss_rel_err=abs(ranks[0]["loss"] - b[0]["loss"]) / abs(b[0]["loss"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=["1/1", "2/2", "4/4", "4/1"],
                   help="world/expert-parallel pairs; 1/1 (the baseline) first")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--rollout", type=int, default=512)
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--model", default="small-moe8", choices=sorted(MODELS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    layouts = [tuple(int(x) for x in s.split("/")) for s in args.layouts]
    if layouts[0] != (1, 1):
        raise SystemExit("bench_expert_parallel: --layouts must start with 1/1 (the baseline)")
    long = dict(groups=args.groups, prompt=args.prompt, rollout=args.rollout,
                rollouts=args.rollouts)
    short = dict(long, rollout=args.rollout // 2, rollouts=2 * args.rollouts)
    load = [os.getloadavg()[0]]
    results = run(layouts, model=args.model, block=args.block, batches=[long, short])
    load.append(os.getloadavg()[0])
    out = [_summary(r, results[0], i) for i in (0, 1) for r in results]
    ok, growth = True, {}
    for row in out:
        e = row["expert_parallel"]
        if row["rollout"] == args.rollout and row["world"] == e and e in TARGET:
            ok &= row["expert_bytes_ratio"] <= TARGET[e] and row["expert_flops_ratio"] <= TARGET[e]
        ok &= row["loss_rel_err"] <= 1e-5
    for w, e in layouts:
        if e > 1:
            a, b = (next(r for r in out if (r["world"], r["expert_parallel"]) == (w, e)
                         and r["rollout"] == n) for n in (args.rollout, args.rollout // 2))
            growth[f"{w}/{e}"] = a["sent_per_row"] / b["sent_per_row"]
            ok &= abs(growth[f"{w}/{e}"] - 1) <= 0.10
    print(f"expert parallel, {args.groups} prompts of {args.prompt:,} tokens x {args.rollouts} "
          f"rollouts of {args.rollout:,} (and x {2 * args.rollouts} of {args.rollout // 2:,}), "
          f"{args.model}, float32, recompute, blocks of {args.block:,}; per rank, the most of any:")
    print(f"  {'W/E':>5} {'path':>6} {'expert MiB':>10} {'x 1/1':>6} {'expert GFLOP':>12} "
          f"{'x 1/1':>6} {'GFLOP':>8} {'x 1/1':>6} {'sent MiB':>9} {'B/row':>8} {'CPU s':>6} "
          f"{'loss':>10}")
    for row in out:
        print(f"  {row['world']}/{row['expert_parallel']:<3} {row['path_tokens']:>6,} "
              f"{max(row['expert_bytes']) / 2**20:>10.2f} {row['expert_bytes_ratio']:>6.3f} "
              f"{max(row['expert_flops']) / 1e9:>12.3f} {row['expert_flops_ratio']:>6.3f} "
              f"{max(row['flops']) / 1e9:>8.2f} {row['flops_ratio']:>6.3f} "
              f"{max(row['sent_bytes']) / 2**20:>9.2f} {row['sent_per_row']:>8.1f} "
              f"{max(row['cpu_s']):>6.2f} {row['loss']:>10.6f}")
    print("  bytes sent per routed row, long / short path (same tokens walked): " +
          ", ".join(f"{k}: {v:.3f}" for k, v in growth.items()))
    print(f"  load average (1 min) at the start and the end: {load[0]:.1f}, {load[1]:.1f} "
          f"({os.cpu_count()} CPUs)")
    print(f"{'PASS' if ok else 'FAIL'}: at E=4 per-rank expert weights and expert FLOPs <= "
          "0.30x of 1/1; the loss equal to 1/1's (<= 1e-5); bytes per routed row within 10 % "
          "across path lengths")
    if args.json:
        print(json.dumps(dict(rows=out, sent_per_row_growth=growth, passed=bool(ok),
                              layouts=args.layouts, long=long, short=short, block=args.block,
                              model=args.model, model_config=MODELS[args.model],
                              load_average=load)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

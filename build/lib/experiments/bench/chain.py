"""The N-turn chain: one sequence per agent turn, each a prefix of the next (the loss on each
turn's response). The tree is one path of N nodes, so a node-by-node walk forwards N nodes
over an ever longer cached prefix: the copies of that prefix (concatenating the path's K/V,
``repeat_kv`` for grouped-query heads) are what could grow faster than the FLOPs.

    python -m experiments.bench.chain --turns 15,30,60 --out results/bench-<date>-chain

Per turn count and mode (interleaved, ``--repeats`` rounds, one process, 2 threads): step
time, and, in one extra profiled step at the largest turn count, the *copy share*: self CPU
time of copy kernels (cat, copy_, clone, index_select, expand materialization) over all self
CPU time. Modes: ``dfs-node-before`` (one call per node, the path's K/V concatenated into a
``DynamicCache`` -- copied there once more and again when the forward appends -- and HF's SDPA
path, which ``repeat_kv``-copies the prefix for grouped-query heads: the walk before packs),
``dfs-node`` (one call per node, the path's pieces joined once inside the cache, SDPA native
GQA), ``dfs-packed`` (packs: the cost model's choice, batched head). The growth figure compares t(N) / t(N_min) with the FLOPs
of the micro-batch baseline (every turn trained on its own) and of DFS over the same N.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

COPY_OPS = ("aten::cat", "aten::copy_", "aten::clone", "aten::index_select", "aten::_to_copy",
            "aten::contiguous", "aten::expand_copy")
MODES = {"dfs-node-before": dict(packing="node", head_rows=0, native_gqa=False, hf_cache=True),
         "dfs-node": dict(packing="node", head_rows=0),
         "dfs-packed": dict(packing="auto")}


def chain_batch(turns: int, *, prompt: int = 256, turn: int = 48, vocab: int = 32000, seed: int = 0):
    """``turns`` sequences: prompt + turn segments 1..k; loss on the last segment of each."""
    from dta.batch import Batch

    rng = np.random.default_rng(seed)
    full = rng.integers(3, vocab, prompt + turns * turn)
    recs = []
    for k in range(1, turns + 1):
        n = prompt + k * turn
        mask = np.zeros(n)
        mask[n - turn:] = 1
        recs.append(dict(input_ids=full[:n], loss_mask=mask, advantages=rng.normal(size=n),
                         logprobs=-rng.random(n) * 5))
    return Batch.from_records(recs)


def _hf_cache_walker():
    import torch

    from dta.walk import Walker

    class HFCacheWalker(Walker):
        """Node by node through the model interface's own cache (``DynamicCache`` built from
        the concatenated path): the copies the walk made before ``dta.model.attention.path_cache``."""

        def _forward(self, tree, layout, path, routes, capture=False, tape=None):
            # no tape: a re-forward attends over the path again, as the walk did then
            if len(layout.tree_nodes) != 1:
                raise ValueError("HFCacheWalker walks node by node (packing='node')")
            if routes.routed is not None or capture:
                raise ValueError("HFCacheWalker neither replays routing nor reads routers")
            ids = torch.as_tensor(tree.tokens(int(layout.tree_nodes[0])), device=self.device)
            return (*self.io.forward(ids, layout.prefix, [f.state for f in path]), None)

    return HFCacheWalker


def _step(model, batch, loss, kw):
    from dta.objective import Objective
    from dta.tree import PrefixTree
    from dta.walk import Walker

    kw = dict(kw)
    cls = _hf_cache_walker() if kw.pop("hf_cache", False) else Walker
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    walker = cls(model, **kw)
    res = walker.train(PrefixTree(batch.input_ids), Objective(batch, loss, "token_mean"))
    return time.perf_counter() - t, res.calls()


def copy_share(model, batch, loss, kw) -> dict:
    from experiments.bench.profile import self_times

    model.zero_grad(set_to_none=True)
    _, self_us = self_times(lambda: _step(model, batch, loss, kw))
    total = sum(self_us.values())
    copies = {k: v for k, v in self_us.items() if k in COPY_OPS}
    return dict(copy_share=sum(copies.values()) / total if total else None,
                copy_ms={k: v / 1e3 for k, v in copies.items()}, total_ms=total / 1e3)


def main(argv=None) -> int:
    import torch

    from dta.losses import make_loss
    from dta.model.models import build_model
    from experiments.bench.flops import summary

    ap = argparse.ArgumentParser(prog="python -m experiments.bench.chain")
    ap.add_argument("--turns", default="15,30,60")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-size", default="small")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    turns = [int(x) for x in args.turns.split(",")]
    model = build_model("qwen3", args.model_size)
    loss = make_loss("ppo")
    batches = {n: chain_batch(n, vocab=model.config.vocab_size) for n in turns}
    for n, b in batches.items():  # warm-up
        _step(model, b, loss, MODES["dfs-packed"])
        break
    from tqdm import tqdm

    times: dict = {n: {m: [] for m in MODES} for n in turns}
    calls: dict = {n: {} for n in turns}
    import resource

    from experiments.bench.worker import cpu_times, disturbance

    cpu0, ru0, t0 = cpu_times(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with tqdm(total=args.repeats * len(turns) * len(MODES), desc="chain", unit="step") as bar:
        for _ in range(args.repeats):
            for n in turns:
                for m, kw in MODES.items():
                    bar.set_postfix_str(f"{n} turns {m}")
                    dt, c = _step(model, batches[n], loss, kw)
                    times[n][m].append(dt)
                    calls[n][m] = c
                    bar.update(1)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    disturbed = disturbance(cpu0, cpu_times(), ru1.ru_utime - ru0.ru_utime + ru1.ru_stime
                            - ru0.ru_stime, time.perf_counter() - t0)
    fl = {n: summary(batches[n], model.config, ["microbatch", "dfs-node", "dfs-retain"])
          for n in turns}
    big = max(turns)
    shares = {m: copy_share(model, batches[big], loss, kw) for m, kw in MODES.items()}
    lo = min(turns)
    rows = []
    for n in turns:
        med = {m: statistics.median(v) for m, v in times[n].items()}
        rows.append(dict(turns=n, tokens=int(batches[n].lengths.sum()),
                         unique_tokens=int(batches[n].lengths.max()), step_s=med,
                         step_s_all=times[n], calls=calls[n],
                         flops_microbatch=fl[n]["flops"]["microbatch"],
                         flops_dfs=fl[n]["flops"]["dfs-node"], ideal_speedup=fl[n]["ideal_speedup"]))
    base = rows[0]
    for r in rows:
        r["growth"] = {m: r["step_s"][m] / base["step_s"][m] for m in MODES}
        r["growth_flops_microbatch"] = r["flops_microbatch"] / base["flops_microbatch"]
        r["growth_flops_dfs"] = r["flops_dfs"] / base["flops_dfs"]
    out = dict(date=time.strftime("%Y-%m-%d"), model=f"qwen3-{args.model_size}",
               threads=args.threads, repeats=args.repeats, rows=rows,
               copy_share_at=big, copy=shares, base_turns=lo, disturbance=disturbed)
    dest = Path(args.out or f"results/bench-{time.strftime('%Y-%m-%d')}-chain")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "results.json").write_text(json.dumps(out, indent=1))
    (dest / "results.md").write_text(markdown(out))
    plot(out, dest / "chain.png")
    print(json.dumps(dict(out, rows=[{k: v for k, v in r.items() if k != "step_s_all"}
                                     for r in rows])) if args.json else markdown(out))
    return 0


def plot(out: dict, path: Path) -> None:
    """Step time per turn count and mode (linear axes, values shown), with the time the first
    point's step would take if it grew as the micro-batch baseline's FLOPs and as DFS's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    x = [r["turns"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in MODES:
        y = [r["step_s"][m] for r in rows]
        ax.plot(x, y, marker="o", label=m)
        for xi, yi in zip(x, y):
            ax.annotate(f"{yi:.2f}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    t0 = rows[0]["step_s"]["dfs-packed"]
    for key, style, name in (("growth_flops_microbatch", ":", "micro-batch FLOPs"),
                             ("growth_flops_dfs", "--", "DFS FLOPs")):
        ax.plot(x, [t0 * r[key] for r in rows], style, color="gray",
                label=f"dfs-packed at {rows[0]['turns']} turns × growth of {name}")
    ax.set_xlabel("turns (sequences; each a prefix of the next)")
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"N-turn chain: step time ({out['date']}, {out['model']}, {out['threads']} threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(out: dict) -> str:
    lines = [f"# {max(r['turns'] for r in out['rows'])}-turn chain ({out['date']}, "
             f"{out['model']}, fp32, {out['threads']} threads, {out['repeats']} rounds, medians)",
             "", "| turns | tokens | unique | " + " | ".join(f"{m} s" for m in MODES)
             + " | growth " + " / ".join(MODES) + " | growth FLOPs microbatch | growth FLOPs DFS |",
             "|---:|---:|---:|" + "---:|" * len(MODES) + "---|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {r['turns']} | {r['tokens']:,} | {r['unique_tokens']:,} | "
                     + " | ".join(f"{r['step_s'][m]:.2f}" for m in MODES) + " | "
                     + " / ".join(f"{r['growth'][m]:.2f}" for m in MODES)
                     + f" | {r['growth_flops_microbatch']:.2f} | {r['growth_flops_dfs']:.2f} |")
    d = out.get("disturbance") or {}
    if d.get("others_cores") is not None:
        lines += ["", f"Disturbance over the timed steps (cores on average, beside the "
                      f"bench's own {out['threads']} threads): other processes "
                      f"{d['others_cores']:.2f}, the host's steal {d['steal_cores']:.2f}."]
    lines += ["", f"Copy share of the step at {out['copy_share_at']} turns (self CPU time of "
              "copy kernels / all self CPU time, one profiled step):", ""]
    for m, c in out["copy"].items():
        lines.append(f"- {m}: {c['copy_share']:.1%} ("
                     + ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(c["copy_ms"].items()))
                     + f"; total {c['total_ms']:.0f} ms)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

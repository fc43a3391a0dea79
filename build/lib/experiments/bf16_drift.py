"""bf16 drift: does DFS training in bf16 drift from standard (micro-batched) bf16 training more
than standard training drifts from itself?

A tiny model, one initialization, three bf16 runs of ``--steps`` on-policy GRPO steps on the
same batches (groups of completions sharing a prompt; per group, rewards normalized into
advantages; the per-token loss -A·log π, which is GRPO's clipped surrogate at ratio 1, the
first epoch of on-policy data), each followed by one AdamW step:

  dfs      the gradient by one DFS walk (``dta.train.accumulate_gradients``)
  micro    one sequence at a time in batch order (``dta.reference.unpacked_gradients``):
           standard training's micro-batches
  shuffled the same micro-batches in a shuffled order: another reduction order, the noise
           floor of bf16 training itself

After every step, on a held batch: the mean |Δ log-prob| of dfs vs micro (the drift) and of
shuffled vs micro (the noise floor), and the parameter distance ||θ_a − θ_micro|| / ||θ_micro||
of both. The claim (``--claim``, default 2): after the last step the drift is at most that
many times the noise floor, on both measures. Writes ``drift.json`` and ``drift.png`` into
the results folder and prints one JSON line.

    python -m experiments.bf16_drift --steps 50 --json [--out results/bf16-drift]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from datetime import datetime, timezone

import numpy as np
import torch

from dta.batch import Batch
from dta.losses import TokenLoss
from dta.model.models import build_model
from dta.records.jsonl import json_safe
from dta.reference import sequence_logprobs, unpacked_gradients
from dta.train import accumulate_gradients

RUNS = ("dfs", "micro", "shuffled")


class OnPolicyGRPO(TokenLoss):
    """GRPO's per-token loss at ratio 1 (on-policy, first epoch): -advantage · log π."""

    fields = ("advantages",)

    def values(self, logp, entropy, fields):
        return -fields["advantages"] * logp


def grpo_batch(step: int, vocab: int, groups: int, samples: int, prompt: int, seed: int) -> Batch:
    """Step ``step``'s batch: ``groups`` prompts of ``prompt`` tokens, ``samples`` completions
    each (8..32 tokens; a shared first token in half of them: a deeper tree), random rewards
    normalized per group into advantages on the completion tokens."""
    rng = np.random.default_rng([seed, step])
    records = []
    for _ in range(groups):
        p = rng.integers(3, vocab, prompt)
        first = rng.integers(3, vocab, 1)
        rewards = rng.normal(size=samples)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for s in range(samples):
            c = rng.integers(3, vocab, int(rng.integers(8, 33)))
            if s % 2:
                c[0] = first[0]
            ids = np.concatenate([p, c])
            a = np.r_[np.zeros(prompt), np.full(len(c), adv[s])]
            records.append({"input_ids": ids, "advantages": a, "loss_mask": (a != 0).astype(np.float64)})
    return Batch.from_records(records)


def held_logprobs(model, held: list[np.ndarray]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([sequence_logprobs(model, s)[0].double()[1:] for s in held])


def param_vector(model) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def run(steps: int = 50, family: str = "qwen3", size: str = "tiny", groups: int = 4,
        samples: int = 4, prompt: int = 24, lr: float = 1e-3, seed: int = 0,
        claim: float = 2.0, progress=None) -> dict:
    """The three runs (module doc); returns the per-step series and the verdict."""
    base = build_model(family, size, dtype="bfloat16", seed=seed)
    vocab = int(base.config.vocab_size)
    models = {r: base if r == "dfs" else _clone(base) for r in RUNS}
    opts = {r: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
            for r, m in models.items()}
    rng = np.random.default_rng([seed, 1 << 20])
    held = [np.concatenate([rng.integers(3, vocab, prompt), rng.integers(3, vocab, 24)])
            for _ in range(8)]
    loss = OnPolicyGRPO()
    series = {k: [] for k in ("drift_logprob", "floor_logprob", "drift_param", "floor_param")}
    t0 = time.perf_counter()
    for step in range(steps):
        batch = grpo_batch(step, vocab, groups, samples, prompt, seed)
        order = np.random.default_rng([seed, step, 7]).permutation(len(batch.input_ids))
        shuffled = Batch.from_records([{k: v for k, v in rec.items()} for rec in
                                       (_record(batch, int(i)) for i in order)])
        for r, m in models.items():
            m.zero_grad(set_to_none=True)
            if r == "dfs":
                accumulate_gradients(m, batch, loss)
            else:
                unpacked_gradients(m, shuffled if r == "shuffled" else batch, loss)
            opts[r].step()
        lp = {r: held_logprobs(m, held) for r, m in models.items()}
        th = {r: param_vector(m) for r, m in models.items()}
        series["drift_logprob"].append(float((lp["dfs"] - lp["micro"]).abs().mean()))
        series["floor_logprob"].append(float((lp["shuffled"] - lp["micro"]).abs().mean()))
        norm = float(th["micro"].norm())
        series["drift_param"].append(float((th["dfs"] - th["micro"]).norm()) / norm)
        series["floor_param"].append(float((th["shuffled"] - th["micro"]).norm()) / norm)
        if progress:
            progress(step, {k: v[-1] for k, v in series.items()})
    ratio = {"logprob": _ratio(series["drift_logprob"][-1], series["floor_logprob"][-1]),
             "param": _ratio(series["drift_param"][-1], series["floor_param"][-1])}
    passed = all(math.isfinite(v) and v <= claim for v in ratio.values())
    return dict(family=family, size=size, dtype="bfloat16", steps=steps, groups=groups,
                samples=samples, prompt=prompt, lr=lr, seed=seed,
                parameters=sum(p.numel() for p in base.parameters()),
                final={k: v[-1] for k, v in series.items()} if steps else {},
                ratio=ratio, claim=claim, passed=passed, seconds=time.perf_counter() - t0,
                series=series)


def _ratio(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b if b > 0 else (1.0 if a == 0 else math.inf)


def _clone(model):
    import copy

    return copy.deepcopy(model)


def _record(batch: Batch, i: int) -> dict:
    rec = {"input_ids": batch.input_ids[i]}
    for k, v in batch.fields.items():
        rec[k] = v[i]
    return rec


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["series"]
    x = np.arange(1, len(s["drift_logprob"]) + 1)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "logprob", "mean |Δ log-prob| on a held batch"),
                           (axes[1], "param", "parameter distance ||θ − θ_micro|| / ||θ_micro||")):
        ax.plot(x, s[f"drift_{key}"], label="DFS vs micro-batches")
        ax.plot(x, s[f"floor_{key}"], label="micro vs shuffled micro (noise floor)")
        ax.set_xlabel("GRPO step")
        ax.set_title(title, fontsize=10)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"bf16 drift, {result['family']}/{result['size']}: ratios after "
                 f"{result['steps']} steps {result['ratio']['logprob']:.2f} (log-prob), "
                 f"{result['ratio']['param']:.2f} (params); claim <= {result['claim']:g}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.bf16_drift", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--family", default="qwen3")
    p.add_argument("--size", default="tiny")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--claim", type=float, default=2.0,
                   help="the largest drift / noise-floor ratio accepted after the last step")
    p.add_argument("--out", default=None, help="results folder (default results/bf16-drift-<date>)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = p.parse_args(argv)
    for name in ("steps", "groups", "samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0 or not args.claim > 0:
        p.error("--lr and --claim must be > 0")
    out = args.out or os.path.join(
        "results", "bf16-drift-" + datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)

    def progress(step, last):
        print(f"step {step + 1:3d}: " + ", ".join(f"{k} {v:.3e}" for k, v in last.items()),
              flush=True)

    res = run(steps=args.steps, family=args.family, size=args.size, groups=args.groups,
              samples=args.samples, lr=args.lr, seed=args.seed, claim=args.claim,
              progress=progress)
    res["out"] = out
    with open(os.path.join(out, "drift.json"), "w") as f:
        json.dump(json_safe(res), f, indent=1)
    plot(res, os.path.join(out, "drift.png"))
    print(f"{'PASS' if res['passed'] else 'FAIL'}: after {res['steps']} steps drift / noise floor "
          f"{res['ratio']['logprob']:.2f} (log-prob), {res['ratio']['param']:.2f} (params); claim "
          f"<= {res['claim']:g}; {out}/drift.png")
    if args.json:
        print(json.dumps(json_safe({k: v for k, v in res.items() if k != "series"})))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

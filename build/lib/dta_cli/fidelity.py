"""`dta verify --dtype bfloat16 --against float64`: DFS and per-sequence training in a low
dtype, each against per-sequence training in float64 (dta/fidelity.py)."""
from __future__ import annotations

from dta_cli.common import emit_json

AGAINST = ("float64", "float32")


def add_arguments(p) -> None:
    p.add_argument("--against", default=None, choices=AGAINST,
                   help="fidelity instead of exactness: train in --dtype by DFS and one sequence "
                        "at a time, and report each one's error against per-sequence training "
                        "in this dtype (log-probs, loss, gradients: relative L2 and max) and "
                        "their ratio; exit 1 when DFS's log-prob or gradient error exceeds "
                        "--claim x per-sequence training's (dta/fidelity.py)")
    p.add_argument("--claim", type=float, default=None,
                   help="with --against: the largest DFS / per-sequence error ratio accepted "
                        "(default 1.5)")


def run(args, model, batch, loss, walk) -> int:
    """The fidelity report of ``dta verify`` (``walk``: the DFS side's WalkOptions)."""
    import torch

    from dta.fidelity import CLAIM, fidelity
    from dta.model.models import resolve_dtype

    low, high = resolve_dtype(args.dtype), resolve_dtype(args.against)
    if low.itemsize >= high.itemsize:
        raise SystemExit(f"dta verify: --against {args.against} must be a wider dtype than "
                         f"--dtype {args.dtype}")
    if args.claim is not None and not args.claim > 0:
        raise SystemExit(f"dta verify: --claim must be > 0, got {args.claim}")
    claim = CLAIM if args.claim is None else args.claim
    r = fidelity(model, batch, loss, dtype=low, against=high, reduction=args.reduction,
                 options=walk)
    ok = r.passed(claim)
    print(f"fidelity: {r.dtype} against per-sequence {r.against} (the {r.dtype} weights cast up), "
          f"{r.sequences} sequences, {r.tokens:,} tokens, {r.parameters:,} parameters, policy "
          f"{walk.policy}")
    print(f"  {'error':18s} {'DFS':>10s} {'per-seq':>10s} {'ratio':>7s}")
    for k in r.ratio:
        print(f"  {k:18s} {getattr(r.dfs, k):10.3e} {getattr(r.per_sequence, k):10.3e} "
              f"{r.ratio[k]:7.2f}")
    print(f"{'PASS' if ok else 'FAIL'}: DFS / per-sequence error on log-probs and gradients "
          f"(relative L2) {r.worst_ratio():.2f} (claim <= {claim:g})")
    if args.json:
        model_info = {} if args.model_path else {"family": args.family, "matrix": bool(args.matrix)}
        emit_json({**r.as_dict(), **model_info, "claim": claim, "passed": ok,
                   "torch": torch.__version__})
    return 0 if ok else 1

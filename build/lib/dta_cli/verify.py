"""`dta verify`: train one batch by DFS and one sequence at a time, report relative errors."""
from __future__ import annotations

from dta_cli.common import add_model_arguments, add_workload_arguments, emit_json

# the walk settings `dta verify` takes, as its flags (dta.options.WalkOptions field -> flag)
FLAGS = {"policy": "--policy", "packing": "--packing", "pack_tokens": "--pack-tokens",
         "block_tokens": "--block-tokens", "router_aux_loss": "--router-aux-loss"}


def _aux_loss(value: str):
    """--router-aux-loss: a coefficient, or refuse / exclude (validated by WalkOptions)."""
    try:
        return float(value)
    except ValueError:
        return value


def add_arguments(p) -> None:
    import argparse

    from dta.options import PACKINGS, POLICIES, WalkOptions

    walk = WalkOptions()  # the defaults (dta/options.py)
    add_model_arguments(p)
    p.add_argument("--matrix", action=argparse.BooleanOptionalAction, default=True,
                   help="with --family: the family's tested configuration (dta/model/families.py: a "
                        "sliding window of 8 where the family has one, logit scaling, "
                        "soft-capping, experts ...); --no-matrix: the family's plain config")
    add_workload_arguments(p)
    p.add_argument("--loss", default="ppo", choices=["nll", "ppo", "ppo-decoupled"])
    p.add_argument("--reduction", default="token_mean", choices=["token_mean", "seq_mean", "sum"])
    p.add_argument("--policy", default=walk.policy, choices=list(POLICIES),
                   help=f"the DFS side's memory policy (default: {walk.policy})")
    p.add_argument("--packing", default=walk.packing, choices=list(PACKINGS),
                   help=f"the DFS side's pack policy (dta/planning/packs.py; default: "
                        f"{walk.packing}; auto: the cost model's plan)")
    p.add_argument("--pack-tokens", type=int, default=None,
                   help="the cap of a pack in tokens (default: the walker's, by memory policy: "
                        "dta.planning.packs.default_cap)")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="the longest piece of a node the DFS side forwards in one call "
                        f"(dta/planning/blocks.py; default: the walker's, {walk.block_tokens:,}; "
                        "0: no cut)")
    p.add_argument("--max-sequences", type=int, default=None,
                   help="verify only the first N sequences (the unpacked side is slow)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="exit 1 when max relative error exceeds it (default: 1e-10 for "
                        "float64, 1e-4 for float32)")
    moe = p.add_argument_group("MoE (docs/moe.md)")
    moe.add_argument("--router-aux-loss", type=_aux_loss, default=walk.router_aux_loss,
                     metavar="COEF|refuse|exclude",
                     help="COEF > 0: add each sequence's router load-balancing loss times COEF "
                          "on both sides; refuse (default) / exclude: off, refusing / training "
                          "without it a model config that asks for it (docs/moe.md)")
    moe.add_argument("--replay", action="store_true",
                     help="replay synthesized routings (random experts per token and MoE "
                          "layer, the same on a shared prefix) on both sides, unless the "
                          "input records bring their own routed_experts")
    lora = p.add_argument_group("LoRA (the optional lora extra: peft)")
    lora.add_argument("--lora", type=int, default=0, metavar="R",
                      help="verify the model wrapped with rank-R LoRA adapters (base frozen; "
                           "A and B random, so every adapter gradient is nonzero)")
    lora.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj",
                      help="comma-separated modules to adapt (peft target_modules; lm_head "
                           "allowed; 'all-linear': every linear layer but the head)")
    lora.add_argument("--lora-alpha", type=float, default=None, help="default: 2 R")
    lora.add_argument("--rslora", action="store_true", help="rsLoRA scale alpha / sqrt(R)")
    p.add_argument("--context-parallel", type=int, default=1, metavar="C",
                   help="walk the DFS side on C local gloo ranks (CPU) that store the path's "
                        "K/V spread over the group (docs/context-parallel.md; default 1)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="E",
                   help="divide the DFS side's MoE experts over the context-parallel group of "
                        "E ranks (1/E of every MoE layer's experts each, routed rows "
                        "exchanged; --context-parallel defaults to E and must equal it; "
                        "docs/expert-parallel.md; default 1)")
    from dta_cli import fidelity

    fidelity.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args) -> int:
    import numpy as np

    from dta.batch import Batch
    from dta.losses import NLL, PPO
    from dta.options import WalkOptionError, WalkOptions
    from dta.train import forward_logprobs
    from dta.verify import verify
    from dta_cli.common import check_input_paths, load_records, make_model
    from dta_cli.context_parallel import check_size, verify_on_group

    check_size(args.context_parallel)  # before anything is built
    check_size(args.expert_parallel, "--expert-parallel")
    if args.expert_parallel > 1:
        if args.context_parallel == 1:
            args.context_parallel = args.expert_parallel
        if args.context_parallel != args.expert_parallel:
            raise SystemExit(f"dta verify: --expert-parallel {args.expert_parallel} divides the "
                             "experts over the context-parallel group that walks the batch: "
                             f"--context-parallel must be {args.expert_parallel} (or unset), "
                             f"not {args.context_parallel}")
    check_input_paths(args)
    given = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in FLAGS.items()}
    if given["block_tokens"] is None:
        del given["block_tokens"]  # the walker's default
    try:  # the DFS side's walk settings, before anything is built
        walk = WalkOptions.make(FLAGS, **given)
    except WalkOptionError as e:
        raise SystemExit(f"dta verify: {e}") from None
    model = make_model(args)
    if args.lora:
        from dta.model.lora import apply_lora

        targets = args.lora_targets if args.lora_targets == "all-linear" else \
            [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        model = apply_lora(model, r=args.lora, alpha=args.lora_alpha or 2.0 * args.lora,
                           target_modules=targets, rslora=args.rslora, init_lora_weights=False)
        if str(next(model.parameters()).dtype) == "torch.float64":
            # the check runs truly float64 anyway (dta.verify); the self-check of the behaviour
            # log-probs below would otherwise see HF's float32 norms against small adapter
            # gradients (1e-6 on Gemma 2 / Qwen3-Next, 1e-14 once truly float64)
            from dta.model.models import make_truly_float64

            make_truly_float64(model)
    records = load_records(args, model.config.vocab_size)
    if args.max_sequences:
        records = records[: args.max_sequences]
    batch = Batch.from_records(records)
    if args.replay and batch.routed_experts is None:
        from dta.model.routing import MoERouters, RoutingError, synthetic_routing

        routers = MoERouters(model)
        try:
            routers.require("--replay")
        except RoutingError as e:
            raise SystemExit(f"dta verify: {e}") from None
        batch.routed_experts = synthetic_routing(batch.input_ids, routers.layers, routers.top_k,
                                                 routers.num_experts, seed=args.seed)
    loss = {"nll": NLL(), "ppo": PPO(eps_clip=0.2, dual_clip=3.0),
            "ppo-decoupled": PPO(eps_clip=0.2, decoupled=True, behav_imp_weight_cap=5.0)}[args.loss]
    if args.loss != "nll":
        # Behaviour log-probs near the model's own (so ratios straddle the clip range)
        # unless the input brought them; advantages default to 1 where absent.
        lp = forward_logprobs(model, batch).logprobs
        rng = np.random.default_rng(args.seed)
        if "old_logprobs" not in batch.fields:
            batch.fields["old_logprobs"] = [np.minimum(l.double().numpy() + rng.normal(0, 0.1, len(l)), 0.0)
                                            for l in lp]
        if "prox_logprobs" not in batch.fields:
            batch.fields["prox_logprobs"] = [np.minimum(o + rng.normal(0, 0.05, len(o)), 0.0)
                                             for o in batch.fields["old_logprobs"]]
        if "advantages" not in batch.fields:
            batch.fields["advantages"] = [np.ones(len(s)) for s in batch.input_ids]
    if args.context_parallel > 1:  # the DFS side on a group of gloo ranks
        verify = verify_on_group(args.context_parallel, experts=args.expert_parallel > 1)
    if args.against:  # bf16 fidelity against the float64 truth (dta/fidelity.py)
        from dta_cli import fidelity

        return fidelity.run(args, model, batch, loss, walk)
    report = verify(model, batch, loss, reduction=args.reduction, progress=True, options=walk)
    tol = args.tolerance or (1e-10 if report.dtype == "float64" else 1e-4)
    ok = report.passed(tol)  # NaN/inf anywhere: a failure
    d = report.as_dict()
    print(f"model {args.model_path or args.family + '/' + args.size} ({report.parameters:,} params, "
          f"{report.dtype}{', norms kept in float64' if report.truly_float64 else ''}), "
          f"policy {report.policy}, loss {args.loss}, reduction {report.reduction}, packing "
          f"{report.packing} (cap {report.pack_tokens}: {report.packs} packs for {report.nodes} nodes), "
          f"blocks {report.block_tokens or 'none'} ({report.blocks_cut} pieces added)")
    if not args.model_path and args.matrix:
        from dta.model.families import FAMILIES

        feats = ", ".join(FAMILIES[args.family].features) or "plain"
        print(f"tested configuration of {args.family}: {feats} (dta/model/families.py)")
    print(f"batch: {report.sequences} sequences, {report.total_tokens:,} tokens, "
          f"{report.unique_tokens:,} unique (sharing {report.sharing_ratio:.2f}x), tree depth {report.tree_depth}")
    coef = walk.router_aux_coef
    if args.replay or coef or batch.routed_experts is not None:
        print(f"MoE: routing {'replayed' if batch.routed_experts is not None else 'chosen by the router'}"
              f", router aux loss coefficient {coef:g}")
    if args.lora:
        print(f"LoRA r={args.lora} on {args.lora_targets}{' (rsLoRA)' if args.rslora else ''}: "
              f"{report.trainable_parameters:,} trainable parameters; frozen parameters with a "
              f"gradient: {report.frozen_with_grad}")
    for key in ("logprobs", "loss", "grad", "params", "update"):
        print(f"  max relative error {key:9s} {d[key + '_rel_err']:.3e}")
    print(f"  (the AdamW step used eps {report.adam_eps:g}; see dta/verify.py)")
    print(f"{'PASS' if ok else 'FAIL'}: max relative error {report.max_rel_err():.3e} (tolerance {tol:g})")
    if args.json:
        model_info = {} if args.model_path else {"family": args.family, "matrix": bool(args.matrix)}
        model_info.update(replay=batch.routed_experts is not None,
                          router_aux_loss_coef=walk.router_aux_coef)
        if args.lora:
            model_info.update(lora_r=args.lora, lora_targets=args.lora_targets,
                              rslora=bool(args.rslora))
        emit_json({**d, **model_info, "tolerance": tol, "passed": ok})
    return 0 if ok else 1

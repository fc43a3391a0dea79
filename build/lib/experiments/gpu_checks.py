"""The correctness checks of ``experiments/bench/gpu.sh``, on one device (``cpu``: its dry run).

  attention   the split attention through every kernel backend of the device's table
              (``dta.model.attention_kernels``: auto, torch, flash_attn when installed), chain
              and tree packs, bf16 and float32 (float64 and float32 on CPU): output and
              dq/dk/dv against one masked SDPA call (the reference's dense mask is built here
              on purpose)
  verify      ``dta.verify.verify`` in float32 on each model: DFS vs one sequence at a time
              (max relative error <= 1e-4; TF32 off)
  fidelity    ``dta.fidelity.fidelity`` bf16 against float64 on each model: DFS's error /
              per-sequence training's on log-probs and gradients <= 1.5
  gdn_kernel  on a hybrid model, the self-check's comparison of the device's GDN kernel
              (flash-linear-attention) with the pure-torch pack path (absent: recorded)
  dense_path_masks  dense masks over cached keys built during the walks above (must be 0)

Models: ``--families`` (default qwen3 and qwen3_5) at ``--size`` (random init). A check that
raises is recorded as failed with its error, never dropped. Writes ``checks.json`` into
``--out`` and prints one JSON line.

    python -m experiments.gpu_checks --device cuda --size qwen3-0.6b --out DIR --json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import numpy as np
import torch

from dta.records.jsonl import json_safe

F = torch.nn.functional


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.nan
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def attention_check(device: str, dtypes, T: int = 256, past: int = 1024, heads: int = 16,
                    kv: int = 8, dim: int = 128) -> list[dict]:
    from dta.model import attention_kernels as ak
    from dta.model.split_attention import Split, split_attention

    backends = ["auto", "torch"]
    try:
        import flash_attn  # noqa: F401
        backends.append("flash_attn")
    except ImportError:
        pass
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in dtypes:
        tol = 3e-2 if dtype in (torch.bfloat16, torch.float16) else (
            1e-10 if dtype == torch.float64 else 1e-4)
        for tree in (False, True):
            own = torch.ones(T, T, dtype=torch.bool).tril()
            if tree:  # three branches below a root piece
                own[T // 2:, T // 4:T // 2] = False
            own = own.to(device)
            mask = torch.cat([torch.ones(T, past, dtype=torch.bool, device=device), own], 1)[None, None]
            q = torch.randn(1, heads, T, dim, generator=g).to(device, dtype).requires_grad_()
            k = torch.randn(1, kv, past + T, dim, generator=g).to(device, dtype).requires_grad_()
            v = torch.randn(1, kv, past + T, dim, generator=g).to(device, dtype).requires_grad_()
            dout = torch.randn(1, heads, T, dim, generator=g).to(device, dtype)
            ref = None
            qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)
            o.backward(dout.double())
            ref = [o.detach(), qd.grad, kd.grad, vd.grad]
            for backend in backends:
                row = dict(dtype=str(dtype).replace("torch.", ""), mask="tree" if tree else "causal",
                           backend=backend, tolerance=tol)
                try:
                    kern = ak.kernels_of(q, tree, backend)
                    row["kernels"] = None if kern is None else [x.name for x in kern]
                    q.grad = k.grad = v.grad = None
                    out = split_attention(q, k, v, Split(past, own if tree else None), None,
                                          backend=backend)
                    if out is None:
                        row.update(ok=False, error="no kernel row")
                    else:
                        out.backward(dout)
                        errs = [_rel(a, b) for a, b in zip([out, q.grad, k.grad, v.grad], ref)]
                        row.update(out=errs[0], dq=errs[1], dk=errs[2], dv=errs[3],
                                   ok=all(e <= tol for e in errs))
                except Exception as e:  # recorded, never dropped
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                rows.append(row)
    return rows


def make_batch(vocab: int, groups: int, samples: int, prompt: int, completion: tuple, seed: int = 0):
    from dta.batch import Batch

    rng = np.random.default_rng(seed)
    records = []
    for _ in range(groups):
        p = rng.integers(3, vocab, prompt)
        for s in range(samples):
            c = rng.integers(3, vocab, int(rng.integers(*completion)))
            records.append({"input_ids": np.concatenate([p, c]),
                            "loss_mask": np.r_[np.zeros(prompt), np.ones(len(c))],
                            "advantages": np.full(prompt + len(c), rng.normal())})
    return Batch.from_records(records)


def _with_old_logprobs(model, batch, seed: int = 0):
    from dta.train import forward_logprobs

    rng = np.random.default_rng(seed)
    lp = forward_logprobs(model, batch).logprobs
    batch.fields["old_logprobs"] = [np.minimum(x.double().cpu().numpy() + rng.normal(0, 0.1, len(x)), 0.0)
                                    for x in lp]
    return batch


def model_checks(family: str, size: str, device: str, batch_kw: dict) -> dict:
    from dta.fidelity import fidelity
    from dta.losses import PPO
    from dta.model.models import build_model
    from dta.model.recurrent import is_hybrid
    from dta.selfcheck import self_check
    from dta.verify import verify

    out = dict(family=family, size=size)
    loss = PPO(eps_clip=0.2, dual_clip=3.0)
    try:
        model = build_model(family, size, dtype="float32", seed=0).to(device)
        batch = _with_old_logprobs(model, make_batch(int(model.config.vocab_size), **batch_kw))
        out["tokens"] = int(sum(len(s) for s in batch.input_ids))
        t = time.perf_counter()
        r = verify(model, batch, loss)
        out["verify_float32"] = dict(max_rel_err=r.max_rel_err(), passed=r.passed(1e-4),
                                     seconds=time.perf_counter() - t)
        t = time.perf_counter()
        f = fidelity(model, batch, loss)
        out["fidelity_bf16"] = dict(dfs=vars(f.dfs), per_sequence=vars(f.per_sequence),
                                    ratio=f.ratio, passed=f.passed(),
                                    seconds=time.perf_counter() - t)
        if is_hybrid(model):
            rep = self_check(model.to(torch.bfloat16))
            gdn = {k: v for k, v in rep.errors.items() if k.startswith("GDN kernel")}
            out["gdn_kernel"] = dict(compared=gdn or None, tolerance=rep.tolerance,
                                     passed=rep.passed)
        del model
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        out["traceback"] = traceback.format_exc()[-2000:]
    return out


def _passed(res: dict) -> bool:
    ok = all(r["ok"] for r in res["attention"]) and res["dense_path_masks"] == 0
    for m in res["models"]:
        ok &= "error" not in m and m["verify_float32"]["passed"] and m["fidelity_bf16"]["passed"]
        ok &= m.get("gdn_kernel", {}).get("passed", True)
    return bool(ok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.gpu_checks",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="qwen3-0.6b")
    p.add_argument("--families", default="qwen3,qwen3_5")
    p.add_argument("--out", required=True)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from dta.model.packmask import DENSE_PATH_MASKS

    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("gpu_checks: --device cuda but torch sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dtypes = (torch.bfloat16, torch.float32)
        batch_kw = dict(groups=4, samples=4, prompt=512, completion=(256, 1024))
        attn_kw = {}
    else:
        dtypes = (torch.float64, torch.float32)
        batch_kw = dict(groups=2, samples=3, prompt=24, completion=(8, 24))
        attn_kw = dict(T=24, past=40, heads=4, kv=2, dim=16)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    DENSE_PATH_MASKS.clear()
    res = dict(device=args.device, size=args.size,
               attention=attention_check(args.device, dtypes, **attn_kw))
    DENSE_PATH_MASKS.clear()  # the attention check's reference masks are its own
    res["models"] = [model_checks(f.strip(), args.size, args.device, batch_kw)
                     for f in args.families.split(",") if f.strip()]
    res["dense_path_masks"] = int(sum(DENSE_PATH_MASKS.values()))
    res["passed"] = _passed(res)
    res["seconds"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "checks.json"), "w") as f:
        json.dump(json_safe(res), f, indent=1)
    for r in res["attention"]:
        print(f"attention {r['dtype']:8s} {r['mask']:6s} {r['backend']:10s} "
              + ("OK " if r["ok"] else "BAD ") + (r.get("error") or
                 f"out {r['out']:.1e} dq {r['dq']:.1e} dk {r['dk']:.1e} dv {r['dv']:.1e}"))
    for m in res["models"]:
        print(f"{m['family']}/{m['size']}: " + (m.get("error") or
              f"verify fp32 {m['verify_float32']['max_rel_err']:.2e}, bf16 ratio (lp, grad) "
              f"{m['fidelity_bf16']['ratio']['logprobs_rel_l2']:.2f}, "
              f"{m['fidelity_bf16']['ratio']['grad_rel_l2']:.2f}"
              + (f", GDN kernel {m['gdn_kernel']['compared']}" if "gdn_kernel" in m else "")))
    print(f"{'PASS' if res['passed'] else 'FAIL'}: dense masks over cached keys "
          f"{res['dense_path_masks']}; {res['seconds']:.0f}s")
    if args.json:
        slim = {k: v for k, v in res.items() if k != "models"}
        slim["models"] = [{k: v for k, v in m.items() if k != "traceback"} for m in res["models"]]
        print(json.dumps(json_safe(slim)))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

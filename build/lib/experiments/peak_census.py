"""What is alive at the allocated peak of one training step, and who allocated it.

One step of the blocks benchmark's batch (``experiments/bench_blocks.py``: policy recompute,
the "small" model, a 2,048-token prompt + 4 leaves of 6,144 tokens, loss on the leaves) runs
under the PyTorch profiler with ``profile_memory``; every allocation and free of the step is
replayed in time order up to the allocation that set the peak, and the allocations still
alive then are summed by the operator chain (``--stack``: and the Python lines) that made them.
Reads the CPU allocator's own events, so it sees every tensor -- the graph's saved tensors,
the path's K/V and their gradients, the head's workspace, a mask HF builds -- but not what
lives outside tensors. This is how the blocks peak was taken apart (docs/memory.md).

    python -m experiments.peak_census --block 1024 [--scale 1] [--stack] [--top 20] [--json]
"""
from __future__ import annotations

import argparse
import collections
import json


def census(block: int, scale: float = 1.0, stack: bool = False, threads: int = 2) -> dict:
    import numpy as np
    import torch
    from torch._C._profiler import _EventType

    from dta.batch import Batch
    from dta.losses import NLL
    from dta.model.models import build_model
    from dta.train import accumulate_gradients
    from experiments.bench_path_memory import shared_prefix_batch

    torch.set_num_threads(threads)
    prompt, leaf = max(1, round(2048 * scale)), max(1, round(6144 * scale))
    model = build_model("qwen3", "small", seed=0, max_position_embeddings=max(32768, prompt + leaf))
    batch, seqs, _ = shared_prefix_batch(model.config.vocab_size, prompt, leaf, 4)

    def step(b):
        return accumulate_gradients(model, b, NLL(), policy="recompute", block_tokens=block,
                                    logits_chunk=max(1, round(1024 * scale)))

    # what a first backward loads is not the step's (as in the benchmark)
    step(Batch.from_records([{"input_ids": s[:16], "loss_mask": np.ones(16)} for s in seqs[:2]]))
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True, with_stack=stack) as prof:
        step(batch)
    events = []

    def visit(node):
        if node.tag == _EventType.Allocation:
            chain, p = [], node.parent
            while p is not None:
                if not stack or "dta/" in p.name or "transformers/" in p.name or "aten::" in p.name:
                    chain.append(p.name)
                p = p.parent
            f = node.extra_fields
            events.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated,
                           " < ".join(chain[:12])))
        for c in node.children:
            visit(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root)
    if not events:
        raise SystemExit("the profiler recorded no allocation (is this a CPU build?)")
    events.sort()
    base = events[0][3] - events[0][2]
    top = max(range(len(events)), key=lambda i: events[i][3])
    live = {}
    for _, ptr, size, _, who in events[:top + 1]:
        if size > 0:
            live[ptr] = (size, who)
        else:
            live.pop(ptr, None)
    by, count = collections.Counter(), collections.Counter()
    for size, who in live.values():
        by[who] += size
        count[who] += 1
    return {"block_tokens": block, "scale": scale, "peak_mib": (events[top][3] - base) / 2**20,
            "at": events[top][4],
            "live": [{"mib": b / 2**20, "allocations": count[w], "by": w} for w, b in by.most_common()]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", type=int, default=1024, help="block_tokens (0: no cut)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length by this")
    p.add_argument("--stack", action="store_true", help="name the Python lines (slower)")
    p.add_argument("--top", type=int, default=20, help="rows to print")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = census(args.block, args.scale, args.stack, args.threads)
    print(f"block_tokens={args.block or 'none'}: peak {res['peak_mib']:.1f} MiB allocated over "
          f"the step's start, at {res['at'][:160]}")
    for row in res["live"][:args.top]:
        print(f"{row['mib']:9.2f} MiB {row['allocations']:5d}x  {row['by'][:200]}")
    if args.json:
        res["live"] = res["live"][:args.top]
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Run a function on W local gloo ranks (torch.multiprocessing, a file:// store on loopback,
``GLOO_SOCKET_IFNAME=lo``) and collect what each returns — for tests and benchmarks of the
sharding modes without Ray. The function must be importable (defined at module level)."""
from __future__ import annotations

import io
import os
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _entry(rank, world, store, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    if os.environ.get("DTA_RANKS_STACKS"):  # debugging a hang: dump the stacks
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["DTA_RANKS_STACKS"]), exit=True)
    try:
        dist.init_process_group("gloo", init_method="file://" + store, rank=rank,
                                world_size=world)
        out = fn(rank, world, *args)
        buf = io.BytesIO()  # plain bytes: a shared-memory tensor would die with the process
        torch.save(out, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report, do not hang the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 300.0):
    """``fn(rank, world, *args)`` on every rank; returns the list of results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dta-ranks-") as d:
        procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(d, "store"), fn, args,
                                                  queue)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world):
                rank, status, out = queue.get(timeout=timeout)
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed:\n{out}")
                results[rank] = torch.load(io.BytesIO(out), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]

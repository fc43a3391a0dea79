"""Run a function on ``C`` local gloo ranks (CPU) that form one group.

The harness of ``dta verify --context-parallel C``, its tests and the CP benchmark (and,
through ``experiments.local_ranks.run_ranks``, of the sharding modes' tests): each rank
is a spawned process (``torch.multiprocessing``, a fresh interpreter) that joins a gloo
process group through a file store in a temporary directory, calls ``fn(group, *args)`` and
sends back its result; an exception on any rank is raised here with that rank's traceback.
"""
from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import traceback


class GroupRunError(RuntimeError):
    """A rank of a local group failed (its traceback is in the message)."""


def _rank_main(rank: int, size: int, store_path: str, fn, args, results, threads: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the group talks over loopback only
    torch.set_num_threads(threads)
    if os.environ.get("DTA_RANKS_STACKS"):  # debugging a hang: dump the stacks after N s
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["DTA_RANKS_STACKS"]), exit=True)
    try:
        store = dist.FileStore(store_path, size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        try:
            out = fn(dist.group.WORLD, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()  # bytes, not shared tensors: this process may exit before the
        torch.save(out, buf)  # parent has read a tensor shared through a file descriptor
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 -- sent to the parent, which raises it
        results.put((rank, False, traceback.format_exc()))


def run_group(fn, size: int, *args, timeout: float = 900.0, threads: int = 1) -> list:
    """``[fn(group, *args) on rank r for r in range(size)]``; ``fn`` must be importable
    (a module-level function) and its arguments and result picklable."""
    import torch.multiprocessing as mp

    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"a local group's size must be an integer >= 1, got {size!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dta-cp-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(r, size, store, fn, args, results, threads))
                 for r in range(size)]
        for p in procs:
            p.start()
        got: dict[int, object] = {}
        errors = []
        try:
            while len(got) + len(errors) < size:
                try:
                    rank, ok, out = results.get(timeout=timeout)
                except queue_mod.Empty:
                    raise GroupRunError(f"local group of {size} ranks: no result within "
                                        f"{timeout:.0f} s") from None
                if ok:
                    import torch

                    got[rank] = torch.load(io.BytesIO(out), weights_only=False)
                else:
                    errors.append((rank, out))
                    break  # the other ranks may wait on the failed one forever
        finally:
            for p in procs:
                p.join(timeout=5 if errors else 60)
                if p.is_alive():
                    p.terminate()
                    p.join()
        if errors:
            rank, tb = errors[0]
            raise GroupRunError(f"rank {rank} of a local group of {size} failed:\n{tb}")
    return [got[r] for r in range(size)]

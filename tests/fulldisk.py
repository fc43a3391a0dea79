"""Run by tests/test_trust_failures.py inside a private mount namespace (``unshare -m``, as
root): two small tmpfs mounts as checkpoint folders, `dta train` (the CLI's own entry point,
in this process, one Ray instance) on each, and what the user saw and what is on disk, as one
JSON object on stdout. Nothing here is visible outside the namespace.

    first/  1 MiB: run.json fits, the checkpoint's DCP file does not -> the first save fails
    later/  2.5 MiB: one checkpoint (1.7 MiB) fits, a second does not -> the second save fails;
            then the disk grows (remount) and train.resume=true continues from step-000001
"""
import contextlib
import io
import json
import os
import subprocess
import sys

from dta.config.schema import load_config
from dta_cli.train import main
from runtime.checkpoints import checkpoint as ckpt
from runtime.ray_runtime.cluster import start_or_join

TINY = ["workload.scale=tiny", "ray.num_workers=1", "ray.object_store_memory=104857600",
        "optimizer.lr=1e-3"]


def mount(path: str, size: str, remount: bool = False) -> None:
    os.makedirs(path, exist_ok=True)
    opts = f"{'remount,' if remount else ''}size={size},mode=0755"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)


def train(*overrides) -> dict:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(["--no-progress", "--json", *TINY, *overrides])
    lines = out.getvalue().strip().splitlines()
    return {"rc": rc, "stderr": err.getvalue(),
            "summary": json.loads(lines[-1]) if rc == 0 and lines else None}


def listing(d: str) -> list[str]:
    return sorted(os.listdir(d))


def main_(root: str) -> dict:
    first, later = os.path.join(root, "first"), os.path.join(root, "later")
    mount(first, "1m")
    mount(later, "2500k")
    handle = start_or_join(load_config(None, TINY).ray)  # every run below reuses it
    facts = {}
    try:
        d = os.path.join(first, "ck")
        facts["first"] = train("train.steps=2", f"train.checkpoint_dir={d}")
        facts["first"]["files"] = listing(d)
        d = os.path.join(later, "ck")
        facts["later"] = train("train.steps=3", "train.keep_last=1", f"train.checkpoint_dir={d}")
        facts["later"]["files"] = listing(d)
        facts["later"]["latest"] = ckpt.latest_checkpoint(d)
        facts["later"]["verified_step"] = ckpt.verify_manifest(facts["later"]["latest"])["step"]
        mount(later, "16m", remount=True)  # the user frees space
        facts["resumed"] = train("train.steps=3", "train.keep_last=1", "train.resume=true",
                                 f"train.checkpoint_dir={d}")
        facts["resumed"]["files"] = listing(d)
    finally:
        handle.shutdown()
    return facts


if __name__ == "__main__":
    print(json.dumps(main_(sys.argv[1])), flush=True)

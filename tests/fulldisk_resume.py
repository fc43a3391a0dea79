"""Run by tests/test_readme_claims.py inside a private mount namespace (``unshare -m``, as
root): the default suite's short version of tests/fulldisk.py. One 2.5 MiB tmpfs as the
checkpoint folder's disk: `dta train` (the CLI's entry point, in this process, one Ray
instance) saves step-000001 (1.7 MiB), fails to save step-000002 (no space), then the disk
grows (remount) and train.resume=true finishes step 2. What the user saw and what is on
disk, as one JSON object on stdout; nothing here is visible outside the namespace."""
import json
import os
import sys

from dta.config.schema import load_config
from runtime.checkpoints import checkpoint as ckpt
from runtime.ray_runtime.cluster import start_or_join
from tests.fulldisk import TINY, listing, mount, train


def main_(root: str) -> dict:
    disk = os.path.join(root, "disk")
    mount(disk, "2500k")
    d = os.path.join(disk, "ck")
    handle = start_or_join(load_config(None, TINY).ray)  # both runs reuse it
    try:
        full = train("train.steps=2", "train.keep_last=1", f"train.checkpoint_dir={d}")
        full.update(files=listing(d), latest=ckpt.latest_checkpoint(d))
        full["verified_step"] = (ckpt.verify_manifest(full["latest"])["step"]
                                 if full["latest"] else None)
        mount(disk, "16m", remount=True)  # the user frees space
        resumed = train("train.steps=2", "train.keep_last=1", "train.resume=true",
                        f"train.checkpoint_dir={d}")
        resumed["files"] = listing(d)
    finally:
        handle.shutdown()
    return {"full": full, "resumed": resumed}


if __name__ == "__main__":
    print(json.dumps(main_(sys.argv[1])), flush=True)

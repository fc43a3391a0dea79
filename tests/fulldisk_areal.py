"""Run by tests/test_trust_failures.py inside a private mount namespace (``unshare -m``, as
root): the AReaL engine's ``save`` (hf with the optimizer, and dcp) into a 64 KiB tmpfs, and
its ``load`` from a missing folder; what each raised, as one JSON object on stdout."""
import json
import os
import subprocess
import sys

import torch._dynamo
from areal.api.io_struct import SaveLoadMeta

from tests.test_areal_members import make_smoke_model, new_engine


def attempt(fn, meta) -> dict:
    try:
        fn(meta)
        return {"raised": None}
    except BaseException as exc:  # noqa: BLE001 - reported to the test (DCP's is Base)
        return {"raised": type(exc).__name__, "message": str(exc),
                "errno": getattr(exc, "errno", None)}


def main(root: str) -> dict:
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    model = make_smoke_model(os.path.join(root, "model"), vocab_size=128)
    small = os.path.join(root, "small")
    os.makedirs(small)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", small],
                   check=True)
    with torch._dynamo.config.patch(disable=True):
        engine = new_engine(model)
        facts = {name: attempt(fn, SaveLoadMeta(path=os.path.join(small, name),
                                                 weight_format=fmt, with_optim=True))
                 for name, fmt, fn in (("hf", "hf", engine.save), ("dcp", "dcp", engine.save),
                                       ("missing", "hf", engine.load))}
        facts["left"] = sorted(os.listdir(small))
        engine.destroy()
    return facts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)

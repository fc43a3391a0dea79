"""Run by tests/test_trust_failures.py inside a private mount namespace (``unshare -m``, as
root): ``save_checkpoint`` (no Ray) on small tmpfs mounts, and what it raised and left on
disk, as one JSON object on stdout. ``first``: 1 MiB, the first save fails; ``later``:
2.5 MiB, one checkpoint (1.7 MB) fits and the second save fails."""
import json
import os
import subprocess
import sys

import torch

from runtime.checkpoints import checkpoint as ckpt
from runtime.checkpoints import whole


def mount(path: str, size: str) -> None:
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                   check=True)


def model():
    torch.manual_seed(0)
    m = torch.nn.Linear(512, 280)  # 143,640 parameters: weights + AdamW moments 1.72 MB (DCP)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 512)).sum().backward()
    opt.step()
    return m, opt


def attempt(directory: str, step: int, m, opt) -> dict:
    try:
        whole.save_checkpoint(directory, step, m, opt, keep_last=1)
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"raised": type(exc).__name__, "message": str(exc)}


def main(root: str) -> dict:
    m, opt = model()
    facts = {}
    for name, size in (("first", "1m"), ("later", "2500k")):
        mount(os.path.join(root, name), size)
        d = os.path.join(root, name, "ck")
        ckpt.prepare_run(d, resume=False)
        tries = [attempt(d, 1, m, opt)] if name == "first" else \
            [attempt(d, 1, m, opt), attempt(d, 2, m, opt)]
        latest = ckpt.latest_checkpoint(d)
        facts[name] = {"tries": tries, "files": sorted(os.listdir(d)), "latest": latest}
        if latest:
            fresh, fresh_opt = torch.nn.Linear(512, 280), None
            meta = whole.load_checkpoint(latest, fresh, fresh_opt)
            facts[name]["loaded_step"] = meta["step"]
            facts[name]["same_weights"] = bool(torch.equal(fresh.weight, m.weight))
    return facts


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)

"""The one JSON line of experiments/bench/gpu.sh, from its results folder:

    python -m experiments.gpu_summary DEST CHECKS_RC BLOCKS_RC SECONDS [LAYOUTS_RC]
"""
from __future__ import annotations

import glob
import json
import os
import sys

STAGE_FILES = ("env", "checks", "blocks", "layouts", "gpu")


def last_json(path: str):
    """The last line of ``path`` as JSON; None when it is missing or not JSON."""
    try:
        with open(path) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _rc(rc: str):
    return int(rc) if rc.isdigit() else rc


def summary(dest: str, checks_rc: str, blocks_rc: str, seconds: int,
            layouts_rc: str = "skipped") -> dict:
    checks = last_json(os.path.join(dest, "checks.json"))
    bench = {}
    for f in sorted(glob.glob(os.path.join(dest, "*.json"))):
        name = os.path.basename(f)[:-5]
        if name in STAGE_FILES:
            continue
        d = last_json(f)
        bench[name] = None if d is None else {k: d[k] for k in
                                              ("headline", "sequences", "sharing_ratio") if k in d}
    return dict(env=last_json(os.path.join(dest, "env.json")), seconds=seconds,
                checks_rc=int(checks_rc), checks_passed=None if checks is None else checks.get("passed"),
                checks=checks, bench=bench,
                blocks_rc=int(blocks_rc) if blocks_rc.isdigit() else blocks_rc,
                blocks=last_json(os.path.join(dest, "blocks.json")),
                layouts_rc=_rc(layouts_rc), layouts=last_json(os.path.join(dest, "layouts.json")),
                results=dest)


if __name__ == "__main__":
    dest, checks_rc, blocks_rc, seconds = sys.argv[1:5]
    print(json.dumps(summary(dest, checks_rc, blocks_rc, int(seconds), *sys.argv[5:6])))

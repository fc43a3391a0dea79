"""experiments/peak_census.py: what is alive at a step's allocated peak, from the profiler's
allocation events (a tiny cut of the blocks benchmark's batch)."""
from __future__ import annotations

import json

from experiments import peak_census


def test_census_accounts_for_the_peak(capsys):
    res = peak_census.census(block=8, scale=1 / 256)
    assert res["peak_mib"] > 0
    live = sum(r["mib"] for r in res["live"])
    # the allocations alive at the peak are the peak (the step's start is the zero)
    assert abs(live - res["peak_mib"]) <= 0.05 * res["peak_mib"] + 0.01
    # the vocabulary-sized head gradient ([32K, 256] fp32, 31.25 MiB) is among them
    assert max(r["mib"] for r in res["live"]) >= 31.0
    assert peak_census.main(["--block", "8", "--scale", str(1 / 256), "--top", "3", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["block_tokens"] == 8 and len(last["live"]) <= 3

"""`dta bench` never headlines a DFS mode whose gradients are WRONG or unchecked (issue 31).

Built from summaries of hand-made runs (no model): the headline is a function of the runs'
step times, peaks and gradient errors, so the cases are exact."""
from __future__ import annotations

import json

import pytest

from experiments.bench.report import table
from experiments.bench.run import BenchConfig, compact, summarize

CALLS = dict(forward_calls=3, backward_calls=3, head_calls=1, packs=3, nodes=40)


def _summary(modes, rows, reference="microbatch"):
    cfg = BenchConfig(modes=modes, repeats=1)
    info = dict(total_tokens=1000, sharing_ratio=4.0, ideal_speedup=3.0,
                flops={m: 1e9 for m in modes})
    runs = [dict(mode=m, repeat=0, ok=True, step_s=t, peak_mem_mb=mem, grad_rel_err=err,
                 calls=CALLS, grad_reference=reference) for m, t, mem, err in rows]
    s = summarize(cfg, runs, info)
    md = table(dict(label="x", summary=s, info=dict(info, sequences=3, unique_tokens=250,
                                                    trainable_tokens=10,
                                                    ideal_baseline="microbatch")))
    return s, md


def _json_headline(s):
    """The headline as `dta bench --json` prints it (strict JSON)."""
    results = dict(points=[dict(label="x", summary=s, info=dict(total_tokens=1000, sequences=3))],
                   config=dict(BenchConfig().__dict__, modes=list(s["modes"])), out="o")
    return json.loads(json.dumps(compact(results), allow_nan=False))["headline"]


def test_fastest_dfs_mode_with_wrong_gradients_headlines_nothing():
    s, md = _summary(("microbatch", "dfs-retain", "dfs-recompute"),
                     [("microbatch", 3.0, 100.0, 0.0), ("dfs-retain", 1.0, 90.0, 0.5),
                      ("dfs-recompute", 1.2, 80.0, 1e-7)])
    assert s["modes"]["dfs-retain"]["status"] == "WRONG"
    hl = _json_headline(s)
    assert hl["best_dfs"] is None and hl["fastest_dfs"] == "dfs-retain"
    assert hl["fastest_status"] == "WRONG" and "WRONG" in hl["refused"]
    assert not {"speedup", "of_ideal", "best_within_memory", "over_treemask"} & set(hl)
    assert "Fastest DFS mode:" not in md and "No DFS mode with checked gradients" in md


def test_fastest_dfs_mode_with_unchecked_gradients_headlines_nothing():
    """No reference gradient (its run failed): every mode is unchecked."""
    s, md = _summary(("microbatch", "dfs-retain"),
                     [("microbatch", 3.0, 100.0, None), ("dfs-retain", 1.0, 90.0, None)])
    assert s["modes"]["dfs-retain"]["status"] == "unchecked"
    hl = _json_headline(s)
    assert hl["best_dfs"] is None and hl["fastest_status"] == "unchecked"
    assert "not checked" in hl["refused"] and "speedup" not in hl
    assert "Fastest DFS mode:" not in md


def test_a_dfs_reference_is_unchecked():
    """Without microbatch the first mode is the reference, equal to itself: not a check."""
    s, _ = _summary(("dfs-retain", "dfs-recompute"),
                    [("dfs-retain", 1.0, 90.0, 0.0), ("dfs-recompute", 1.2, 80.0, 1e-7)],
                    reference="dfs-retain")
    hl = s["headline"]
    assert hl["best_dfs"] is None and hl["fastest_dfs"] == "dfs-retain"
    assert hl["fastest_status"] == "unchecked"


@pytest.mark.parametrize("err,shown", [(1e-7, True), (0.5, False)])
def test_within_memory_headline_needs_checked_gradients(err, shown):
    """The fastest mode is checked; the fastest within the baseline's memory is headlined
    only when its own gradients are within the tolerance."""
    s, md = _summary(("microbatch", "dfs-retain", "dfs-recompute"),
                     [("microbatch", 3.0, 100.0, 0.0), ("dfs-retain", 1.0, 150.0, 1e-7),
                      ("dfs-recompute", 1.2, 80.0, err)])
    hl = s["headline"]
    assert hl["best_dfs"] == "dfs-retain" and hl["of_ideal"] == pytest.approx(1.0)
    assert ("best_within_memory" in hl) is shown and ("within_memory_refused" in hl) is not shown
    assert ("within the baseline's peak memory: **dfs-recompute**" in md) is shown

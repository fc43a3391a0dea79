"""The walk's per-call gradient sum on the host (``train.offload=gradients``, issue 53 item 4):
what lets Llama-70B's state sit in one node of 8 (docs/planning.md).

* bf16 compute, fp32 masters, 2 gloo ranks: fsdp and zero2 with the sums on the host change
  no bit against the same run with the sums on the device (``offload=optimizer``): the same
  additions in the same order, so the same log-probs, losses, reduced gradients and
  parameters after two AdamW steps, bit for bit; and each FSDP2 unit's sums are the host
  gradient buffers the optimizer reads (no device copy of them is kept).
* float64 against one process through the three doors: ``tests/layouts.py``'s
  ``*-gradients`` lines in the exactness matrix (``tests/test_layout_matrix.py``), HSDP and
  node residency included; zero1 refused in one line.
"""
from __future__ import annotations

import pytest
import torch

from experiments.local_ranks import run_ranks
from tests.test_hsdp import overrides, record

CASES = [("fsdp", "recompute"), ("zero2", "retain")]


def both_ways(rank, world, cases):
    """Each case with the sums on the device and on the host, bf16 compute; and, on the
    host, where the units' sums live."""
    from dta.config.schema import load_config
    from tests.test_sharding import _worker

    torch.set_num_threads(1)
    out = []
    for mode, policy in cases:
        got = {off: record(rank, world, overrides(mode, policy, None, off, "bfloat16"),
                           counted=False) for off in ("optimizer", "gradients")}
        w = _worker(load_config(None, overrides(mode, policy, None, "gradients", "bfloat16")),
                    rank, world)
        part = w.core.sharding.layer_part
        buffers = {id(b) for b in part.host_grads}
        got["into"] = [acc.into is not None and all(id(b) in buffers for b in acc.into)
                       for acc in part.summed]
        got["on_host"] = part.on_host
        out.append(got)
    return out


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_sums_on_the_host_change_no_bit(case):
    results = run_ranks(both_ways, 2, [case], timeout=900.0)
    for rank, (got,) in enumerate(results):
        dev, host = got["optimizer"], got["gradients"]
        assert got["on_host"] and got["into"] and all(got["into"]), (case, rank, got["into"])
        assert all(torch.equal(a, b) for a, b in zip(dev["logprobs"], host["logprobs"]))
        for k, (s, t) in enumerate(zip(dev["steps"], host["steps"])):
            assert s["loss"] == t["loss"], (case, rank, k)
            assert _same(s["grads"], t["grads"]), (case, rank, k, "gradients")
            assert _same(s["state"], t["state"]), (case, rank, k, "parameters")
            # the layers' fp32 sums left the device's gradient bytes; the host's are equal
            assert t["state_bytes"]["grads"] < s["state_bytes"]["grads"], (case, rank, k)
            assert t["state_bytes"]["host"] == s["state_bytes"]["host"], (case, rank, k)
        assert dev["param_norm"] == host["param_norm"]
        print(f"{case} rank {rank}: bit-identical over {len(dev['steps'])} steps; device grads "
              f"{dev['steps'][-1]['state_bytes']['grads']} -> "
              f"{host['steps'][-1]['state_bytes']['grads']} bytes")

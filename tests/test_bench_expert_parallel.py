"""experiments.bench_expert_parallel at a tiny size (counts, not timings): at E = 2 each rank
holds half of the expert weights and counts about half of E = 1's expert FLOPs, the step's
loss equals E = 1's, the routed rows really crossed, and with the same tokens walked on a
shorter path the bytes sent per routed row stay within 10 % (communication follows the
tokens routed, not the path)."""
import json

from experiments import bench_expert_parallel as bench


def test_tiny_bench_expert_parallel(capsys):
    rc = bench.main(["--layouts", "1/1", "2/2", "--groups", "2", "--prompt", "32",
                     "--rollout", "64", "--block", "32", "--model", "tiny-moe4", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["passed"] is True
    rows = {(r["world"], r["expert_parallel"], r["rollout"]): r for r in out["rows"]}
    two = rows[(2, 2, 64)]
    assert two["expert_bytes_ratio"] == 0.5 and two["expert_flops_ratio"] <= 0.58
    assert min(two["expert_flops"]) > 0 and rows[(1, 1, 64)]["expert_flops"][0] > 0
    assert two["loss_rel_err"] <= 1e-5 and min(two["sent_bytes"]) > 0
    assert abs(out["sent_per_row_growth"]["2/2"] - 1) <= 0.10

"""experiments.bench_context_parallel at a tiny size: at C = 2 each rank counts about half of
C = 1's FLOPs and stores half of its path K/V, the group's gradient equals C = 1's (and the
walker alone's), and with the same tokens walked on a shorter path the bytes sent per step
stay within 10 % (communication follows the blocks, not the path)."""
import json

from experiments import bench_context_parallel as bench


def test_tiny_bench_context_parallel(capsys):
    rc = bench.main(["--prompt", "64", "--rollout", "128", "--block", "32", "--model", "tiny",
                     "--sizes", "1", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["passed"] is True
    assert out["short_rollouts"] == 4  # 2 x 128 walked again as 4 x 64
    rows = {(r["context_parallel"], r["rollout"], r["plain"]): r for r in out["rows"]}
    two = rows[(2, 128, False)]
    assert two["flops_ratio"] <= 0.58 and two["path_kv_ratio"] <= 0.55
    assert two["grad_rel_err"] <= 1e-5 and rows[(1, 128, True)]["grad_rel_err"] <= 1e-5
    assert min(two["flops"]) > 0 and rows[(1, 128, True)]["flops"][0] > 0
    assert abs(out["sent_per_step_growth"]["2"] - 1) <= 0.10
    assert min(rows[(2, 64, False)]["sent_bytes"]) > 0  # the group did communicate

"""experiments.bench_context_parallel at a tiny size: the path K/V per rank halves at C = 2, the
gradients equal C = 1's, and with the same tokens walked on a shorter path the bytes sent per
step stay within 10 % (communication follows the blocks, not the path)."""
import json

from experiments import bench_context_parallel as bench


def test_tiny_bench_context_parallel(capsys):
    rc = bench.main(["--prompt", "64", "--rollout", "128", "--block", "32", "--model", "tiny",
                     "--sizes", "1", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["passed"] is True
    assert out["short_rollouts"] == 4  # 2 x 128 walked again as 4 x 64
    rows = {(r["context_parallel"], r["rollout"]): r for r in out["rows"]}
    assert rows[(2, 128)]["path_kv_ratio"] <= 0.55
    assert rows[(2, 128)]["grad_rel_err"] <= 1e-5
    assert abs(out["sent_per_step_growth"]["2"] - 1) <= 0.10
    assert min(rows[(2, 64)]["sent_bytes"]) > 0  # the group did communicate

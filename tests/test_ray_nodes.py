"""Ray across nodes: the workers' placement group (``ray.placement=pack|spread``), the TCP
rendezvous served by rank 0 on its node's Ray address, and ``worker_nodes``.

Default suite: the placement arithmetic, the config key, and on one private local instance a
spread placement group whose workers meet through the TCP store (forced, as if they were on
another node than the driver) with every listener on loopback. Slow: a real two-node cluster
(two raylets on 127.0.0.1 in a private network and PID namespace, scripts/ray_two_nodes.py):
``dta train --address`` with 4 workers on both nodes ends with the parameters of a 1-worker
run, and ``ray.placement`` decides where 2 workers go."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dta.config.schema import ConfigError, load_config
from runtime.errors import TrainingError
from runtime.ray_runtime.placement import bundle_for, check_fits, fits_on
from tests.workers import trainer_digests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["workload.scale=tiny", "ray.object_store_memory=104857600", "optimizer.lr=1e-3"]


def node(node_id: str, alive=True, **resources) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": resources}


# ------------------------------------------------------------------ without Ray --
def test_bundles_fit_per_node_not_in_total():
    assert bundle_for(1.0, 0.0) == {"CPU": 1.0}  # no zero GPU in a bundle (Ray refuses it)
    assert bundle_for(4, 1) == {"CPU": 4.0, "GPU": 1.0}
    assert fits_on({"CPU": 8.0, "GPU": 2.0}, bundle_for(2, 1)) == 2  # GPUs limit
    assert fits_on({"CPU": 3.0}, bundle_for(1.5, 0)) == 2
    nodes = [node("a" * 56, CPU=3.0), node("b" * 56, CPU=3.0), node("c" * 56, False, CPU=64.0)]
    assert check_fits(4, bundle_for(1.5, 0), nodes) == {"a" * 56: 2, "b" * 56: 2}
    # 6 CPUs in total, but a 2-CPU worker never spans nodes: only 2 fit (dead node ignored)
    with pytest.raises(TrainingError, match=r"ray.num_workers=3 workers of 2 CPU each do not "
                                            r"fit.*aaaaaaaa: 1, bbbbbbbb: 1.*ray.cpus_per_worker"):
        check_fits(3, bundle_for(2, 0), nodes)


def test_placement_key_is_validated():
    assert load_config(None, []).ray.placement == "pack"
    assert load_config(None, ["ray.placement=spread"]).ray.placement == "spread"
    with pytest.raises(ConfigError, match=r"'ray.placement': 'scatter' is not one of pack, spread"):
        load_config(None, ["ray.placement=scatter"])


# ---------------------------------------------------------------------- with Ray --
@pytest.fixture(scope="module")
def ray_local():
    from runtime.ray_runtime.cluster import start_or_join

    handle = start_or_join(load_config(None, TINY + ["ray.num_workers=2"]).ray)
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.mark.ray
def test_spread_group_meets_over_tcp_on_loopback(ray_local, monkeypatch):
    import ray
    from ray.util import placement_group_table

    from dta_cli.batches import BatchSource
    from runtime.ray_runtime import actors
    from runtime.ray_runtime.cluster import check_loopback
    from runtime.ray_runtime.driver import Trainer
    from runtime.ray_runtime.stats import summarize

    # As if the workers ran on another node than the driver: the multi-node rendezvous.
    monkeypatch.setattr(actors, "same_node_as_driver", lambda infos: False)
    cfg = load_config(None, TINY + ["ray.num_workers=2", "ray.placement=spread"])
    here = ray.get_runtime_context().get_node_id()
    with Trainer(cfg) as trainer:
        group = trainer.group
        table = placement_group_table(group.placement.group)
        assert table["strategy"] == "SPREAD" and table["state"] == "CREATED"
        assert len(table["bundles"]) == 2 and table["bundles"][0] == {"CPU": 1.0}
        assert group.worker_nodes == [here, here]
        assert group.rendezvous.startswith("tcp://127.0.0.1:")
        port = int(group.rendezvous.rsplit(":", 1)[1])
        if not ray_local.reused:  # the store and gloo listen, and only on loopback
            listeners = check_loopback(ray_local.pids())
            assert any(x.port == port and x.ip == "127.0.0.1" for x in listeners)
        stats = trainer.step(BatchSource(cfg, 512).batch(0), 0)
        assert all(w["sequences"] > 0 for w in stats.workers)
        digests = trainer_digests(trainer)
        assert digests[0] == digests[1]  # the all-reduce went through the TCP-formed group
        summary = summarize(trainer.history, trainer)
        pg = group.placement.group
    assert summary["worker_nodes"] == [here, here] and summary["nodes"] == 1
    assert summary["placement"] == "spread" and summary["rendezvous"].startswith("tcp://")
    assert placement_group_table(pg)["state"] == "REMOVED"  # freed with the workers


# ------------------------------------------------------------- two-node cluster --
def _safetensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _rel_l2(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1200)
def test_dta_train_on_a_two_node_cluster(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a private network and PID namespace)")
    train = (f"{sys.executable} -m dta_cli train --address {{address}} --no-progress --json "
             + " ".join(TINY))
    runs = [f"{train} train.steps=2 ray.num_workers=4 train.export_hf={tmp_path / 'four'}",
            f"{train} train.steps=2 ray.num_workers=1 train.export_hf={tmp_path / 'one'}",
            f"{train} train.steps=1 ray.num_workers=2 ray.placement=spread",
            f"{train} train.steps=1 ray.num_workers=2 ray.placement=pack"]
    out = tmp_path / "result.json"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "ray_two_nodes.py"), "--out", str(out),
           "--cpus-per-node", "2", "--object-store-mib", "100"]
    for r in runs:
        cmd += ["--run", r]
    done = subprocess.run(cmd, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=1100)
    result = json.loads(out.read_text())
    failed = [r["command"] + "\n" + r["stderr_tail"] for r in result["runs"] if r["rc"]]
    assert done.returncode == 0 and "error" not in result and not failed, \
        (result.get("error"), failed, done.stderr[-2000:])

    nodes = result["nodes"]
    assert len(set(nodes)) == 2  # a real two-node cluster
    assert result["listeners"] and result["beyond_loopback"] == []  # `ss` in the namespace
    four, one, spread, pack = (r["json"] for r in result["runs"])
    assert set(four["worker_nodes"]) == set(nodes)  # 4 workers of 1 CPU: both 2-CPU nodes
    assert sorted(four["worker_nodes"].count(n) for n in nodes) == [2, 2]
    assert four["rendezvous"].startswith("tcp://127.0.0.1:") and four["nodes"] == 2
    assert len(one["worker_nodes"]) == 1 and one["worker_nodes"][0] in nodes
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-5)
    from runtime.ray_runtime.worker import build_replica

    init = build_replica(load_config(None, TINY)).state_dict()
    p4, p1 = _safetensors(str(tmp_path / "four")), _safetensors(str(tmp_path / "one"))
    assert _rel_l2(p4, p1) <= 1e-5  # the parameters of the 1-worker run
    update = lambda p: {k: p[k].double() - init[k].double() for k in p}  # noqa: E731
    assert _rel_l2(update(p4), update(p1)) <= 1e-4  # the updates themselves agree
    assert _rel_l2(p1, init) > 1e-4  # and they are not zero
    assert spread["placement"] == "spread" and len(set(spread["worker_nodes"])) == 2
    assert pack["placement"] == "pack" and len(set(pack["worker_nodes"])) == 1

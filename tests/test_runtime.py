"""Ray runtime: data-parallel DFS equals one worker and unpacked training; a worker dying
mid-step changes nothing and resuming matches an uninterrupted run; streaming trains every
rollout once; `dta submit` against a `ray start --head` bound to 127.0.0.1.

One private local Ray instance serves the whole module (in-process ``ray.init`` +
``ray.shutdown``); the job test starts its own head and kills exactly the processes it
started. Nothing here calls ``ray stop``.
"""
from __future__ import annotations

import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

from dta.batch import Batch, BatchError
from dta.config.schema import load_config
from dta.config.walk import walk_options
from dta_cli.batches import BatchSource
from runtime.ray_runtime import (
    StepFailed,
    StreamingBatcher,
    Trainer,
    check_loopback,
    listening_addresses,
    start_or_join,
)
from runtime.ray_runtime.cluster import ClusterError
from runtime.ray_runtime.stream import END
from tests.workers import gradients, state, trainer_digests, trainer_gradients, trainer_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["workload.scale=tiny", "ray.num_workers=2", "ray.object_store_memory=104857600"]


def tiny_cfg(*overrides):
    return load_config(None, TINY + list(overrides))


def rel_l2(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def assert_identical(a, b, where=""):
    """torch.equal on every tensor of two nested state dicts."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys differ"
        for k in a:
            assert_identical(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# ------------------------------------------------------------------ without Ray --
def test_listening_addresses_flags_a_non_loopback_listener():
    loop, wild = socket.socket(), socket.socket()
    try:
        loop.bind(("127.0.0.1", 0))
        loop.listen()
        wild.bind(("0.0.0.0", 0))
        wild.listen()
        found = {(x.ip, x.port) for x in listening_addresses([os.getpid()])}
        assert ("127.0.0.1", loop.getsockname()[1]) in found
        assert ("0.0.0.0", wild.getsockname()[1]) in found
        with pytest.raises(ClusterError, match=f"0.0.0.0:{wild.getsockname()[1]}"):
            check_loopback([os.getpid()])
    finally:
        loop.close()
        wild.close()


def test_private_token_is_set_up_and_the_environment_restored(tmp_path, monkeypatch):
    from runtime.ray_runtime.cluster import ensure_local_auth, restore_auth

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/elsewhere/token")
    previous = ensure_local_auth(str(tmp_path))
    token = tmp_path / "auth_token"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    restore_auth(previous)
    assert "RAY_AUTH_MODE" not in os.environ
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == "/elsewhere/token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's choice is left alone
    assert ensure_local_auth(str(tmp_path / "x")) is None


def test_stream_batcher_cuts_at_the_token_target():
    recs = [{"input_ids": np.arange(1, 2 + n) % 50 + 1, "uid": i}
            for i, n in enumerate([5, 7, 3, 9, 4, 6, 2])]
    out = list(StreamingBatcher(iter(recs), target_tokens=15))
    # lengths 6, 8, 4 | 10, 5 | 7, 3
    assert [[r["uid"] for r in b.records] for b in out] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [b.reason for b in out] == ["tokens", "tokens", "end"]
    assert all(b.tokens >= 15 for b in out[:-1])
    assert len(list(StreamingBatcher(iter(recs), target_tokens=15, drop_last=True))) == 2
    with pytest.raises(ValueError, match="target"):
        StreamingBatcher(iter(recs))


def test_bad_batch_is_rejected_on_the_driver():
    trainer = Trainer(tiny_cfg())  # not started: validation needs no worker
    good = BatchSource(trainer.cfg, trainer.vocab_size).records(0)
    bad = [dict(r) for r in good]
    bad[3]["input_ids"] = bad[3]["input_ids"].copy()
    bad[3]["input_ids"][5] = trainer.vocab_size + 7
    with pytest.raises(BatchError, match="sequence 3"):
        trainer.validate(Batch.from_records(bad))
    no_adv = [{k: v for k, v in r.items() if k != "advantages"} for r in good]
    with pytest.raises(BatchError, match="advantages"):
        trainer.validate(Batch.from_records(no_adv))


def test_simulate_scaling_projects_and_plots(tmp_path, capsys):
    import json

    from experiments.simulate_scaling import main

    png = tmp_path / "scaling.png"
    assert main(["--scale", "small", "--seeds", "1", "--workers", "1,2,4,8", "--size", "tiny",
                 "--family", "qwen3", "--plot", str(png), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["workers"]: r for r in result["rows"]}
    assert set(rows) == {1, 2, 4, 8} and rows[1]["speedup"] == pytest.approx(1.0)
    assert rows[1]["duplicated_tokens"] == 0 and rows[8]["duplicated_tokens"] > 0
    assert all(1.0 <= r["imbalance"] for r in rows.values())
    assert all(r["speedup"] <= r["workers"] + 1e-9 for r in rows.values())
    assert png.stat().st_size > 10_000


def test_decoupled_loss_recomputes_the_proximal_logprobs():
    from dta.reference import sequence_logprobs
    from dta.train import checked_walker, walk_batch
    from runtime.ray_runtime.worker import (
        build_replica,
        make_training_loss,
        recompute_fields,
        to_recompute,
    )

    cfg = load_config(os.path.join(ROOT, "configs", "tau2-airline-grpo.yaml"),
                      ["model.size=tiny", "workload.scale=tiny"])
    loss = make_training_loss(cfg)
    assert loss.decoupled and recompute_fields(cfg, loss) == ("prox_logprobs",)
    batch = BatchSource(cfg, 512).batch(0)
    assert "prox_logprobs" not in batch.fields
    assert to_recompute(batch, ("prox_logprobs",)) == ("prox_logprobs",)
    model = build_replica(cfg)
    seen = {}

    def record(lp, ent, fields):  # the batch the loss sees
        seen[int(fields["seq"][0])] = fields["prox_logprobs"], fields["old_logprobs"]
        return lp.sum() * 0.0

    from dta.losses import SequenceLoss

    walker = checked_walker(model, walk_options(cfg))
    tagged = Batch(batch.input_ids, {**batch.fields, "seq": [np.full(len(s), float(i))
                                                             for i, s in enumerate(batch.input_ids)]})
    walk_batch(walker, tagged, SequenceLoss(record, ("seq", "prox_logprobs", "old_logprobs")),
               train=False, recompute=("prox_logprobs",))
    with torch.no_grad():
        for i in (0, len(batch) - 1):
            ref, _ = sequence_logprobs(model, batch.input_ids[i])
            got = seen[i][0].double().numpy()
            assert np.abs(got[1:] - ref[1:].double().numpy()).max() < 1e-4
            old = torch.as_tensor(batch.fields["old_logprobs"][i]).to(seen[i][1].dtype)
            assert torch.equal(seen[i][1], old)  # the batch's own, kept


# ---------------------------------------------------------------------- with Ray --
@pytest.fixture(scope="module")
def ray_local():
    handle = start_or_join(tiny_cfg().ray)
    try:
        yield handle
    finally:
        handle.shutdown()


@pytest.mark.ray
def test_local_instance_listens_on_loopback_only(ray_local):
    if ray_local.reused:
        pytest.skip("Ray was already initialized by someone else in this process")
    assert ray_local.listeners, "found no listening sockets of the Ray instance"
    assert any(x.name.startswith("gcs_server") for x in ray_local.listeners)
    assert all(x.loopback for x in ray_local.listeners)
    check_loopback(ray_local.pids())  # still true now, with worker processes up
    if ray_local.auth_dir:  # a private token, not ~/.ray/auth_token
        assert os.environ["RAY_AUTH_TOKEN_PATH"].startswith(ray_local.auth_dir)


@pytest.mark.ray
def test_two_workers_match_one_worker_and_unpacked(ray_local):
    from dta.reference import unpacked_gradients
    from dta.train import clip_and_step
    from runtime.ray_runtime.worker import build_replica, make_optimizer, make_training_loss
    from tests.workers import local_worker

    # walker.block_tokens=5: the workers walk every longer node in pieces of <= 5 tokens
    cfg = tiny_cfg("optimizer.lr=1e-3", "optimizer.max_grad_norm=null", "walker.block_tokens=5")
    batch = BatchSource(cfg, 512).batch(0)
    assert len(batch) >= 4 and "advantages" in batch.fields  # a PPO batch with sharing
    init = {k: v.clone() for k, v in build_replica(cfg).state_dict().items()}

    with Trainer(cfg) as trainer:
        stats = trainer.step(batch, 0)
        two = trainer_state(trainer, 0)
        other = trainer_state(trainer, 1)
        grads_two = trainer_gradients(trainer, 0)
    assert len(stats.workers) == 2 and all(w["sequences"] > 0 for w in stats.workers)
    assert all(0 < w["max_call_tokens"] <= 5 for w in stats.workers)  # blocks reached them
    assert sum(w["sequences"] for w in stats.workers) == len(batch)
    assert_identical(two["model"], other["model"], "replicas")  # both ranks stepped alike

    threads = torch.get_num_threads()
    try:
        one = local_worker(cfg)  # the single-worker path, in this process
        one.step(0, batch, None)
    finally:
        torch.set_num_threads(threads)  # the worker sets its own thread count
    grads_one, state_one = gradients(one), state(one)["model"]

    model = build_replica(cfg)
    opt = make_optimizer(model, cfg.optimizer)
    opt.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model, batch, make_training_loss(cfg))
    grads_ref = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    clip_and_step(model, opt, cfg.optimizer.max_grad_norm)
    state_ref = {k: v.detach() for k, v in model.state_dict().items()}

    assert stats.loss == pytest.approx(ref.loss, rel=1e-5)
    assert rel_l2(grads_two, grads_ref) <= 1e-5
    assert rel_l2(grads_one, grads_ref) <= 1e-5
    assert rel_l2(two["model"], state_one) <= 1e-5
    assert rel_l2(two["model"], state_ref) <= 1e-5
    # The updates themselves (not only the parameters) agree, and are not zero.
    upd = lambda s: {k: s[k].double() - init[k].double() for k in init}  # noqa: E731
    assert rel_l2(upd(two["model"]), upd(state_ref)) <= 1e-4
    assert rel_l2(upd(state_one), upd(state_ref)) <= 1e-4
    assert rel_l2(two["model"], init) > 1e-4


@pytest.mark.ray
def test_worker_death_changes_nothing_and_resume_matches(ray_local, tmp_path):
    cfg = tiny_cfg(f"train.checkpoint_dir={tmp_path / 'ckpt'}", "optimizer.lr=1e-3")
    source = BatchSource(cfg, 512)
    b0, b1 = source.batch(0), source.batch(1)

    with Trainer(cfg) as uninterrupted:
        uninterrupted.step(b0, 0)
        uninterrupted.step(b1, 1)
        reference = trainer_state(uninterrupted, 0)

    with Trainer(cfg, fault={"rank": 1, "step": 1}) as trainer:
        trainer.step(b0, 0)
        path = trainer.save()
        assert os.path.basename(path) == "step-000001"
        before = trainer_state(trainer, 0)
        with pytest.raises(StepFailed) as info:
            trainer.step(b1, 1)
        message = str(info.value)
        assert "step 1" in message and "worker 1" in message and "died" in message
        assert "no worker applied the update" in message
        assert info.value.applied == [] and info.value.step == 1
        after = trainer_state(trainer, 0)  # the survivor
        assert_identical(before, after, "state")  # parameters and optimizer: bit-identical
        with pytest.raises(Exception, match="recover"):
            trainer.step(b1, 1)  # refuses to go on with a broken group

        trainer.fault = None
        meta = trainer.recover()  # new workers from the last checkpoint
        assert meta["step"] == 1 and trainer.completed_steps == 1
        trainer.step(b1, 1)
        resumed = trainer_state(trainer, 0)
        assert len(set(trainer_digests(trainer))) == 1
    assert_identical(resumed, reference, "resumed vs uninterrupted")
    with pytest.raises(AssertionError):
        assert_identical(before, reference)  # the comparison can fail: the step changed things


@pytest.mark.ray
def test_streaming_trains_every_rollout_once(ray_local):
    from experiments.workloads import make_workload

    records = []
    for seed in range(3):
        records += make_workload("tau2-airline", "tiny", seed=seed, vocab_size=512).records
    for uid, rec in enumerate(records):
        rec["uid"] = uid
    target = 8
    q: queue.Queue = queue.Queue()

    def produce():
        for rec in records:
            q.put(rec)
            time.sleep(0.005)
        q.put(END)

    producer = threading.Thread(target=produce, daemon=True)
    seen = []

    def on_step(sb, stats):
        seen.append((sb, stats))

    with Trainer(tiny_cfg()) as trainer:
        producer.start()
        trainer.train_stream(q, target_sequences=target, on_step=on_step)
    producer.join(timeout=30)

    n = len(records)
    assert len(seen) == -(-n // target) and len(seen) >= 3
    uids = [r["uid"] for sb, _ in seen for r in sb.records]
    assert uids == list(range(n))  # every rollout once, in arrival order
    for k, (sb, stats) in enumerate(seen):
        last = k == len(seen) - 1
        assert len(sb.records) == (n - target * k if last else target)
        assert sb.received == min(n, target * (k + 1))  # cut exactly when the target is met
        assert sb.reason == ("end" if last and n % target else "sequences")
        assert stats.sequences == len(sb.records)
        assert sum(w["sequences"] for w in stats.workers) == len(sb.records)
        assert sum(w["tokens"] for w in stats.workers) == sb.tokens == stats.total_tokens


# ------------------------------------------------------------ ray job submission --
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _started_processes(session: int, temp_dir: str) -> list:
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(proc.pid) == session or any(
                    temp_dir in (c or "") for c in proc.info["cmdline"] or []):
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
    found.pop(os.getpid(), None)
    return list(found.values())


def _kill(processes) -> None:
    import psutil

    for proc in processes:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=15)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_submit_job_to_a_loopback_head():
    temp_dir = tempfile.mkdtemp(prefix="dta-head-", dir="/tmp")
    token = os.path.join(temp_dir, "auth_token")
    with open(token, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(token, 0o600)
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN_PATH=token, RAY_USAGE_STATS_ENABLED="0",
               PATH=bindir + os.pathsep + env.get("PATH", ""))
    gcs, dash = _free_port(), _free_port()
    cmd = [os.path.join(bindir, "ray"), "start", "--head", "--node-ip-address=127.0.0.1",
           f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={_free_port()}",
           f"--ray-client-server-port={_free_port()}", f"--temp-dir={temp_dir}",
           "--num-cpus=2", f"--object-store-memory={100 * 2 ** 20}", "--disable-usage-stats"]
    head = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    started = []
    try:
        out, _ = head.communicate(timeout=180)
        assert head.returncode == 0, out[-3000:]
        started = _started_processes(head.pid, temp_dir)
        listeners = listening_addresses([p.pid for p in started])
        assert any(x.port == dash for x in listeners), "the dashboard is not listening"
        assert any(x.port == gcs for x in listeners), "the GCS is not listening"
        bad = [x for x in listeners if not x.loopback]
        assert not bad, f"listening beyond loopback: {bad}"

        address = f"http://127.0.0.1:{dash}"
        dta = [sys.executable, "-m", "dta_cli"]  # the `dta` command
        sub = subprocess.run(
            dta + ["submit", "--address", address, "--config",
                    os.path.join(ROOT, "configs", "default.yaml"), "--timeout", "400",
                    "workload.scale=tiny", "train.steps=2"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=500)
        assert sub.returncode == 0, sub.stdout[-3000:] + sub.stderr[-3000:]
        assert "SUCCEEDED" in sub.stdout
        job_id = re.search(r"submitted job (\S+)", sub.stdout).group(1)

        logs = subprocess.run(dta + ["jobs", "logs", job_id, "--address", address], env=env,
                              capture_output=True, text=True, timeout=60)
        assert logs.returncode == 0, logs.stderr
        assert "2 steps on 2 workers" in logs.stdout and "sharing ratio" in logs.stdout
        status = subprocess.run(dta + ["jobs", "status", job_id, "--address", address],
                                env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "SUCCEEDED" in status.stdout

        # Without the token the job API refuses (what token auth buys on a shared machine).
        no_auth = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
        no_auth["HOME"] = temp_dir  # no ~/.ray/auth_token to fall back on
        refused = subprocess.run(dta + ["jobs", "status", job_id, "--address", address],
                                 env=no_auth, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0
    finally:
        if head.poll() is None:
            head.kill()
        _kill(started + _started_processes(head.pid, temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not _started_processes(head.pid, temp_dir), "processes of the head survived"

"""A run owns its checkpoint folder from its first second (issue 42): two runs started
together on one folder never mix — exactly one trains, the other is refused before its first
step in one line naming the owner and how to resume it, and nothing of it reaches the
winner's files (metrics included) — while a run that stopped (ended, crashed, SIGKILLed)
leaves its folder to be resumed, or taken over if it saved nothing.

The races run what `dta train` does at its start (runtime.ray_runtime.run.run_training:
claim the folder, open the metrics log, write step 0's row) in real processes started
together; one test runs a loser through the real `dta train` entry, and a ``slow`` one races
two whole `dta train` processes on Ray and resumes the winner."""
from __future__ import annotations

import csv
import errno
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from runtime.checkpoints import checkpoint as ckpt
from runtime.checkpoints import claim, whole
from runtime.checkpoints.checkpoint import CheckpointError
from runtime.ray_runtime.metrics import MetricsLog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["workload.scale=tiny", "ray.num_workers=1", "ray.object_store_memory=104857600",
        "optimizer.lr=1e-3"]
FORK = multiprocessing.get_context("fork")  # the children only claim folders and write rows
IN_USE = "is in use by run {} (pid {} on "


def tiny_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def start_of_a_run(d: str, start, go_on, out) -> None:
    """`dta train`'s start (run_training): claim, metrics log, step 0's row; the winner then
    holds the folder until the test lets it go."""
    start.wait(timeout=60)
    try:
        run = ckpt.prepare_run(d, resume=False)
    except CheckpointError as exc:
        out.put(("refused", os.getpid(), str(exc)))
        return
    log = MetricsLog(d, run_id=run.run_id)
    log.write({"step": 0, "loss": 1.0, "workers": []})
    log.close()
    out.put(("trains", os.getpid(), run.run_id))
    go_on.wait(timeout=60)
    run.release()


def metrics_rows(d: str) -> tuple[list[dict], list[dict]]:
    with open(os.path.join(d, "metrics.jsonl")) as f:
        jsonl = [json.loads(line) for line in f]
    with open(os.path.join(d, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    return jsonl, rows


@pytest.mark.parametrize("round_", range(3))
def test_two_runs_started_together_one_trains_the_other_is_refused(tmp_path, round_):
    d = str(tmp_path / "ck")
    if round_:  # an empty folder (the first round: a missing one, both create it)
        os.mkdir(d)
    start, go_on, out = FORK.Barrier(2), FORK.Event(), FORK.Queue()
    procs = [FORK.Process(target=start_of_a_run, args=(d, start, go_on, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    (refused, loser, message), (trains, winner, run_id) = results
    assert (refused, trains) == ("refused", "trains"), results
    # the loser: one line naming the live owner and how to continue it
    assert message.startswith(f"checkpoint folder {d!r} " + IN_USE.format(run_id, winner))
    assert f"train.checkpoint_dir={d} train.resume=true" in message and "\n" not in message
    # the winner goes on: its first checkpoint, saved (by its worker) while it holds the folder
    whole.save_checkpoint(d, 1, *tiny_state(), run_id=run_id)
    go_on.set()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(os.listdir(d)) == ["latest", "metrics.csv", "metrics.jsonl", "run.json",
                                     "step-000001"]  # nothing of the loser's
    jsonl, rows = metrics_rows(d)
    assert [(r["step"], r["run_id"]) for r in jsonl] == [(0, run_id)] and len(rows) == 1
    # the winner, stopped, is resumed: same run, from its checkpoint, same metrics files
    resumed = ckpt.prepare_run(d, resume=True)
    try:
        assert resumed.run_id == run_id and resumed.resumed_from.endswith("step-000001")
        log = MetricsLog(d, run_id=resumed.run_id)
        log.write({"step": 1, "loss": 0.5, "workers": []})
        log.close()
    finally:
        resumed.release()
    jsonl, rows = metrics_rows(d)
    assert [(r["step"], r["run_id"]) for r in jsonl] == [(0, run_id), (1, run_id)]
    assert [r["step"] for r in rows] == ["0", "1"]


def hold(d: str, out, resume: bool = False) -> None:
    run = ckpt.prepare_run(d, resume=resume)
    out.put(run.run_id)
    signal.pause()  # until killed


def killed_holder(d: str):
    out = FORK.Queue()
    p = FORK.Process(target=hold, args=(d, out))
    p.start()
    return p, out.get(timeout=60)


def test_a_sigkilled_run_leaves_its_folder_resumable(tmp_path):
    d = str(tmp_path / "ck")
    p, run_id = killed_holder(d)
    try:
        for resume in (False, True):  # while it lives, neither a new run nor a resume
            with pytest.raises(CheckpointError, match=re.escape(IN_USE.format(run_id, p.pid))):
                ckpt.prepare_run(d, resume=resume)
        whole.save_checkpoint(d, 1, *tiny_state(), run_id=run_id)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=60)
    assert p.exitcode == -signal.SIGKILL
    with pytest.raises(CheckpointError, match=f"already holds run {run_id}, latest step-000001; "
                                              "a new run would overwrite it"):
        ckpt.prepare_run(d, resume=False)
    again = ckpt.prepare_run(d, resume=True)  # nothing stuck: the kernel let the lock go
    assert again.run_id == run_id and again.resumed_from.endswith("step-000001")
    assert ckpt.read_run(d)["pid"] == os.getpid()
    again.release()


def test_a_run_killed_before_its_first_save_leaves_the_folder_to_the_next(tmp_path):
    d = str(tmp_path / "ck")
    p, run_id = killed_holder(d)
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=60)
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        ckpt.prepare_run(d, resume=True)
    nxt = ckpt.prepare_run(d, resume=False)
    assert nxt.run_id != run_id and ckpt.read_run(d)["run_id"] == nxt.run_id
    nxt.release()
    assert sorted(os.listdir(d)) == ["run.json"]


def test_the_loser_of_dta_train_exits_before_its_first_step_naming_the_owner(tmp_path):
    """The real `dta train` entry, in its own process, on a folder a live run holds: exit 1,
    one line, nothing written there, no Ray started."""
    d = str(tmp_path / "ck")
    owner = ckpt.prepare_run(d, resume=False)
    try:
        run = subprocess.run([sys.executable, "-m", "dta_cli", "train", "--no-progress", *TINY,
                              "train.steps=2", f"train.checkpoint_dir={d}"],
                             capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                             env={**os.environ, "PYTHONPATH": ROOT})
    finally:
        owner.release()
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert lines[0].startswith(f"dta train: error: checkpoint folder {d!r} "
                               + IN_USE.format(owner.run_id, os.getpid()))
    assert lines[0].endswith(f"continue it with train.checkpoint_dir={d} train.resume=true; "
                             "or choose another folder")
    assert "starting Ray" not in run.stderr and sorted(os.listdir(d)) == ["run.json"]
    assert ckpt.read_run(d)["run_id"] == owner.run_id


def test_submit_refuses_a_folder_a_live_run_holds(tmp_path):
    from dta.config.schema import ConfigError, load_config
    from dta_cli.jobs import ship_paths

    d = str(tmp_path / "ck")
    owner = ckpt.prepare_run(d, resume=False)
    with pytest.raises(ConfigError, match=f"is in use by run {owner.run_id} "):
        ship_paths(load_config(None, [f"train.checkpoint_dir={d}"]))
    assert claim.live_owner(d)["run_id"] == owner.run_id
    owner.release()
    assert claim.live_owner(d) is None
    ship_paths(load_config(None, [f"train.checkpoint_dir={d}"]))  # a stopped run: fine


def test_saves_without_a_claim_name_the_folder_once(tmp_path, monkeypatch):
    """The Python API (no prepare_run): the first save creates run.json exclusively; another
    run's save is refused, a save without a run id joins the folder's run."""
    d = str(tmp_path / "ck")
    model, opt = tiny_state()
    whole.save_checkpoint(d, 1, model, opt, run_id="first")
    with pytest.raises(CheckpointError, match="belongs to run first, not to this run "
                                              r"\(second\); refusing to mix two runs"):
        whole.save_checkpoint(d, 2, model, opt, run_id="second")
    assert ckpt._manifest_run(whole.save_checkpoint(d, 2, model, opt)) == "first"
    d = str(tmp_path / "raced")  # the race: another save names the new folder first
    real = claim._publish

    def first_elsewhere(directory, record, *, exclusive):
        real(directory, {**record, "run_id": "other"}, exclusive=True)
        return real(directory, record, exclusive=exclusive)

    monkeypatch.setattr(claim, "_publish", first_elsewhere)
    with pytest.raises(CheckpointError, match="belongs to run other, not to this run"):
        whole.save_checkpoint(d, 1, model, opt, run_id="first")
    assert ckpt.read_run(d)["run_id"] == "other" and ckpt.checkpoints(d) == []


def test_without_file_locks_a_new_run_is_refused_and_a_resume_proceeds(tmp_path, monkeypatch):
    """A filesystem without flock (some network mounts): creation stays exclusive, but a
    stopped run cannot be told from a live one."""
    d = str(tmp_path / "ck")

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(claim.fcntl, "flock", no_locks)
    first = ckpt.prepare_run(d, resume=False)
    assert not first.claim.locked
    with pytest.raises(CheckpointError, match=f"holds run {first.run_id} .*no file locks"):
        ckpt.prepare_run(d, resume=False)
    whole.save_checkpoint(d, 1, *tiny_state(), run_id=first.run_id)
    assert ckpt.prepare_run(d, resume=True).run_id == first.run_id


def test_without_hard_links_run_json_is_created_exclusively_in_place(tmp_path, monkeypatch):
    d = str(tmp_path / "ck")

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(claim.os, "link", no_links)
    first = ckpt.prepare_run(d, resume=False)
    assert first.claim.locked and ckpt.read_run(d)["run_id"] == first.run_id
    with pytest.raises(CheckpointError, match=re.escape(IN_USE.format(first.run_id, os.getpid()))):
        ckpt.prepare_run(d, resume=False)
    assert sorted(os.listdir(d)) == ["run.json"]
    first.release()


@pytest.mark.slow
@pytest.mark.ray
def test_two_dta_train_processes_started_together_then_the_winner_resumes(tmp_path):
    """Two whole `dta train` runs on one empty folder, started together (35-70 s on a 2-core
    box: the winner trains on Ray, then resumes)."""
    d = str(tmp_path / "ck")
    os.mkdir(d)
    env = {**os.environ, "PYTHONPATH": ROOT}
    argv = [sys.executable, "-m", "dta_cli", "train", "--no-progress", "--json", *TINY,
            f"train.checkpoint_dir={d}"]
    procs = [subprocess.Popen(argv + ["train.steps=2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
             for _ in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    done = [(p.returncode, p.pid, *o) for p, o in zip(procs, outputs)]
    assert sorted(x[0] for x in done) == [0, 1], [x[3][-2000:] for x in done]
    (_, winner, out, _), = [x for x in done if x[0] == 0]
    (_, _, _, err), = [x for x in done if x[0] == 1]
    run_id = json.loads(out.strip().splitlines()[-1])["run_id"]
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and IN_USE.format(run_id, winner) in errors[0], err
    assert "train.resume=true" in errors[0] and "starting Ray" not in err
    jsonl, rows = metrics_rows(d)
    assert [(r["step"], r["run_id"]) for r in jsonl] == [(0, run_id), (1, run_id)]
    assert [r["step"] for r in rows] == ["0", "1"]
    resumed = subprocess.run(argv + ["train.steps=3", "train.resume=true"], capture_output=True,
                             text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["run_id"] == run_id and summary["first_step"] == 2
    jsonl, _ = metrics_rows(d)
    assert [(r["step"], r["run_id"]) for r in jsonl] == [(k, run_id) for k in range(3)]

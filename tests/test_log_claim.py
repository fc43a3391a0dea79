"""A ``train.log_dir`` apart from the checkpoint folder is the run's from its first second too
(issue 42: "nothing of the loser reaches the winner's files, metrics included"): two runs with
their own checkpoint folders and one log folder, started together, never mix rows; a new run
is refused a log folder holding another run's rows, a resume continues its own.

The runs do what `dta train` does at its start (runtime.ray_runtime.run.claim_folders, then
the metrics log) in real processes started together."""
from __future__ import annotations

import json
import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch

from runtime.checkpoints import checkpoint as ckpt
from runtime.checkpoints import whole
from runtime.checkpoints.folders import CheckpointError
from runtime.ray_runtime.metrics import MetricsLog
from runtime.ray_runtime.run import claim_folders

FORK = multiprocessing.get_context("fork")


def settings(checkpoint_dir=None, log_dir=None, resume=False):
    return SimpleNamespace(checkpoint_dir=checkpoint_dir, log_dir=log_dir, resume=resume)


def start(t, step: int = 0):
    """`dta train`'s start: claim the folders, write one metrics row; returns what it holds."""
    run, logs = claim_folders(t)
    run_id = run.run_id if run else logs.run_id
    log = MetricsLog(str(t.log_dir), run_id=run_id)
    log.write({"step": step, "loss": 1.0, "workers": []})
    log.close()
    return run, logs, run_id


def release(*held):
    for h in held:
        if h is not None:
            h.release()


def rows(d) -> list[tuple[int, str]]:
    with open(os.path.join(d, "metrics.jsonl")) as f:
        return [(r["step"], r.get("run_id")) for r in map(json.loads, f)]


def racer(t, barrier, go_on, out) -> None:
    barrier.wait(timeout=60)
    try:
        run, logs, run_id = start(t)
    except CheckpointError as exc:
        out.put(("refused", os.getpid(), str(exc)))
        return
    out.put(("trains", os.getpid(), run_id))
    go_on.wait(timeout=60)
    release(logs, run)


@pytest.mark.parametrize("round_", range(3))
def test_two_runs_with_one_log_folder_started_together_never_mix(tmp_path, round_):
    logs = str(tmp_path / "logs")
    folders = [str(tmp_path / f"ck{i}") for i in range(2)]
    if round_:  # empty checkpoint folders (the first round: missing ones)
        for d in folders:
            os.mkdir(d)
    barrier, go_on, out = FORK.Barrier(2), FORK.Event(), FORK.Queue()
    procs = [FORK.Process(target=racer, args=(settings(d, logs), barrier, go_on, out))
             for d in folders]
    for p in procs:
        p.start()
    (refused, _, message), (trains, winner, run_id) = sorted(out.get(timeout=60) for _ in procs)
    assert (refused, trains) == ("refused", "trains")
    assert message.startswith(f"train.log_dir {logs!r} is in use by run {run_id} (pid {winner}")
    assert "\n" not in message
    go_on.set()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert rows(logs) == [(0, run_id)]  # nothing of the loser's
    # the loser left its checkpoint folder as it found it: missing, or empty
    won = [d for d in folders if os.path.isdir(d) and os.listdir(d)]
    assert len(won) == 1 and ckpt.read_run(won[0])["run_id"] == run_id
    lost = [d for d in folders if d != won[0]]
    assert (os.listdir(lost[0]) == []) if round_ else not os.path.lexists(lost[0])


def test_a_new_run_is_refused_a_log_folder_of_another_runs_rows_and_a_resume_continues(tmp_path):
    logs, first, other = (str(tmp_path / n) for n in ("logs", "ck-a", "ck-b"))
    run, held, run_id = start(settings(first, logs))
    model = torch.nn.Linear(2, 2)
    whole.save_checkpoint(first, 1, model, torch.optim.SGD(model.parameters(), lr=0.1),
                         run_id=run_id)
    release(held, run)
    with pytest.raises(CheckpointError) as err:
        claim_folders(settings(other, logs))
    message = str(err.value)
    assert message.startswith(f"train.log_dir {os.path.abspath(logs)!r} already holds the "
                              f"metrics of run {run_id} (metrics.jsonl, metrics.csv")
    assert "train.resume=true" in message and "\n" not in message
    assert not os.path.lexists(other)  # the refused run left nothing behind
    run, held, again = start(settings(first, logs, resume=True), step=1)
    release(held, run)
    assert again == run_id and rows(logs) == [(0, run_id), (1, run_id)]


def test_a_resume_is_refused_a_log_folder_of_another_runs_rows(tmp_path):
    logs = str(tmp_path / "logs")
    release(*start(settings(log_dir=logs))[:2])  # a run without a checkpoint folder
    owner = rows(logs)[0][1]
    first = str(tmp_path / "ck")
    run, _ = claim_folders(settings(first))
    model = torch.nn.Linear(2, 2)
    whole.save_checkpoint(first, 1, model, torch.optim.SGD(model.parameters(), lr=0.1),
                         run_id=run.run_id)
    release(run)
    before = sorted(os.listdir(first))
    with pytest.raises(CheckpointError, match=f"metrics of run {owner} "):
        claim_folders(settings(first, logs, resume=True))
    assert sorted(os.listdir(first)) == before == ["latest", "run.json", "step-000001"]
    assert ckpt.read_run(first)["run_id"] == run.run_id  # still its run's, resumable
    release(claim_folders(settings(first, resume=True))[0])


def test_a_run_without_a_checkpoint_folder_names_its_rows_and_owns_its_log_folder(tmp_path):
    logs = str(tmp_path / "logs")
    run, held, run_id = start(settings(log_dir=logs))
    try:
        assert run is None and len(run_id) == 32 and rows(logs) == [(0, run_id)]
        with pytest.raises(CheckpointError, match=f"is in use by run {run_id} "):
            claim_folders(settings(log_dir=logs))  # while it runs
    finally:
        release(held)
    with pytest.raises(CheckpointError, match=f"already holds the metrics of run {run_id} "):
        claim_folders(settings(log_dir=logs))  # after it ended: its rows stay its own


def test_rows_of_an_unknown_run_are_not_joined(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.csv").write_text("step,loss\n0,1.0\n")  # no run.json, no run id
    with pytest.raises(CheckpointError, match="metrics of another run \\(metrics.csv\\); "):
        claim_folders(settings(log_dir=str(logs)))
    assert sorted(os.listdir(logs)) == ["metrics.csv"]  # nothing written


@pytest.mark.parametrize("spelling", ["same", "relative", "link"])
def test_a_log_folder_that_is_the_checkpoint_folder_is_claimed_once(tmp_path, monkeypatch,
                                                                    spelling):
    monkeypatch.chdir(tmp_path)
    ck = str(tmp_path / "ck")
    log_dir = {"same": ck, "relative": "ck", "link": str(tmp_path / "ln")}[spelling]
    if spelling == "link":
        os.mkdir(ck)
        os.symlink(ck, log_dir)
    run, logs = claim_folders(settings(ck, log_dir))
    release(logs, run)
    assert logs is None and run.run_id


def test_submit_refuses_a_log_folder_a_live_run_holds(tmp_path):
    from dta.config.schema import ConfigError, load_config
    from dta_cli.jobs import ship_paths

    logs = str(tmp_path / "logs")
    run, held, run_id = start(settings(log_dir=logs))
    keys = [f"train.log_dir={logs}", f"train.checkpoint_dir={tmp_path / 'ck'}"]
    with pytest.raises(ConfigError, match=f"^train.log_dir {logs!r} is in use by run {run_id} "):
        ship_paths(load_config(None, keys))
    release(held)
    ship_paths(load_config(None, keys))  # stopped: the run itself says what its rows are

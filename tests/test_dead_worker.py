"""A dead worker is the first thing a failure's line says (issue 55).

Which worker (rank, pid, node), how it ended as far as Ray knows (killed or crashed, an exit
code, Ray's memory monitor), then briefly what the survivors saw -- without gloo's source
paths or emoji (the whole texts go to ``failures.log``). A save that completed is not
reported as failed. On Ray: one worker of a sharded (zero1) run SIGKILLed, in a step and
before a save; the 4-worker offloaded HSDP run of the issue is slow.
"""
from __future__ import annotations

import os
import signal

import pytest

from dta.config.schema import load_config
from dta_cli.batches import BatchSource
from runtime.errors import StepFailed, WorkerError, brief, how_it_died
from runtime.ray_runtime.failures import explain, failure_message

GLOO = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:41234: Connection reset by peer\nException raised from recv at "
        "/pytorch/x.cpp:12 GLHF! \U0001f3d6\ufe0f")
KILLED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: DFSWorker\n"
          "The actor is dead because its worker process has died. Worker exit type: "
          "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error "
          "code 2. End of file. Some common causes include: (1) the process was killed by the "
          "OOM killer due to high memory usage")
INFOS = [{"pid": 100 + r, "ip": f"10.0.0.{r}"} for r in range(4)]


def test_how_a_worker_ended():
    assert how_it_died(KILLED).startswith("its process was killed or crashed (a signal such "
                                          "as SIGKILL")
    assert how_it_died("Worker exit type: USER_ERROR Worker exit detail: Worker exits with "
                       "an exit code 3. The worker raised") == \
        "its process exited with code 3 (Ray: USER_ERROR)"
    assert how_it_died("Task was killed due to the node running low on memory.") == \
        "killed by Ray's memory monitor: the node ran out of memory"
    assert brief(GLOO) == "RuntimeError: Read error [127.0.0.1]:41234: Connection reset by peer"


def test_the_dead_worker_leads_the_line():
    failures = {0: ("raised", GLOO), 2: ("died", how_it_died(KILLED)), 3: ("raised", GLOO)}
    culprit, line = explain("saving checkpoint step-000006 in '/runs/a'", failures, INFOS)
    assert culprit == 2
    assert line.startswith("worker 2 (pid 102 on 10.0.0.2) died while saving checkpoint "
                           "step-000006 in '/runs/a': its process was killed or crashed"), line
    assert line.endswith("; then workers [0, 3] raised RuntimeError: Read error "
                         "[127.0.0.1]:41234: Connection reset by peer"), line
    assert "pair.cc" not in line and "GLHF" not in line and line.isascii()
    message, culprit, kind, applied = failure_message(5, {1: {"updated": False}}, failures,
                                                      INFOS, "/runs/a/step-000005")
    assert message.startswith("worker 2 (pid 102 on 10.0.0.2) died during step 5: its "), message
    assert (culprit, kind, applied) == (2, "died", [])
    # no death: the raised cause in full first, as before
    _, line = explain("saving x", {1: ("raised", "OSError: [Errno 28] no space: '/a/b'")}, INFOS)
    assert line == "saving x failed on worker 1 (pid 101 on 10.0.0.1): OSError: [Errno 28] " \
                   "no space: '/a/b'"


# ----------------------------------------------------------------------------- on Ray --
def _cfg(tmp_path, workers, *extra):
    return load_config(None, ["workload.scale=tiny", f"ray.num_workers={workers}",
                              "ray.object_store_memory=104857600", "train.sharding=zero1",
                              f"train.checkpoint_dir={tmp_path / 'ck'}", *extra])


def _kill(trainer, rank) -> int:
    pid = int(trainer.infos[rank]["pid"])
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.ray
def test_a_killed_worker_of_a_sharded_run_is_named_first(tmp_path):
    from runtime.ray_runtime.driver import Trainer

    cfg = _cfg(tmp_path, 2)
    source = BatchSource(cfg, 512)
    with Trainer(cfg) as trainer:
        trainer.step(source.batch(0), 0)
        saved = trainer.save()
        pid = _kill(trainer, 1)
        with pytest.raises(StepFailed) as info:
            trainer.step(source.batch(1), 1)
        line = str(info.value)
        print(line)
        assert line.startswith(f"worker 1 (pid {pid} on ") and " died during step 1: its " \
            "process was killed or crashed" in line, line
        assert "pair.cc" not in line and line.isascii(), line
        assert saved in line  # what to resume from
        assert set(info.value.full) >= {1}  # the whole text, for failures.log


@pytest.mark.slow
@pytest.mark.ray
def test_a_killed_worker_of_an_offloaded_hsdp_run_before_a_save(tmp_path):
    """The issue's run: 4 workers, zero1 HSDP (shard_size=2) with the optimizer offloaded;
    worker 2 SIGKILLed, then a save: worker 2 leads the line, the survivors' gloo errors
    follow briefly, and the newest complete checkpoint is named, never called failed."""
    from runtime.checkpoints import checkpoint as ckpt
    from runtime.ray_runtime.driver import Trainer

    cfg = _cfg(tmp_path, 4, "train.shard_size=2", "train.offload=optimizer")
    source = BatchSource(cfg, 512)
    run = ckpt.prepare_run(cfg.train.checkpoint_dir, resume=False)  # the folder is the run's
    with Trainer(cfg) as trainer:
        trainer.run_id = run.run_id
        trainer.step(source.batch(0), 0)
        first = trainer.save()
        trainer.step(source.batch(1), 1)
        pid = _kill(trainer, 2)
        with pytest.raises(WorkerError) as info:
            trainer.save()
        line = str(info.value)
        print(line)
        assert line.startswith(f"worker 2 (pid {pid} on "), line
        assert " died while " in line and "pair.cc" not in line and line.isascii(), line
        assert f"the newest complete checkpoint is still {first!r}" in line or \
            "saved complete" in line, line
    run.release()

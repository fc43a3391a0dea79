"""Failures a user can act on (issue 26): a full disk during a checkpoint save is one line
naming the cause and the folder, and leaves the previous checkpoint intact and resumable; a
checkpoint folder DTA does not own is refused before step 0 with nothing written in it;
keep-last-N deletes only its own run's checkpoints; a worker's error (Ray's, DCP's,
safetensors') is described in one line with its cause.

The full-disk tests mount small tmpfs folders in a private mount namespace (``unshare -m``,
root needed): tests/fulldisk_save.py (save_checkpoint alone, no Ray; default suite) and
tests/fulldisk.py (`dta train` end to end on Ray, then train.resume=true; ``slow``)."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from runtime.checkpoints import checkpoint as ckpt
from runtime.checkpoints import whole
from runtime.checkpoints.checkpoint import CheckpointError
from runtime.errors import describe, first_line, storage_failure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["workload.scale=tiny", "ray.num_workers=1", "ray.object_store_memory=104857600"]


def in_mount_namespace(script: str, root, timeout: int) -> dict:
    """Run tests/<script> in a private mount namespace; its JSON facts."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the full disk is a tmpfs in a private mount "
                    "namespace")
    run = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable,
                          os.path.join(ROOT, "tests", script), str(root)],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_full_disk_during_first_and_later_save_names_the_file_and_keeps_the_last(tmp_path):
    facts = in_mount_namespace("fulldisk_save.py", tmp_path, 300)
    first, later = facts["first"], facts["later"]
    (failed,) = first["tries"]
    assert failed["raised"] == "OSError"  # not torch's "unexpected pos 576 vs 534"
    assert failed["message"].startswith("[Errno 28] No space left on device: ")
    assert f"{tmp_path}/first/ck/.tmp-step-000001-" in failed["message"]
    assert first["files"] == ["run.json"] and first["latest"] is None  # no half checkpoint
    ok, failed = later["tries"]
    assert ok["raised"] is None and failed["raised"] == "OSError"
    assert "No space left on device" in failed["message"]
    assert f"{tmp_path}/later/ck/.tmp-step-000002-" in failed["message"]
    assert later["files"] == ["latest", "run.json", "step-000001"]  # the .tmp-* is removed
    assert later["latest"].endswith("step-000001")
    assert later["loaded_step"] == 1 and later["same_weights"]  # verified, loadable, intact


@pytest.mark.slow
@pytest.mark.ray
def test_full_disk_in_dta_train_is_one_line_and_resumable(tmp_path):
    """`dta train` end to end (~30-90 s: three runs on Ray inside the namespace)."""
    facts = in_mount_namespace("fulldisk.py", tmp_path, 600)
    for case, step, left in (("first", "step-000001", "no checkpoint was written"),
                             ("later", "step-000002", "the newest complete checkpoint is "
                              f"still '{tmp_path}/later/ck/step-000001'")):
        run = facts[case]
        errors = [line for line in run["stderr"].splitlines() if "error" in line]
        assert run["rc"] == 1 and len(errors) == 1, run["stderr"]
        line = errors[0]
        assert line.startswith(f"dta train: error: saving checkpoint {step} in "
                               f"'{tmp_path}/{case}/ck' failed on worker 0 (pid ")
        assert "OSError: [Errno 28] No space left on device: " in line and left in line
        assert "\x1b[" not in run["stderr"] and "repr=" not in line and "actor_id" not in line
        assert not [f for f in run["files"] if f.startswith(".")]
    # no checkpoint folder claimed; the failure's full text kept in failures.log (issue 55)
    assert facts["first"]["files"] == ["failures.log", "metrics.csv", "metrics.jsonl", "run.json"]
    assert facts["later"]["latest"].endswith("step-000001")
    assert facts["later"]["verified_step"] == 1
    resumed = facts["resumed"]
    assert resumed["rc"] == 0, resumed["stderr"]
    assert resumed["summary"]["first_step"] == 1 and resumed["summary"]["completed_steps"] == 3
    assert "step-000003" in resumed["files"] and "step-000001" not in resumed["files"]


def snapshot(root) -> dict:
    return {os.path.relpath(os.path.join(b, n), root): os.lstat(os.path.join(b, n)).st_mtime_ns
            for b, dirs, files in os.walk(root) for n in dirs + files}


@pytest.mark.parametrize("resume", [False, True])
def test_foreign_folder_is_refused_before_step_0_with_nothing_written(tmp_path, resume):
    from dta_cli.train import main

    foreign = tmp_path / "etc"
    foreign.mkdir()
    for name in ("hosts", "fstab", "passwd", "group", "motd", "shells", "profile"):
        (foreign / name).write_text("not DTA's\n")
    (foreign / "step-000001").mkdir()  # even a name DTA uses: not its folder
    before = snapshot(foreign)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--no-progress", *TINY, f"train.checkpoint_dir={foreign}",
                   f"train.resume={str(resume).lower()}"])
    lines = err.getvalue().strip().splitlines()
    assert rc == 1 and len(lines) == 1, err.getvalue()
    assert lines[0] == (
        f"dta train: error: checkpoint folder '{foreign}' is not a DTA run folder (no run.json) "
        "and is not empty: it holds 8 entries: fstab, group, hosts, motd, passwd, profile, ... "
        "(2 more); DTA writes (and keep-last-N deletes) checkpoints only in a new, empty or DTA "
        "run folder: choose one")
    assert snapshot(foreign) == before  # nothing written, nothing deleted


def test_submit_refuses_a_foreign_folder_too(tmp_path):
    from dta.config.schema import ConfigError, load_config
    from dta_cli.jobs import ship_paths

    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"is not a DTA run folder .* 1 entry: notes.txt;"):
        ship_paths(load_config(None, [f"train.checkpoint_dir={tmp_path}"]))


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_keep_last_deletes_only_its_own_runs_checkpoints(tmp_path):
    d = str(tmp_path / "run")
    run = ckpt.prepare_run(d, resume=False)
    model, opt = tiny()
    whole.save_checkpoint(d, 1, model, opt)
    stranger = os.path.join(d, "step-000000")  # a checkpoint another run's manifest claims
    shutil.copytree(os.path.join(d, "step-000001"), stranger)
    ckpt.write_manifest(stranger, run_id="someone-else", step=0)
    for step in (2, 3, 4):
        whole.save_checkpoint(d, step, model, opt, keep_last=2)
    names = sorted(n for n in os.listdir(d) if n.startswith("step-"))
    assert names == ["step-000000", "step-000003", "step-000004"]  # its own: the newest 2
    assert ckpt._manifest_run(os.path.join(d, "step-000004")) == run.run_id


def test_a_run_folder_whose_first_save_failed_can_start_again(tmp_path):
    d = str(tmp_path / "run")
    first = ckpt.prepare_run(d, resume=False)  # run.json, then the first save failed
    with pytest.raises(CheckpointError, match=f"is in use by run {first.run_id} "):
        ckpt.prepare_run(d, resume=False)  # while it runs, it holds the folder
    first.release()  # and then it stopped
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        ckpt.prepare_run(d, resume=True)
    again = ckpt.prepare_run(d, resume=False)  # nothing to overwrite: a new run takes it
    assert again.run_id != first.run_id and ckpt.read_run(d)["run_id"] == again.run_id
    whole.save_checkpoint(d, 1, *tiny())
    again.release()
    with pytest.raises(CheckpointError, match=f"already holds run {again.run_id}"):
        ckpt.prepare_run(d, resume=False)


def test_causes_are_one_line_with_their_path():
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, "No space left on device",
                   "/ck/.tmp-step-000002-x/__0_0.distcp")
    assert describe(full) == ("OSError: [Errno 28] No space left on device: "
                              "'/ck/.tmp-step-000002-x/__0_0.distcp'")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([1, 0])\nTraceback...",
                                  {1: (ValueError("late"), None), 0: (full, None)})
    assert describe(wrapped) == describe(full)  # DCP's wrapper: rank 0's own error
    assert first_line(ValueError("\x1b[36mray::W.f()\x1b[39m boom\nmore")) == "ray::W.f() boom"
    # AReaL engine paths: storage failures say what was being done, keep errno and path
    out = storage_failure(wrapped, "saving the engine (dcp) to '/ck' on rank 0", "/ck")
    assert isinstance(out, OSError) and out.errno == errno.ENOSPC
    assert str(out) == ("[Errno 28] saving the engine (dcp) to '/ck' on rank 0 failed: No "
                        "space left on device: '/ck/.tmp-step-000002-x/__0_0.distcp'")
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os "
                        "error 28)")  # safetensors' SafetensorError text
    out = storage_failure(rust, "saving the engine (hf) to '/hf' on rank 0", "/hf")
    assert isinstance(out, OSError) and out.errno == 28 and out.filename == "/hf"
    assert "No space left on device" in str(out) and "\n" not in str(out)
    assert storage_failure(ValueError("weight_format='x'"), "saving", "/x") is None
    missing = storage_failure(FileNotFoundError(errno.ENOENT, "No such file or directory",
                                                "/hf/optim.pt"), "loading", "/hf")
    assert isinstance(missing, FileNotFoundError)  # the type a caller catches is kept


def test_debug_keeps_the_traceback_and_the_default_is_one_line():
    from dta_cli.train import main
    from runtime.errors import TrainingError

    args = ["--no-progress", *TINY, "train.resume=true"]  # fails before Ray: no folder given
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(args) == 1
    assert err.getvalue() == ("dta train: error: train.resume=true needs train.checkpoint_dir "
                              "(the folder to resume from)\n")
    with pytest.raises(TrainingError, match="needs train.checkpoint_dir"):
        main(["--debug", *args])  # raised: Python prints the (chained) traceback


@pytest.mark.slow
@pytest.mark.areal
def test_areal_engine_save_on_a_full_disk_is_one_line(tmp_path):
    """The AReaL engine's save (hf with the optimizer; dcp, whose CheckpointException is a
    multi-line BaseException) into a 64 KiB tmpfs (~35 s: builds the engine)."""
    pytest.importorskip("areal")
    facts = in_mount_namespace("fulldisk_areal.py", tmp_path, 600)
    for fmt in ("hf", "dcp"):
        got = facts[fmt]
        assert got["raised"] == "OSError" and got["errno"] == errno.ENOSPC, got
        assert got["message"].startswith(f"[Errno 28] saving the engine ({fmt}) to "
                                         f"'{tmp_path}/small/{fmt}' on rank 0 failed: No space "
                                         "left on device: "), got
        assert "\n" not in got["message"]
    assert facts["missing"]["message"] == (f"checkpoint path '{tmp_path}/small/missing' is not "
                                           "a local directory")

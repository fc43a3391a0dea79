"""Checkpoints you can trust (no Ray needed): tensors only, checksums, one run per folder,
retention, modes."""
import json
import os
import pickle
import stat

import numpy as np
import pytest
import torch

from runtime.checkpoints import checkpoint as ckpt
from runtime.checkpoints import whole
from runtime.checkpoints.checkpoint import CheckpointError


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(tmp_path):
    d = str(tmp_path / "run")
    run = ckpt.prepare_run(d, resume=False)
    model, opt = tiny()
    path = whole.save_checkpoint(d, 1, model, opt, {"note": "x"})
    run.release()  # the run has ended: its folder can be resumed (a live one cannot)
    return d, path, run, model, opt


class Planted:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_round_trip_restores_model_optimizer_and_rng(saved):
    d, path, run, model, opt = saved
    import random
    np.random.seed(5)
    whole.save_checkpoint(d, 2, model, opt)
    want = (torch.rand(2), np.random.rand(), random.random())
    fresh, fresh_opt = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    meta = whole.load_checkpoint(ckpt.latest_checkpoint(d), fresh, fresh_opt)
    assert meta["step"] == 2 and meta["run_id"] == run.run_id
    assert all(torch.equal(a, b) for a, b in zip(params(fresh).values(), params(model).values()))
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    got = (torch.rand(2), np.random.rand(), random.random())  # the RNGs continue as saved
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_one_format_every_file_checksummed(saved):
    d, path, run, model, opt = saved
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "manifest.json",
                                        "meta.json", "rng.pt"]  # the logical view as DCP
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert meta["format"] == "dcp" and meta["logical"] == 1 and meta["world_size"] == 1
    assert meta["optimizer_groups"][0]["lr"] == 1e-2 and meta["optimizer_groups"][0]["betas"] \
        == [0.9, 0.999]
    files = json.load(open(os.path.join(path, ckpt.MANIFEST)))["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "meta.json", "rng.pt"]


@pytest.mark.parametrize("planted", [".metadata", "rng.pt"])  # DCP's pickle; a torch.save
@pytest.mark.parametrize("fix_manifest", [False, True])
def test_planted_pickle_is_refused_and_nothing_runs(saved, tmp_path, fix_manifest, planted):
    d, path, run, model, opt = saved
    marker = tmp_path / "pwned"
    with open(os.path.join(path, planted), "wb") as f:
        pickle.dump({"state": Planted(str(marker)), "param_groups": []}, f)
    if fix_manifest:  # an attacker who also rewrites the manifest: the allow-lists refuse
        ckpt.write_manifest(path, run_id=run.run_id, step=1)
    target, target_opt = tiny()
    with torch.no_grad():
        target[0].weight.add_(3.0)
    before = params(target)
    with pytest.raises(CheckpointError) as info:
        whole.load_checkpoint(path, target, target_opt)
    assert planted in str(info.value)
    assert ("holds more than" in str(info.value)) if fix_manifest else (
        "SHA-256" in str(info.value) or "bytes" in str(info.value))
    assert not marker.exists()  # the payload never ran
    assert all(torch.equal(before[k], v) for k, v in params(target).items())  # untouched


def test_flipped_byte_is_detected(saved):
    d, path, run, model, opt = saved
    f = os.path.join(path, "__0_0.distcp")
    data = bytearray(open(f, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(f, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"file '__0_0.distcp' fails its SHA-256 check"):
        whole.load_checkpoint(path, *tiny())


def test_another_model_is_refused_before_anything_is_touched(saved):
    d, path, run, model, opt = saved
    other = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    before = params(other)
    with pytest.raises(CheckpointError, match=r"does not fit this run: parameter '0.bias' "
                                              r"has shape \(8,\) there and \(6,\) here"):
        whole.load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))
    assert all(torch.equal(before[k], v) for k, v in params(other).items())


def test_a_legacy_replica_checkpoint_still_loads(tmp_path):
    """A checkpoint DTA wrote up to 2026-12-07 (model.pt / optimizer.pt / rng.pt, built here in
    the old layout) loads through the one legacy reader: weights, moments, hyperparameters,
    RNG; another model is refused naming the version that wrote it."""
    from tests.legacy_checkpoints import write_legacy_replica

    model, opt = tiny()
    opt.param_groups[0]["lr"] = 3e-3  # a hyperparameter the fresh optimizer does not have
    torch.manual_seed(7)
    path = write_legacy_replica(str(tmp_path / "old"), 4, model, opt)
    want = torch.rand(3)
    fresh, fresh_opt = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    assert whole.load_checkpoint(path, fresh, fresh_opt)["step"] == 4
    assert all(torch.equal(a, b) for a, b in zip(params(fresh).values(), params(model).values()))
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert all(torch.equal(fresh_opt.state[a][k], opt.state[b][k])
                   for k in ("exp_avg", "exp_avg_sq", "step"))
    assert fresh_opt.param_groups[0]["lr"] == 3e-3 and fresh_opt.param_groups[0]["betas"] == (
        0.9, 0.999)
    assert torch.equal(torch.rand(3), want)  # the RNG continues as saved
    other = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    with pytest.raises(CheckpointError, match=r"\(written by DTA up to 2026-12-07, before "
                                              r"issue 54's one format\) does not fit this run"):
        whole.load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))


def test_file_added_after_the_fact_or_missing_manifest_is_refused(saved):
    d, path, run, model, opt = saved
    open(os.path.join(path, "extra.pt"), "wb").write(b"x")
    with pytest.raises(CheckpointError, match="'extra.pt' is not in its manifest"):
        whole.load_checkpoint(path, *tiny())
    os.unlink(os.path.join(path, "extra.pt"))
    os.unlink(os.path.join(path, ckpt.MANIFEST))
    with pytest.raises(CheckpointError, match="no readable manifest.json"):
        whole.load_checkpoint(path, *tiny())


def test_second_run_in_the_same_folder_is_refused(saved):
    d, path, run, model, opt = saved
    with pytest.raises(CheckpointError, match=f"already holds run {run.run_id}, latest step-000001"):
        ckpt.prepare_run(d, resume=False)
    assert ckpt.prepare_run(d, resume=True).run_id == run.run_id  # resuming it is fine
    with pytest.raises(CheckpointError, match="belongs to run"):
        whole.save_checkpoint(d, 2, model, opt, run_id="another-run")


def test_checkpoint_of_another_run_is_refused(saved, tmp_path):
    d, path, run, model, opt = saved
    other = str(tmp_path / "other")
    ckpt.prepare_run(other, resume=False)
    os.replace(path, os.path.join(other, "step-000001"))
    with pytest.raises(CheckpointError, match="two runs were mixed"):
        whole.load_checkpoint(os.path.join(other, "step-000001"), *tiny())


def test_resume_needs_an_existing_folder_with_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.prepare_run(str(tmp_path / "typo"), resume=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        ckpt.prepare_run(str(tmp_path / "empty"), resume=True)


def test_unusable_folder_fails_before_step_0(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"^train.checkpoint_dir '.*/a-file/ckpt' cannot be "
                                              r"created: '.*/a-file' is a file, not a folder$"):
        ckpt.prepare_run(str(tmp_path / "a-file" / "ckpt"), resume=False)


def test_keep_last_and_modes(saved):
    d, path, run, model, opt = saved
    for step in range(2, 6):
        whole.save_checkpoint(d, step, model, opt, keep_last=2)
    assert [os.path.basename(p) for p in ckpt.checkpoints(d)] == ["step-000004", "step-000005"]
    assert ckpt.latest_checkpoint(d).endswith("step-000005")
    assert not [n for n in os.listdir(d) if n.startswith(".")]  # no temp or trash left
    for root, dirs, files in os.walk(d):
        for name in dirs + files + ["."]:
            mode = os.stat(os.path.join(root, name)).st_mode
            assert not mode & stat.S_IWOTH and not mode & stat.S_IWGRP, (root, name, oct(mode))


def test_meta_with_nan_is_strict_json(saved):
    d, path, run, model, opt = saved
    p = whole.save_checkpoint(d, 7, model, opt, {"history": [{"loss": float("nan")}]})
    text = open(os.path.join(p, "meta.json")).read()
    assert "NaN" not in text and json.loads(text)["history"][0]["loss"] is None


def test_submit_ships_absolute_checked_paths(tmp_path, monkeypatch):
    from dta.config.schema import ConfigError, load_config
    from dta_cli.jobs import ship_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"input_ids": [3, 4, 5]}\n')
    cfg = ship_paths(load_config(None, ["workload.path=data.jsonl", "train.checkpoint_dir=ck",
                                        "train.export_hf=out/hf"]))
    assert cfg.workload.path == str(tmp_path / "data.jsonl")
    assert cfg.train.checkpoint_dir == str(tmp_path / "ck")
    assert cfg.train.export_hf == str(tmp_path / "out" / "hf")
    with pytest.raises(ConfigError, match="'workload.path'.*does not exist"):
        ship_paths(load_config(None, ["workload.path=missing.jsonl"]))
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [3], "labels": [3]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 1: unknown field 'labels'"):
        ship_paths(load_config(None, ["workload.path=bad.jsonl"]))
    with pytest.raises(ConfigError, match="does not exist"):
        ship_paths(load_config(None, ["train.checkpoint_dir=nope", "train.resume=true"]))

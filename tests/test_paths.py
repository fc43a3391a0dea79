"""Path errors say what is wrong (issue 42): every path a user gives is checked against the
kind it must be (dta.paths.check_path) before anything reads or writes it, and a mismatch
is one line naming the setting or flag, the path and what the path actually is."""
from __future__ import annotations

import contextlib
import io
import os

import pytest

from dta.paths import PathError, check_path

TINY = ["workload.scale=tiny", "ray.num_workers=1", "ray.object_store_memory=104857600"]


@pytest.fixture
def places(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    file = tmp_path / "a-file.jsonl"
    file.write_text('{"input_ids": [3, 4, 5]}\n')
    return str(folder), str(file)


def test_the_helper_names_the_setting_the_path_and_what_it_is(places, tmp_path):
    folder, file = places
    cases = [
        ((folder, "file", "workload.path"), f"workload.path {folder!r} is a folder, not a file"),
        ((file, "dir", "--tokenizer"), f"--tokenizer {file!r} is a file, not a folder"),
        ((str(tmp_path / "nope"), "file", "--input"),
         f"--input {str(tmp_path / 'nope')!r} does not exist"),
        ((os.path.join(file, "x.yaml"), "file", "--config"),
         f"--config {os.path.join(file, 'x.yaml')!r} does not exist ({file!r} is a file, not "
         "a folder)"),
        ((os.path.join(file, "ck"), "dir", "train.checkpoint_dir", True),
         f"train.checkpoint_dir {os.path.join(file, 'ck')!r} cannot be created: {file!r} is a "
         "file, not a folder"),
        (("", "file", "--input"), "--input is empty: give a file"),
    ]
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone")
    cases.append(((str(link), "file", "--input"),
                  f"--input {str(link)!r} is a broken symbolic link (to {str(tmp_path / 'gone')!r})"))
    for args, line in cases:
        with pytest.raises(PathError) as info:
            check_path(*args[:3], create=len(args) > 3)
        assert str(info.value) == line
    assert check_path(file, "file", "--input") == file
    assert check_path(folder, "dir", "model.path") == folder
    assert check_path(str(tmp_path / "new" / "ck"), "dir", "train.checkpoint_dir", create=True)
    assert not os.path.exists(tmp_path / "new")  # nothing created by a check


def test_unreadable_and_unwritable_are_named(places, monkeypatch):
    """Root may read anything, so os.access is what the check asks: answered 'no' here."""
    folder, file = places
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PathError, match=rf"^--input {file!r} is a file you may not read "
                                        r"\(permission denied\)$"):
        check_path(file, "file", "--input")
    with pytest.raises(PathError, match=rf"^model.path {folder!r} is a folder you may not "
                                        r"read \(permission denied\)$"):
        check_path(folder, "dir", "model.path")
    with pytest.raises(PathError, match=rf"^train.log_dir '{folder}/logs' cannot be created: "
                                        rf"the folder {folder!r} is not writable$"):
        check_path(os.path.join(folder, "logs"), "dir", "train.log_dir", create=True)


def cli(argv: list[str]) -> tuple[int, list[str]]:
    from dta_cli.main import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(argv)
    return rc, [line for line in err.getvalue().splitlines() if line.strip()]


def test_every_user_path_gets_one_line_naming_it(places, tmp_path):
    """A folder where a file is expected, a file where a folder is expected: for each path a
    user gives, the command fails in one line naming the setting, the path and what it is,
    and nothing is created."""
    folder, file = places
    out = str(tmp_path / "out.jsonl")
    is_folder, is_file = "is a folder, not a file", "is a file, not a folder"
    local = "(a local Hugging Face {} folder: DTA never downloads one)"
    cases = [
        (["train", "--no-progress", *TINY, f"workload.path={folder}"],
         f"dta train: error: workload.path {folder!r} {is_folder}"),
        (["train", "--config", folder], f"dta train: --config {folder!r} {is_folder}"),
        (["train", "--no-progress", *TINY, f"model.path={file}"],
         f"dta train: error: model.path {file!r} {is_file} {local.format('model')}"),
        (["train", "--no-progress", *TINY, f"train.checkpoint_dir={file}"],
         f"dta train: error: train.checkpoint_dir {file!r} {is_file}"),
        (["train", "--no-progress", *TINY, f"train.log_dir={file}"],
         f"dta train: error: train.log_dir {file!r} {is_file}"),
        (["plan", "--input", folder], f"dta plan: --input {folder!r} {is_folder}"),
        (["verify", "--input", folder], f"dta verify: error: --input {folder!r} {is_folder}"),
        (["verify", "--model-path", file], f"dta verify: error: --model-path {file!r} {is_file} "
         f"{local.format('model')}"),
        (["bench", "--input", folder], f"dta bench: --input {folder!r} {is_folder}"),
        (["import", "--from", "tau2", folder, "--tokenizer", folder, "--out", out],
         f"dta import: --from tau2 FILE {folder!r} {is_folder}"),
        (["import", "--from", "openai", file, "--tokenizer", file, "--out", out],
         f"dta import: --tokenizer {file!r} {is_file} {local.format('tokenizer')}"),
        (["import", "--from", "openai", file, "--tokenizer", folder, "--out", folder],
         f"dta import: --out {folder!r} {is_folder}"),
        (["submit", "--address", "http://127.0.0.1:9", f"workload.path={folder}"],
         f"dta submit: error: config key 'workload.path': {folder!r} {is_folder}"),
    ]
    before = sorted(os.listdir(tmp_path))
    for argv, line in cases:
        rc, lines = cli(argv)
        assert rc != 0 and lines == [line], (argv, lines)
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(folder) == []


def test_library_readers_use_the_same_check(places):
    """The library's own entry points (a config file, an import source, a tokenizer folder)
    say the same, with their own error classes."""
    from dta.config.schema import ConfigError, load_config
    from dta.importing import ImportError_, load_tokenizer, read_conversations

    folder, file = places
    with pytest.raises(ConfigError, match=rf"^config file {folder!r} is a folder, not a file$"):
        load_config(folder)
    with pytest.raises(ImportError_, match=rf"^--from tau2 FILE {folder!r} is a folder, not a "
                                           r"file$"):
        read_conversations("tau2", folder)
    with pytest.raises(ImportError_, match=rf"^--tokenizer {file!r} is a file, not a folder "
                                           r"\(a local Hugging Face tokenizer folder: DTA "
                                           r"never downloads one\)$"):
        load_tokenizer(file)

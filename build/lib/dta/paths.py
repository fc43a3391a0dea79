"""One check for every path a user gives — a setting (``workload.path``, ``model.path``,
``train.checkpoint_dir``), a flag (``--input``, ``--config``, ``--tokenizer``) or an argument
(``dta import``'s FILE): the kind expected there (a file or a folder) against what is there,
before anything reads or writes it. A mismatch is one line naming the setting, the path and
what the path actually is::

    workload.path 'runs/data' is a folder, not a file
    --tokenizer 'tok.json' is a file, not a folder
    --config 'cfg/run.yaml' does not exist ('cfg' is a file, not a folder)
    train.checkpoint_dir 'out/ck' cannot be created: 'out' is a file, not a folder

Standard library only: every layer (``dta``, ``runtime``, ``experiments``, ``dta_cli``) calls
:func:`check_path`, each with its own error class.
"""
from __future__ import annotations

import os
import stat

__all__ = ["PathError", "check_path", "describe"]

KINDS = {"file": "a file", "dir": "a folder"}


class PathError(ValueError):
    """A user's path is not what the setting or flag needs (one line)."""


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        return "a device"
    return "a special file"


def _blocker(path: str) -> tuple[str, os.stat_result | None]:
    """The nearest existing path above ``path`` and its stat (None: it cannot be looked at)."""
    parent = os.path.normpath(path)
    while True:
        up = os.path.dirname(parent) or "."
        if up == parent:
            try:
                return parent, os.stat(parent)
            except OSError:
                return parent, None
        parent = up
        try:
            return parent, os.stat(parent)
        except FileNotFoundError:
            continue
        except OSError:
            return parent, None


def _missing(path: str) -> str:
    """Why ``path`` cannot be reached: 'does not exist', or which part of it is in the way."""
    parent, st = _blocker(path)
    if st is None:
        return f"cannot be reached ({parent!r} cannot be looked into)"
    if not stat.S_ISDIR(st.st_mode):
        return f"does not exist ({parent!r} is {_kind_of(st.st_mode)}, not a folder)"
    if not os.access(parent, os.X_OK):
        return f"cannot be reached (the folder {parent!r} may not be entered)"
    return "does not exist"


def describe(path: str | os.PathLike) -> tuple[str | None, str]:
    """(kind, words): the kind found at ``path`` ('file', 'dir', or None when it is missing or
    something else) and what it is in words ('is a folder', 'is a broken symbolic link (to
    'x')', 'does not exist', ...)."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        if os.path.islink(path):
            return None, f"is a broken symbolic link (to {os.readlink(path)!r})"
        return None, _missing(path)
    except OSError as exc:
        return None, f"cannot be looked at ({exc.strerror or exc})"
    if stat.S_ISDIR(st.st_mode):
        return "dir", "is a folder"
    if stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
        return "file", f"is {_kind_of(st.st_mode)}"  # a pipe or /dev/stdin reads as a file
    return None, f"is {_kind_of(st.st_mode)}"


def check_path(path: str | os.PathLike, kind: str, name: str, *, create: bool = False,
               write: bool = False, hint: str = "",
               error: type[Exception] = PathError) -> str:
    """``path`` as a string if it is usable as ``kind`` ('file' or 'dir') for the setting or
    flag ``name``; else ``error`` with one line naming ``name``, the path and what it is.

    It must exist and be readable (a folder: listable), unless ``create``: then a missing
    path is fine when the nearest existing folder above it is writable (it will be created
    there). ``write``: an existing path must be writable too (a folder: files can be created
    in it). ``hint`` ends the line (e.g. 'DTA never downloads a model'). Nothing is
    created, opened or changed."""
    if kind not in KINDS:
        raise ValueError(f"check_path: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if hint:
        plain = error

        def error(text: str) -> Exception:
            return plain(f"{text} ({hint})")
    path = os.fspath(path)
    if not path:
        raise error(f"{name} is empty: give {KINDS[kind]}")
    found, words = describe(path)
    if found is None and create and not os.path.lexists(path):
        parent, st = _blocker(path)
        if st is None or not stat.S_ISDIR(st.st_mode):
            what = "cannot be looked into" if st is None else \
                f"is {_kind_of(st.st_mode)}, not a folder"
            raise error(f"{name} {path!r} cannot be created: {parent!r} {what}")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise error(f"{name} {path!r} cannot be created: the folder {parent!r} is not "
                        "writable")
        return path
    if found is None:
        raise error(f"{name} {path!r} {words}")
    if found != kind:
        raise error(f"{name} {path!r} {words}, not {KINDS[kind]}")
    need = os.R_OK | (os.X_OK if kind == "dir" else 0)
    if not os.access(path, need):
        raise error(f"{name} {path!r} is {KINDS[kind]} you may not read (permission denied)")
    if write and not os.access(path, os.W_OK | (os.X_OK if kind == "dir" else 0)):
        raise error(f"{name} {path!r} is {KINDS[kind]} you may not write (permission denied)")
    return path

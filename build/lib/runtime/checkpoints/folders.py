"""Which folders DTA writes checkpoints into: a missing one, an empty one, or a DTA run
folder (one holding ``run.json``). Anything else holds someone else's files, and
keep-last-N deletes folders there: it is refused before step 0, naming what is in it.
A run's claim on its folder is :mod:`runtime.checkpoints.claim`.
No torch, no Ray: ``dta submit`` checks the folder before sending the job."""
from __future__ import annotations

import os

RUN_FILE = "run.json"
CLAIMING = RUN_FILE + ".tmp-"  # a run.json being published (runtime.checkpoints.claim)


class CheckpointError(RuntimeError):
    pass


def fsync_dir(path: str) -> None:
    """Make a folder's entries durable (a new or renamed file in it); best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _ours(names: list[str]) -> list[str]:
    """``names`` without the files of a claim in flight (or left by a crash during one)."""
    return [n for n in names if not n.startswith(CLAIMING)]


def listing(directory: str, limit: int = 6) -> str:
    """``'3 entries: a.txt, data/, notes'`` (the first ``limit`` names, folders with ``/``)."""
    names = sorted(_ours(os.listdir(directory)))
    shown = [n + ("/" if os.path.isdir(os.path.join(directory, n)) else "") for n in names[:limit]]
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"{len(names)} {'entry' if len(names) == 1 else 'entries'}: {', '.join(shown)}{more}"


def foreign_folder(directory: str) -> str | None:
    """None if ``directory`` is missing, empty or a DTA run folder; else why it is refused
    (one line naming the folder and what is in it)."""
    if not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, RUN_FILE)):
        return None
    try:
        if not _ours(os.listdir(directory)):
            return None
        held = listing(directory)
    except OSError as exc:
        return f"checkpoint folder {directory!r} cannot be listed: {exc.strerror or exc}"
    return (f"checkpoint folder {directory!r} is not a DTA run folder (no {RUN_FILE}) and is "
            f"not empty: it holds {held}; DTA writes (and keep-last-N deletes) checkpoints "
            "only in a new, empty or DTA run folder: choose one")

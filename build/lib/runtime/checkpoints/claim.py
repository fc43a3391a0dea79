"""A run owns its checkpoint folder from its first second, before it writes anything there.

The folder's ``run.json`` names the run that owns it, and is that run's claim:

* **created exclusively, complete and already locked**: the record is written to a private
  file beside it (``run.json.tmp-*``), locked (``flock``) and fsynced, then *linked* to
  ``run.json``. ``link`` fails when the name exists, so of two runs started together on one
  folder exactly one creates it, and no run ever reads it half written or unlocked;
* **locked for the owner's life**: the lock belongs to the open file, which the kernel closes
  when the process ends, crashes or is killed (SIGKILL included): a dead run never leaves its
  folder stuck, and nothing has to be cleaned up;
* a run that finds a ``run.json`` it cannot lock has a live owner: it is refused at once, in
  one line naming that run and how to continue it, having written nothing there;
* a run that can lock it holds the record of a run that has stopped. ``decide(previous)``
  (the caller's rules: resume that run, or refuse a folder holding its checkpoints, or take
  over one that has none) returns the record to publish; it replaces the old one (``rename``)
  while the old one is still locked, so no third run can slip in between.

A lock held by someone else is looked at for :data:`PATIENCE` seconds before the run is
refused: a run taking over a stopped run's record holds the old one for an instant, and
:func:`live_owner` (``dta submit``'s look) takes a shared lock for an instant.

On a filesystem without ``flock`` (some network mounts) the creation is still exclusive, but
a stopped run cannot be told from a live one: a new run is refused in a folder that holds a
record (remove ``run.json`` of a run known to have stopped), a resume proceeds.

No torch, no Ray.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import time
import uuid
import weakref
from typing import Callable

from runtime.checkpoints.folders import CLAIMING, RUN_FILE, CheckpointError
from runtime.checkpoints.folders import fsync_dir as _fsync_dir

PATIENCE = 0.5  # seconds a run.json must stay locked by another process to be a live run's
_PAUSE = 0.05
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK}
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS,
             errno.EBADF}


class Claim:
    """This process's hold on a checkpoint folder: ``record`` is the ``run.json`` it
    published (and holds locked until :meth:`release`, its garbage collection or the
    process's end); ``previous`` the stopped run's record it replaced (None: there was none)."""

    def __init__(self, directory: str, record: dict, previous: dict | None, fd: int,
                 locked: bool):
        self.directory, self.record, self.previous, self.locked = (directory, record,
                                                                   previous, locked)
        self._release = weakref.finalize(self, _close, fd)

    @property
    def run_id(self) -> str:
        return self.record["run_id"]

    @property
    def held(self) -> bool:
        return self._release.alive

    def release(self) -> None:
        """Let the folder go (the run has ended): another run may now resume or take it."""
        self._release()


def claim_folder(directory: str, decide: Callable[[dict | None], dict], *,
                 resume: bool, key: str = "train.checkpoint_dir") -> Claim:
    """Claim ``directory`` (which exists) for this process; see the module doc.
    ``decide(previous)`` gets the record of the stopped run that held the folder (None: none)
    and returns this run's record (with its ``run_id``) or raises to refuse the folder.
    ``key``: the setting that named the folder (the refusals name it)."""
    path = os.path.join(directory, RUN_FILE)
    seen, since = None, None
    while True:
        try:
            fd = _open(path)
        except FileNotFoundError:
            record = decide(None)
            try:
                new, locked = _publish(directory, record, exclusive=True)
            except FileExistsError:
                continue  # another run created it first: look at it
            return Claim(directory, record, None, new, locked)
        try:
            got = _lock(fd)
            same = _same_file(path, fd)
            previous = _read(fd) if same else None
            ino = os.fstat(fd).st_ino
            if not same or got is False or previous is None:
                _close(fd)
        except BaseException:
            _close(fd)
            raise
        if not same:
            continue  # replaced since it was opened (a takeover): look again
        if got is False or previous is None:  # held by another process, or being written
            now, look = time.monotonic(), (ino, got, (previous or {}).get("run_id"))
            if look != seen:
                seen, since = look, now
            elif now - since >= PATIENCE:
                if previous is None:
                    raise CheckpointError(f"{path!r} is unreadable (not a run record); if no "
                                          "run is using the folder, remove it")
                raise CheckpointError(in_use_message(directory, previous, key=key))
            time.sleep(_PAUSE)
            continue
        try:  # ours: the record of a run that has stopped (or, got None: no locks to tell)
            if got is None and not resume:
                raise CheckpointError(in_use_message(directory, previous, unknown=True,
                                                     key=key))
            record = decide(previous)
            new, locked = _publish(directory, record, exclusive=False)
        finally:
            _close(fd)  # the stopped run's record: replaced (or kept, refused), now let go
        return Claim(directory, record, previous, new, locked)


def run_record(run_id: str, created: str | None = None) -> dict:
    """A claim's record: the run, when it was created (kept across resumes), and this
    process (its start, pid, host: what a refused run is told)."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"run_id": run_id, "created": created or now, "started": now, "pid": os.getpid(),
            "host": socket.gethostname()}


def live_owner(directory: str) -> dict | None:
    """The record of the live run that holds ``directory``, or None (no record, its run has
    stopped, or no locks on this filesystem). Takes nothing: a shared lock for an instant."""
    try:
        fd = os.open(os.path.join(directory, RUN_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return _read(fd) if exc.errno in (errno.EAGAIN, errno.EACCES) else None
    finally:
        os.close(fd)
    return None


def create_record(directory: str, record: dict) -> bool:
    """Create ``run.json`` in ``directory`` exclusively, holding nothing afterwards: True, or
    False if it exists (a save without a claim: the Python API names its folder's run)."""
    try:
        fd, _ = _publish(directory, record, exclusive=True)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def in_use_message(directory: str, record: dict, unknown: bool = False,
                   key: str = "train.checkpoint_dir") -> str:
    """One line: ``directory`` (named by the setting ``key``) is held by the run of
    ``record`` (``unknown``: perhaps, no locks to tell), and how to continue that run."""
    who = f"run {record.get('run_id', '?')}"
    if record.get("pid"):
        who += f" (pid {record['pid']}" + (f" on {record['host']}" if record.get("host") else "") \
            + (f", started {record['started']}" if record.get("started") else "") + ")"
    if key != "train.checkpoint_dir":  # a run's other folder (train.log_dir): not resumable
        if unknown:
            return (f"{key} {directory!r} holds {who}, and its filesystem has no file locks to "
                    f"tell whether that run still runs: if it has stopped, remove {RUN_FILE}; "
                    f"or choose another {key}")
        return (f"{key} {directory!r} is in use by {who}, which is still running: one run per "
                f"folder; choose another {key}")
    if unknown:
        return (f"checkpoint folder {directory!r} holds {who}, and its filesystem has no file "
                "locks to tell whether that run still runs: continue it with train.resume=true, "
                f"or, if it has stopped without a checkpoint, remove {RUN_FILE}; or choose "
                "another folder")
    return (f"checkpoint folder {directory!r} is in use by {who}, which is still running: one "
            "run per folder. Once it has stopped, continue it with "
            f"train.checkpoint_dir={directory} train.resume=true; or choose another folder")


# ------------------------------------------------------------------------- files --
def _open(path: str) -> int:
    try:  # read-write: a network filesystem's exclusive lock needs a writable file
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except PermissionError:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _lock(fd: int) -> bool | None:
    """Lock ``fd`` for this process: True, False (another process holds it), None (no locks
    on this filesystem)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno in _NO_LOCKS:
            return None
        raise


def _same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read(fd: int) -> dict | None:
    try:
        record = json.loads(os.pread(fd, 1 << 20, 0).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") else None


def _publish(directory: str, record: dict, *, exclusive: bool) -> tuple[int, bool]:
    """Write ``record`` to a private file, lock it, then make it ``run.json``: by ``link``
    (``exclusive``: FileExistsError if the name exists) or by ``rename``. Returns the open,
    locked file and whether the lock is real (False: no locks on this filesystem)."""
    path = os.path.join(directory, RUN_FILE)
    tmp = os.path.join(directory, f"{CLAIMING}{uuid.uuid4().hex}")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CheckpointError(_cannot(directory, exc)) from None
    try:
        locked = _lock(fd) is True
        _fill(fd, record)
        if exclusive:
            try:
                os.link(tmp, path)
            except OSError as exc:
                if exc.errno not in _NO_LINKS:
                    raise
                _close(fd)
                _unlink(tmp)
                return _create(directory, record)
        else:
            os.replace(tmp, path)
    except FileExistsError:
        _close(fd)
        _unlink(tmp)
        raise
    except BaseException as exc:
        _give_up(fd, tmp, directory, exc)
    if exclusive:
        _unlink(tmp)
    _fsync_dir(directory)
    return fd, locked


def _create(directory: str, record: dict) -> tuple[int, bool]:
    """:func:`_publish` on a filesystem without hard links: ``run.json`` itself is created
    exclusively, locked, then written (a run that reads it meanwhile finds it empty and looks
    again, for PATIENCE)."""
    path = os.path.join(directory, RUN_FILE)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise
    except OSError as exc:
        raise CheckpointError(_cannot(directory, exc)) from None
    try:
        deadline = time.monotonic() + PATIENCE
        locked = _lock(fd)
        while locked is False and time.monotonic() < deadline:  # a look holds it an instant
            time.sleep(_PAUSE)
            locked = _lock(fd)
        _fill(fd, record)
    except BaseException as exc:
        _give_up(fd, path, directory, exc)
    _fsync_dir(directory)
    return fd, locked is True


def _fill(fd: int, record: dict) -> None:
    data = (json.dumps(record, indent=1, allow_nan=False) + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data):]
    os.fsync(fd)
    os.fchmod(fd, 0o644)  # whatever the umask: never writable by others


def _give_up(fd: int, path: str, directory: str, exc: BaseException):
    """Writing the claim file ``path`` failed with ``exc``: close and remove it, then raise
    (an OSError as one line naming the folder)."""
    _close(fd)
    _unlink(path)
    if isinstance(exc, OSError):
        raise CheckpointError(_cannot(directory, exc)) from None
    raise exc


def _cannot(directory: str, exc: OSError) -> str:
    return (f"checkpoint folder {directory!r} cannot be claimed: writing its {RUN_FILE} "
            f"failed: {exc.strerror or exc}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


"""The runtime's errors: a training run that cannot go on, a step that failed on workers, and
any other call that failed on workers — each one line saying what was being done, by which
worker, and the underlying cause (never Ray's actor repr or its terminal colour codes)."""
from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# "ValueError: bad value" / "torch.distributed.DistBackendError: ..." at the end of a traceback
_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.+)$")


class TrainingError(RuntimeError):
    pass


class StepFailed(TrainingError):
    """A step failed on one or more workers; ``.failures`` maps rank -> (kind, description)
    and ``.applied`` lists the ranks that applied the update before the failure."""

    def __init__(self, message: str, step: int, failures: dict, applied: list[int]):
        super().__init__(message)
        self.step, self.failures, self.applied = step, failures, applied


class WorkerError(TrainingError):
    """A call on workers (save, load, export, a collective) failed. ``.action`` says what was
    being done, ``.failures`` maps rank -> (kind, cause): kind is ``raised``, ``died`` or
    ``hung``. The Ray error is the ``__cause__`` (``--debug`` shows the worker's traceback)."""

    def __init__(self, message: str, action: str, failures: dict):
        super().__init__(message)
        self.action, self.failures = action, failures

    def extend(self, text: str) -> "WorkerError":
        """Append ``text`` to the message (e.g. what is left on disk); returns self."""
        self.args = (f"{self.args[0]}; {text}",)
        return self


def plain(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", str(text))


def first_line(exc) -> str:
    """The first meaningful line of an exception's text (a remote traceback's cause)."""
    text = plain(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("Traceback"):
            return line[:400]
    return type(exc).__name__


def original(exc: BaseException) -> BaseException:
    """The exception a worker raised, under Ray's wrappers (``RayTaskError.cause``) and
    torch.distributed.checkpoint's (``CheckpointException.failures``, lowest rank first)."""
    for _ in range(8):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException) and cause is not exc:
            exc = cause
            continue
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict) and failures and type(exc).__name__ == "CheckpointException":
            first = failures[min(failures)]
            inner = first[0] if isinstance(first, tuple) else first
            if isinstance(inner, BaseException):
                exc = inner
                continue
        break
    return exc


def describe(exc: BaseException) -> str:
    """One line: the underlying exception's type and message (an ``OSError`` keeps its path),
    or how the worker died."""
    try:
        from ray.exceptions import GetTimeoutError, RayActorError
    except ImportError:  # pragma: no cover - ray is a runtime dependency
        GetTimeoutError = RayActorError = ()  # noqa: N806
    exc = original(exc)
    if isinstance(exc, GetTimeoutError):
        return "did not answer in time"
    if isinstance(exc, RayActorError):
        text = plain(exc)
        if getattr(exc, "actor_init_failed", False):  # raised while building the worker
            raised = [m for line in text.splitlines() if (m := _RAISED.match(line.strip()))]
            if raised:
                return f"{raised[-1].group(1)}: {raised[-1].group(2)[:400]} (while starting)"
        return first_line(exc)  # "The actor died unexpectedly before finishing this task."
    return f"{type(exc).__name__}: {first_line(exc)}"


_OS_ERROR_TEXT = re.compile(r"(?:I/O error: )?([^:]+?) \(os error (\d+)\)")  # safetensors' text


def storage_failure(exc: BaseException, action: str, path: str | None = None
                    ) -> BaseException | None:
    """``exc`` as one line that says ``action`` when it is a failure to read or write storage
    (an ``OSError``, also one wrapped by torch.distributed.checkpoint, or safetensors'
    "... (os error 28)"): an ``OSError`` of the same errno naming the file (else ``path``).
    Another exception wrapped by DCP: a one-line ``RuntimeError``. Anything else: None (its
    own message says what is wrong)."""
    inner = original(exc)
    if isinstance(inner, OSError) and inner.errno is not None:
        return OSError(inner.errno, f"{action} failed: {inner.strerror}",
                       inner.filename if inner.filename is not None else path)
    found = _OS_ERROR_TEXT.search(str(inner))
    if found and not isinstance(inner, OSError):
        return OSError(int(found.group(2)), f"{action} failed: {found.group(1).strip()}", path)
    if inner is not exc:
        return RuntimeError(f"{action} failed: {describe(inner)}")
    return None

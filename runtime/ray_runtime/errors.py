"""The runtime's errors: a training run that cannot go on, and a step that failed on workers."""
from __future__ import annotations


class TrainingError(RuntimeError):
    pass


class StepFailed(TrainingError):
    """A step failed on one or more workers; ``.failures`` maps rank -> (kind, description)
    and ``.applied`` lists the ranks that applied the update before the failure."""

    def __init__(self, message: str, step: int, failures: dict, applied: list[int]):
        super().__init__(message)
        self.step, self.failures, self.applied = step, failures, applied


def first_line(exc) -> str:
    """The first meaningful line of an exception's text (a remote traceback's cause)."""
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("Traceback"):
            return line[:400]
    return type(exc).__name__

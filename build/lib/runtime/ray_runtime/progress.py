"""Progress inside a long step: the workers report the tokens they have walked.

A :class:`ProgressBoard` (a Ray actor with no CPU of its own) holds, per rank, the tokens
walked in the current step. Each worker reports through a :class:`Reporter` (at most every
``interval_s``, fire-and-forget, so the walk never waits on it); the driver reads the board
while it waits for the step and moves a tokens bar.
"""
from __future__ import annotations

import time


class ProgressBoard:
    def __init__(self):
        self.step, self.tokens = -1, {}

    def report(self, step: int, rank: int, tokens: int) -> None:
        if step != self.step:
            self.step, self.tokens = step, {}
        self.tokens[rank] = max(self.tokens.get(rank, 0), int(tokens))

    def walked(self, step: int) -> int:
        return int(sum(self.tokens.values())) if step == self.step else 0


class Reporter:
    """``reporter(n)``: n more tokens walked (the walker's ``progress`` callback)."""

    def __init__(self, board, step: int, rank: int, interval_s: float = 0.5):
        self.board, self.step, self.rank, self.interval_s = board, step, rank, interval_s
        self.tokens, self._last = 0, 0.0

    def __call__(self, n: int) -> None:
        self.tokens += int(n)
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self.flush()

    def flush(self) -> None:
        try:
            self.board.report.remote(self.step, self.rank, self.tokens)
        except Exception:  # progress is best effort: never fail a step for it
            pass

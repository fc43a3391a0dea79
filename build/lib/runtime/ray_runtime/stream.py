"""Streaming rollouts: grow a batch as rollouts arrive, start a step when a target is met.

As in AReaL's asynchronous mode, generation runs concurrently with training: rollouts are
produced by another thread or process (an iterator, a ``queue.Queue`` or a
``ray.util.queue.Queue``) and the trainer takes a batch as soon as it holds
``target_sequences`` sequences or ``target_tokens`` tokens (whichever target is set and met
first). Rollouts that arrive while a step runs wait in the source and go to the next batch;
every rollout is in exactly one batch, in arrival order.

The prefix tree is immutable: the batcher keeps the records and their running token count
and builds the :class:`~dta.batch.Batch` (and the driver its tree) when the target is met;
building is near-linear and fast next to a training step.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any, Iterator

from dta.batch import Batch

END = object()  # put this (or None) into a queue to end the stream


@dataclass
class StreamBatch:
    batch: Batch
    records: list[dict]
    index: int  # 0, 1, ... in order of completion
    reason: str  # "sequences", "tokens" or "end" (a final partial batch)
    tokens: int
    wait_s: float  # time spent waiting for rollouts for this batch
    received: int  # rollouts taken from the source when the batch was cut


class StreamingBatcher:
    """Iterate over batches cut from a rollout stream (see the module doc).

    source: an iterable of records (dicts, as :meth:`Batch.from_records` takes), a
        ``queue.Queue`` or anything with ``get(block=True, timeout=...)`` (``ray.util.queue``);
        a queue ends with ``None`` or :data:`END`.
    target_sequences / target_tokens: step when either is reached (0 = unused; at least one).
    drop_last: drop a final batch below target instead of yielding it.
    """

    def __init__(self, source: Any, *, target_sequences: int = 0, target_tokens: int = 0,
                 drop_last: bool = False, poll_s: float = 0.05):
        if target_sequences < 0 or target_tokens < 0:
            raise ValueError("stream targets must be >= 0")
        if not target_sequences and not target_tokens:
            raise ValueError("set stream target_sequences or target_tokens (> 0)")
        self.source = source
        self.target_sequences, self.target_tokens = int(target_sequences), int(target_tokens)
        self.drop_last, self.poll_s = drop_last, poll_s
        self.pending: list[dict] = []
        self.pending_tokens = 0
        self.received = 0
        self.batches = 0

    def _records(self) -> Iterator[dict]:
        src = self.source
        if hasattr(src, "get") and not isinstance(src, dict):
            while True:
                try:
                    item = src.get(block=True, timeout=self.poll_s)
                except queue.Empty:
                    continue
                except Exception as exc:  # ray.util.queue.Empty is not queue.Empty
                    if type(exc).__name__ == "Empty":
                        continue
                    raise
                if item is None or item is END:
                    return
                yield item
        else:
            yield from src

    def _met(self) -> str | None:
        if self.target_sequences and len(self.pending) >= self.target_sequences:
            return "sequences"
        if self.target_tokens and self.pending_tokens >= self.target_tokens:
            return "tokens"
        return None

    def _cut(self, reason: str, wait_s: float) -> StreamBatch:
        records, self.pending, tokens = self.pending, [], self.pending_tokens
        self.pending_tokens = 0
        out = StreamBatch(Batch.from_records(records), records, self.batches, reason, tokens,
                          wait_s, self.received)
        self.batches += 1
        return out

    def __iter__(self) -> Iterator[StreamBatch]:
        t0 = time.perf_counter()
        for rec in self._records():
            if "input_ids" not in rec:
                raise ValueError(f"rollout {self.received}: missing field 'input_ids'")
            self.pending.append(rec)
            self.pending_tokens += len(rec["input_ids"])
            self.received += 1
            reason = self._met()
            if reason:
                yield self._cut(reason, time.perf_counter() - t0)
                t0 = time.perf_counter()  # the consumer's step ran in between
        if self.pending and not self.drop_last:
            yield self._cut("end", time.perf_counter() - t0)

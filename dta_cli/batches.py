"""Where `dta train`'s batches come from: step k's batch is the workload generated with
seed + k (``experiments.workloads``), or a slice of a JSONL file (``workload.path``)."""
from __future__ import annotations

import os

from dta.batch import Batch


class BatchSourceError(ValueError):
    pass


class BatchSource:
    """``batch(step)``: the batch of step ``step`` under the config's ``workload`` section."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg, self.vocab_size = cfg, vocab_size
        self._records = None

    def records(self, step: int) -> list[dict]:
        w = self.cfg.workload
        if w.path:
            if self._records is None:
                from dta.jsonl import read_jsonl

                if not os.path.isfile(w.path):
                    raise BatchSourceError(f"workload.path {w.path!r} does not exist")
                self._records = read_jsonl(w.path)
                if not self._records:
                    raise BatchSourceError(f"workload.path {w.path!r} holds no sequences")
            n = int(w.sequences_per_step) or len(self._records)
            start = (step * n) % len(self._records)
            idx = [(start + i) % len(self._records) for i in range(n)]
            return [self._records[i] for i in idx]
        from experiments.workloads import make_workload

        scale = str(w.scale)
        scale = scale if scale in ("tiny", "small", "full") else float(scale)
        vocab = int(w.vocab_size or self.vocab_size)
        return make_workload(w.name, scale=scale, seed=int(w.seed) + int(step),
                             vocab_size=vocab).records

    def batch(self, step: int) -> Batch:
        return Batch.from_records(self.records(step))

"""Per-step metrics written as the run goes: ``metrics.jsonl`` (one strict-JSON object per
step, worker details included), ``metrics.csv`` (the scalar columns), and TensorBoard event
files under ``tensorboard/`` when the ``tensorboard`` package is installed. Every row is
flushed when written, so ``tail -f`` shows a run live and a crash loses nothing written."""
from __future__ import annotations

import csv
import json
import math
import os
import time

from dta.records.jsonl import json_safe

COLUMNS = ("step", "loss", "grad_norm", "updated", "sequences", "total_tokens",
           "unique_tokens", "forwarded_tokens", "sharing_ratio", "duplicated_tokens",
           "imbalance", "step_s", "peak_bytes_max", "time")


class MetricsLog:
    def __init__(self, directory: str, run_id: str | None = None):
        os.makedirs(directory, mode=0o755, exist_ok=True)
        self.directory = directory
        self.run_id = run_id
        self.jsonl_path = os.path.join(directory, "metrics.jsonl")
        self.csv_path = os.path.join(directory, "metrics.csv")
        new_csv = not os.path.isfile(self.csv_path)
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        self._csv_file = open(self.csv_path, "a", newline="", encoding="utf-8")
        for path in (self.jsonl_path, self.csv_path):
            os.chmod(path, 0o644)
        self._csv = csv.writer(self._csv_file)
        if new_csv:
            self._csv.writerow(COLUMNS)
            self._csv_file.flush()
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs `tensorboard`

            self._tb = SummaryWriter(os.path.join(directory, "tensorboard"))
        except Exception:  # not installed: CSV and JSONL only
            self._tb = None

    @property
    def paths(self) -> dict:
        out = {"jsonl": self.jsonl_path, "csv": self.csv_path}
        if self._tb is not None:
            out["tensorboard"] = os.path.join(self.directory, "tensorboard")
        return out

    def write(self, stats) -> None:
        row = stats.as_dict() if hasattr(stats, "as_dict") else dict(stats)
        row["peak_bytes_max"] = max((int(w.get("peak_bytes", 0)) for w in row.get("workers", [])),
                                    default=0)
        row["time"] = time.time()
        if self.run_id:
            row["run_id"] = self.run_id
        path = self.jsonl_path
        try:
            self._jsonl.write(json.dumps(json_safe(row), allow_nan=False) + "\n")
            self._jsonl.flush()
            path = self.csv_path
            self._csv.writerow(["" if row.get(c) is None else row.get(c) for c in COLUMNS])
            self._csv_file.flush()
        except OSError as exc:  # a full disk: say which file, and what was being done
            raise OSError(exc.errno, f"writing step {row.get('step')}'s metrics failed: "
                          f"{exc.strerror or exc}", path) from None
        if self._tb is not None:
            for key in ("loss", "grad_norm", "sharing_ratio", "imbalance", "step_s"):
                value = row.get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"train/{key}", value, int(row["step"]))
            self._tb.flush()

    def close(self) -> None:
        for f in (self._jsonl, self._csv_file):
            try:
                f.close()
            except Exception:
                pass
        if self._tb is not None:
            self._tb.close()
            self._tb = None

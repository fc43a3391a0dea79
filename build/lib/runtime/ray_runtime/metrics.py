"""Per-step metrics written as the run goes: ``metrics.jsonl`` (one strict-JSON object per
step, worker details included), ``metrics.csv`` (the scalar columns), and TensorBoard event
files under ``tensorboard/`` when the ``tensorboard`` package is installed. Every row is
flushed when written, so ``tail -f`` shows a run live and a crash loses nothing written.

A ``train.log_dir`` apart from the checkpoint folder is the run's from its first second, like
that folder (:func:`claim_log_folder`): two runs never write rows into one folder."""
from __future__ import annotations

import csv
import json
import math
import os
import time
import uuid

from dta.records.jsonl import json_safe
from runtime.checkpoints.claim import Claim, claim_folder, run_record
from runtime.checkpoints.folders import CheckpointError

FILES = ("metrics.jsonl", "metrics.csv", "tensorboard")  # what a MetricsLog writes

COLUMNS = ("step", "loss", "grad_norm", "updated", "sequences", "total_tokens",
           "unique_tokens", "forwarded_tokens", "sharing_ratio", "duplicated_tokens",
           "imbalance", "step_s", "peak_bytes_max", "time")


class MetricsLog:
    def __init__(self, directory: str, run_id: str | None = None):
        os.makedirs(directory, mode=0o755, exist_ok=True)
        self.directory = directory
        self.run_id = run_id
        self.jsonl_path = os.path.join(directory, FILES[0])
        self.csv_path = os.path.join(directory, FILES[1])
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

            self._tb = SummaryWriter(os.path.join(directory, FILES[2]))
        except Exception:  # not installed: CSV and JSONL only
            self._tb = None

    @property
    def paths(self) -> dict:
        out = {"jsonl": self.jsonl_path, "csv": self.csv_path}
        if self._tb is not None:
            out["tensorboard"] = os.path.join(self.directory, FILES[2])
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


def claim_log_folder(directory: str, run_id: str | None, *, resume: bool) -> Claim:
    """Claim ``train.log_dir`` (a folder apart from the checkpoint folder) for the run
    ``run_id`` (None: a run without a checkpoint folder, named here) until it ends, as
    :mod:`runtime.checkpoints.claim` claims a checkpoint folder: a live run's folder is refused
    in one line naming it. The folder must hold no metrics, or (``resume``) this run's own;
    one holding another run's rows is refused naming that run, before anything is written."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, mode=0o755, exist_ok=True)

    def decide(previous: dict | None) -> dict:
        owner = (previous or {}).get("run_id") or _rows_run(directory)
        held = [n for n in FILES if os.path.lexists(os.path.join(directory, n))]
        if held and not (resume and owner is not None and owner == run_id):
            who = f"run {owner}" if owner else "another run"
            hint = ("" if resume or owner is None else " (or continue that run from its "
                    "checkpoint folder: train.resume=true)")
            raise CheckpointError(f"train.log_dir {directory!r} already holds the metrics of "
                                  f"{who} ({', '.join(held)}); this run's rows would join "
                                  f"them: choose an empty folder{hint}")
        return run_record(run_id or uuid.uuid4().hex, (previous or {}).get("created"))

    return claim_folder(directory, decide, resume=resume, key="train.log_dir")


def _rows_run(directory: str) -> str | None:
    """The run id of the last row of ``directory``'s metrics.jsonl (None: none readable)."""
    last = None
    try:
        with open(os.path.join(directory, FILES[0]), encoding="utf-8") as f:
            for line in f:
                last = line if line.strip() else last
        return json.loads(last).get("run_id") if last else None
    except (OSError, ValueError, AttributeError):
        return None

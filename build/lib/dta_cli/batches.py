"""Where `dta train`'s batches come from: step k's batch is the workload generated with
seed + k (``experiments.workloads``), or a slice of a JSONL file (``workload.path``).

The whole file is read and checked (against the model's vocabulary) before step 0, and
errors name its file, line and field. Advantages:

* with ``actor.adv_norm`` set, every record needs a ``reward``; the advantages are computed
  from the rewards as AReaL does (:mod:`dta.advantages`: ``reward_bias``/``reward_scaling``/
  ``reward_clip``, then group/batch mean and std over trained tokens; groups from the records'
  ``group_id``, else consecutive blocks of ``group_size``). A JSONL record that has its own
  ``advantages`` as well is an error (which one should win?). A generated workload's
  advantages are replaced by those of its rewards;
* without it, a record's ``advantages`` are used as given; a record with only a ``reward``
  gets that (processed) reward on every token; a record with both is an error.
"""
from __future__ import annotations

import numpy as np

from dta.batch import Batch
from dta.paths import check_path


class BatchSourceError(ValueError):
    pass


REWARD_KEYS = ("actor.reward_scaling", "actor.reward_bias", "actor.reward_clip")


class BatchSource:
    """``batch(step)``: the batch of step ``step`` under the config's ``workload`` section."""

    def __init__(self, cfg, vocab_size: int):
        self.cfg, self.vocab_size = cfg, vocab_size
        self._records = None
        self._lines = None
        if cfg.workload.path:  # before the run claims its folder or starts anything
            check_path(str(cfg.workload.path), "file", "workload.path", error=BatchSourceError)

    def _file(self) -> tuple[list[dict], list[str]]:
        if self._records is None:
            from dta.records.jsonl import read_jsonl

            w = self.cfg.workload
            path = check_path(str(w.path), "file", "workload.path", error=BatchSourceError)
            records, lines = read_jsonl(path, vocab_size=self.vocab_size, return_lines=True)
            if not records:
                raise BatchSourceError(f"workload.path {path!r} holds no sequences")
            n = int(w.sequences_per_step)
            if n > len(records):
                raise BatchSourceError(
                    f"workload.sequences_per_step={n} but {path!r} holds {len(records)} "
                    "sequences: a batch would hold some of them twice")
            self._records, self._lines = records, [f"{path} line {k}" for k in lines]
        return self._records, self._lines

    def records(self, step: int) -> list[dict]:
        return self._records_and_sources(step)[0]

    def _records_and_sources(self, step: int):
        w = self.cfg.workload
        if w.path:
            records, lines = self._file()
            n = int(w.sequences_per_step) or len(records)
            start = (step * n) % len(records)
            idx = [(start + i) % len(records) for i in range(n)]
            return [records[i] for i in idx], [lines[i] for i in idx], False
        from experiments.workloads import make_workload

        scale = str(w.scale)
        scale = scale if scale in ("tiny", "small", "full") else float(scale)
        vocab = int(w.vocab_size or self.vocab_size)
        return make_workload(w.name, scale=scale, seed=int(w.seed) + int(step),
                             vocab_size=vocab).records, None, True

    def batch(self, step: int) -> Batch:
        records, sources, generated = self._records_and_sources(step)
        records = self._with_advantages(records, sources, generated)
        return Batch.from_records(records, sources=sources, vocab_size=self.vocab_size)

    # ------------------------------------------------------------------ advantages --
    def _with_advantages(self, records, sources, generated: bool) -> list[dict]:
        from dta.config.schema import default_config

        a = self.cfg.actor
        where = (lambda i: sources[i]) if sources else (lambda i: f"sequence {i}")
        has_reward = [("reward" in r) for r in records]
        if generated:  # the generator gives both: its advantages come from its rewards
            key = "advantages" if a.adv_norm is not None else "reward"
            records = [{k: v for k, v in r.items() if k != key} for r in records]
            has_reward = [key == "advantages" and h for h in has_reward]
        if a.adv_norm is None:
            both = [i for i, r in enumerate(records) if "reward" in r and "advantages" in r]
            if both:
                raise BatchSourceError(f"{where(both[0])}: has both 'advantages' and 'reward'; "
                                       "give one (or set actor.adv_norm to compute advantages "
                                       "from rewards)")
        if not any(has_reward):
            defaults = default_config()
            for key in REWARD_KEYS:
                if getattr(a, key.split(".")[1]) != getattr(defaults.actor, key.split(".")[1]):
                    raise BatchSourceError(f"config key '{key}' has no effect: the records "
                                           "carry no 'reward'")
            if a.adv_norm is not None:
                raise BatchSourceError("actor.adv_norm is set, but the records carry no "
                                       "'reward' to compute advantages from")
            return records
        if not all(has_reward):
            i = has_reward.index(False)
            raise BatchSourceError(f"{where(i)}: field 'reward' is missing (given for other "
                                   "sequences)")
        if a.adv_norm is not None:
            both = [i for i, r in enumerate(records) if "advantages" in r]
            if both:
                raise BatchSourceError(
                    f"{where(both[0])}: has its own 'advantages', but actor.adv_norm computes "
                    "them from 'reward'; drop one (or set actor.adv_norm=null)")
        from dta.advantages import grpo_advantages

        masks = []
        for r in records:
            n = len(r["input_ids"])
            m = np.asarray(r["loss_mask"], dtype=np.float64).copy() if "loss_mask" in r \
                else np.ones(n)
            m[0] = 0.0
            masks.append(m)
        rewards = np.array([float(r["reward"]) for r in records])
        norm = a.adv_norm
        group_size = int(norm.group_size) if norm is not None else 1
        if norm is not None and group_size == 1:
            group_size = int(a.group_size)
        groups = [r.get("group_id") for r in records]
        try:
            adv = grpo_advantages(
                rewards, masks, group_ids=groups if any(g is not None for g in groups) else None,
                mean_level=norm.mean_level if norm is not None else None,
                std_level=norm.std_level if norm is not None else None,
                group_size=group_size, eps=float(norm.eps) if norm is not None else 0.0,
                scaling=float(a.reward_scaling), bias=float(a.reward_bias),
                clip=float(a.reward_clip))
        except ValueError as exc:
            raise BatchSourceError(f"GRPO advantages: {exc}") from None
        return [{**r, "advantages": v} for r, v in zip(records, adv)]

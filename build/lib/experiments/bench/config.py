"""The benchmark's settings (:class:`BenchConfig`), shared by the harness
(:mod:`experiments.bench.run`) and its command-line options (:mod:`experiments.bench.cli`),
which both import this module and not each other's."""
from __future__ import annotations

from dataclasses import dataclass, field

from experiments.bench.modes import DEFAULT_MODES

TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 5e-2, "float16": 2e-2}


@dataclass
class BenchConfig:
    workload: str = "tau2-airline"
    scale: str = "small"
    seed: int = 0
    family: str = "qwen3"
    size: str = "small"
    dtype: str = "float32"
    device: str = "cpu"
    attn: str = "sdpa"
    loss: str | None = None  # ppo | nll; None: ppo, or for --input what its fields allow
    modes: tuple = DEFAULT_MODES
    repeats: int = 3
    threads: int = 2
    warmup: str = "small"  # small | full | none (see experiments.bench.worker)
    in_process: bool = False  # all runs of a point in one worker process (GPU script)
    microbatch_tokens: int | None = None
    pad_batch: int = 0
    tree_tokens: int = 32768
    logits_chunk: int = 1024
    packing: str = "auto"  # DFS modes dfs-retain / dfs-recompute (dfs-node: node by node)
    pack_tokens: int | None = None  # None: dta.planning.packs.default_cap (by memory policy)
    head_rows: int | None = None  # DFS head flush cap (default: logits_chunk)
    timeout: float = 600.0
    grad_tol: float | None = None
    grad_full_max: int = 64_000_000
    sample_ms: float = 2.0
    sweep: str | None = None  # None | batch | sharing
    sweep_values: str | None = None
    overrides: dict = field(default_factory=dict)
    out: str | None = None
    input: str | None = None  # a JSONL batch (dta.records.jsonl) instead of the generated workload
    max_sequences: int | None = None  # --input: cut by whole groups and episodes
    max_tokens: int | None = None
    model_path: str | None = None  # a local Hugging Face model directory (else family/size)
    vocab_size: int | None = None  # random-init model: override the size's vocabulary

    @property
    def tol(self) -> float:
        return self.grad_tol if self.grad_tol is not None else TOLERANCE.get(self.dtype, 1e-4)

    def opts(self) -> dict:
        return dict(microbatch_tokens=self.microbatch_tokens, pad_batch=self.pad_batch,
                    tree_tokens=self.tree_tokens, logits_chunk=self.logits_chunk,
                    packing=self.packing, pack_tokens=self.pack_tokens, head_rows=self.head_rows)

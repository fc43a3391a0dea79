"""The LM head's chunk rule: how many rows one head evaluation takes (integers only; the head,
``dta/model/head.py``, and the memory model, ``dta/planning/memory.py``, both read it)."""

# The logits workspace of one head chunk (bytes; see LMHead): experiments/hybrid_memory.py
# measured the 1,024-row workspace as the largest live tensor at the peak of a walk step of
# the 32K-vocabulary "small" models (125 MB of 370 MB live, recompute); at 32 MiB it was
# still on the peak of a block walk (a leaf block's head call, its graph alive:
# docs/memory.md). 16 MiB is 131 rows of a 32K vocabulary; a 150K vocabulary in half
# precision stays at MIN_ROWS either way.
LOGITS_BYTES = 16 * 2**20
MIN_ROWS = 64


def logits_rows(chunk: int, vocab: int, itemsize: int = 4) -> int:
    """Rows of one head chunk: at most ``chunk``, and at most what keeps the chunk's logits
    (float32 at least: half-precision logits are made float32) within LOGITS_BYTES, but at
    least MIN_ROWS."""
    per_row = max(int(vocab), 1) * max(int(itemsize), 4)
    return int(min(int(chunk), max(MIN_ROWS, LOGITS_BYTES // per_row)))

"""DTA: depth-first tree training. Exact gradients of prefix-shared batches, one
root-to-leaf path of activations at a time. The library never imports ray, areal or runtime.

Names are imported lazily, so metadata-only modules (``dta.tree``, ``dta.planning``,
``dta.records.jsonl``) do not pay for importing torch and transformers.
"""
import importlib

_EXPORTS = {
    "Batch": "dta.batch", "BatchError": "dta.batch",
    "NLL": "dta.losses", "PPO": "dta.losses", "SequenceLoss": "dta.losses",
    "TokenLoss": "dta.losses", "Totals": "dta.losses", "batch_totals": "dta.losses",
    "make_loss": "dta.losses",
    "build_model": "dta.model.models", "load_model": "dta.model.models", "make_truly_float64": "dta.model.models",
    "DFSTrainer": "dta.train", "StepResult": "dta.train", "accumulate_gradients": "dta.train",
    "clip_and_step": "dta.train", "forward_logprobs": "dta.train",
    "PrefixTree": "dta.tree", "Segment": "dta.tree", "TreeStats": "dta.tree",
    "Walker": "dta.walk", "WalkResult": "dta.walk", "WalkOptions": "dta.options",
    "verify": "dta.verify",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dta' has no attribute {name!r}")

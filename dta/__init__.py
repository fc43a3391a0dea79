"""DTA: depth-first tree training. Exact gradients of prefix-shared batches, one
root-to-leaf path of activations at a time. The library never imports ray, areal or runtime.
"""
from dta.batch import Batch, BatchError
from dta.losses import NLL, PPO, SequenceLoss, TokenLoss, Totals, batch_totals, make_loss
from dta.models import build_model, load_model, make_truly_float64
from dta.train import DFSTrainer, StepResult, accumulate_gradients, clip_and_step, forward_logprobs
from dta.tree import PrefixTree, Segment, TreeStats
from dta.walk import Walker, WalkResult

__all__ = [
    "Batch", "BatchError", "NLL", "PPO", "SequenceLoss", "TokenLoss", "Totals", "batch_totals",
    "make_loss", "build_model", "load_model", "make_truly_float64", "DFSTrainer", "StepResult",
    "accumulate_gradients", "clip_and_step", "forward_logprobs", "PrefixTree", "Segment",
    "TreeStats", "Walker", "WalkResult",
]

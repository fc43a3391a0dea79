"""The structural fact behind 'memory bounded by one path': walked node by node with the head
at every push, the node graphs alive at any moment never exceed the depth of the tree
(retain) or one (recompute, packed or not); packed with retain, leaf packs waiting for a
batched head flush add to the path, and the count never exceeds what the walker reports. Counted independently of
the walker's own bookkeeping: every tensor autograd saves is tagged with the pack being
forwarded, and the distinct tags among saved tensors still alive are the live graphs."""
import numpy as np
import pytest
import torch

from dta.batch import Batch
from dta.losses import NLL
from dta.model.models import build_model
from dta.selfcheck import ensure_self_check
from dta.train import accumulate_gradients
from dta.tree import PrefixTree
from dta.walk import Walker


def comb(leaves: int, rng):
    """One shared prefix, `leaves` children; and a depth-6 chain for the depth bound."""
    prefix = rng.integers(3, 500, 30)
    return [np.concatenate([prefix, rng.integers(3, 500, 5)]) for _ in range(leaves)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("policy,bound", [("retain", "depth"), ("recompute", 1)])
@pytest.mark.parametrize("leaves", [1, 8, 32])
def test_live_graphs_bounded_by_path(monkeypatch, policy, bound, leaves, packed):
    rng = np.random.default_rng(leaves)
    seqs = comb(leaves, rng)
    chain = rng.integers(3, 500, 40)
    seqs += [chain[:n] for n in (8, 14, 20, 26, 32, 40)]  # nested: a path of depth 6
    model = build_model("llama", "tiny")
    ensure_self_check(model)  # the walker's one-time probe is not part of the walk counted here
    alive: dict[int, int] = {}  # node -> saved tensors of its graph still alive
    current, peak = [None], [0]

    class Saved:
        def __init__(self, tensor):
            self.tensor, self.node = tensor, current[0]
            alive[self.node] = alive.get(self.node, 0) + 1
            peak[0] = max(peak[0], sum(1 for n in alive.values() if n))

        def __del__(self):
            alive[self.node] -= 1

    original = Walker._forward

    def tagging_forward(self, tree, layout, path, *rest):
        current[0] = int(layout.tree_nodes[0])
        return original(self, tree, layout, path, *rest)

    monkeypatch.setattr(Walker, "_forward", tagging_forward)
    batch = Batch.from_records([{"input_ids": s} for s in seqs])
    with torch.autograd.graph.saved_tensors_hooks(Saved, lambda saved: saved.tensor):
        kw = dict(packing="auto", pack_tokens=64) if packed else dict(packing="node", head_rows=0)
        res = accumulate_gradients(model, batch, NLL(), policy=policy, **kw)
    depth = PrefixTree(seqs).depth()
    assert depth >= 6
    limit = depth if bound == "depth" else bound
    print(policy, leaves, "peak live graphs", peak[0], "depth", depth)
    assert 1 <= peak[0] <= res.walk.max_live_graphs
    if not packed or policy == "recompute":
        assert res.walk.max_live_graphs <= limit
    else:  # retain: plus leaf packs waiting for a head flush (at most one per leaf)
        assert res.walk.max_live_graphs <= limit + leaves
        assert res.walk.packs < res.walk.nodes or leaves == 1
    assert res.walk.max_path <= depth - 1


def _own_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_frames_hold_their_own_states_only(monkeypatch, family, policy):
    """A frame's K/V (and recurrent states) are its own rows, not views into the forward's
    cache -- which joins the whole path's K/V -- so a path of n blocks holds n blocks of K/V,
    not 1 + 2 + ... + n. (A mask's forms are carried by the mask: they go with it.)"""
    from dta.model.modeling import ModelInterface

    model = build_model(family, "tiny")
    ensure_self_check(model)
    seqs = [np.random.default_rng(s).integers(3, 500, 70) for s in range(3)]
    batch = Batch.from_records([{"input_ids": s, "loss_mask": np.ones(len(s))} for s in seqs])
    states = []
    real = ModelInterface.state_leaves
    monkeypatch.setattr(ModelInterface, "state_leaves",
                        lambda self, state: states.append(real(self, state)) or states[-1])
    accumulate_gradients(model, batch, NLL(), policy=policy, block_tokens=8)
    tensors = [x for s in states for layer in s for x in layer]
    assert len(states) >= 8 and tensors  # 70 tokens in blocks of 8: a chain of frames
    assert all(x.untyped_storage().nbytes() == _own_bytes(x) for x in tensors)

"""The router's load-balancing loss, per sequence, in the DFS walk (``docs/moe.md``).

Per-sequence training adds, for each sequence s (n_s tokens, L MoE layers, E experts),
Hugging Face's ``load_balancing_loss_func`` of that sequence alone, times the coefficient and
the sequence's weight in the policy loss (``Objective.sequence_weights``):

    aux_s = E · Σ_e f_e(s) · P_e(s),   f_e(s) = c_e(s) / (L n_s),   P_e(s) = p_e(s) / (L n_s)
    c_e(s) = Σ_{layers, tokens of s} [e among the token's experts]   (counts: no gradient)
    p_e(s) = Σ_{layers, tokens of s} softmax(router logits)_e        (differentiable)
    loss  += coef · ω_s · aux_s

(the experts are those the forward used: the router's top-k, or the replayed ones). Hence
∂loss/∂softmax_e(token t, any layer) = Σ_{s through t} coef · ω_s · E · c_e(s) / (L n_s)²:
one E-vector per token, the same in every layer, summed over the sequences below a shared
token. In the walk a pack's per-row counts are known after its forward; a sequence ending
in a pack sums its counts along the path (the rows through each frame on the stack, then
its own rows in the pack), and adds its coefficient vector into every row on its path
(``coef`` accumulators, like K/V gradients in the frames' leaves). A pack's surrogate
Σ_rows coef_row · p_row (its rows' router probabilities summed over layers, with graph) is
backpropagated with the pack: at once for a leaf pack (every sequence through it ends in
it), at pop for the others (every sequence below has ended). Its gradient is the exact one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class NoRouterAux:
    """coef = 0: nothing captured, nothing added."""

    capture = False
    value = 0.0

    def pushed(self, i, layout, path, routed, is_leaf):
        return []

    def popped(self, i, routed):
        return []


@dataclass
class _PackRows:
    counts: np.ndarray  # [T, E] expert picks per row, summed over MoE layers
    probs: np.ndarray  # [T, E] router probabilities per row, summed over layers (values)
    coef: np.ndarray  # [T, E] ∂loss/∂(router probability) per row, accumulated
    part: object  # the rows this process forwards (dta.model.placement.PackPart)
    graph: torch.Tensor | None = None  # retain: [rows, E] its rows' probabilities, with graph


def layer_probs(routed) -> tuple[np.ndarray, torch.Tensor]:
    """(counts [T, E] numpy, probabilities [T, E] with graph), summed over the MoE layers."""
    layers = sorted(routed.logits)
    logits = [routed.logits[layer] for layer in layers]
    E = logits[0].shape[-1]
    dtype = torch.float64 if logits[0].dtype == torch.float64 else torch.float32
    probs = sum(torch.softmax(z.to(dtype), dim=-1) for z in logits)
    counts = sum(torch.nn.functional.one_hot(routed.experts[layer], E).sum(1) for layer in layers)
    return counts.detach().cpu().numpy().astype(np.float64), probs


class RouterAux:
    """The aux loss's bookkeeping over one walk (module docstring). Under context
    parallelism a process routes its own rows of a pack (``placement.part``): the rows'
    counts and probabilities are gathered over the group, every process keeps the whole
    pack's coefficients, and each backpropagates its own rows' surrogate."""

    capture = True

    def __init__(self, coef: float, tree, seq_weights: np.ndarray, num_layers: int, placement):
        self.coef, self.tree, self.L = float(coef), tree, int(num_layers)
        self.omega = np.asarray(seq_weights, dtype=np.float64)
        self.placement = placement
        self.packs: dict[int, _PackRows] = {}
        self.value = 0.0

    def _surrogate(self, rows: _PackRows, probs: torch.Tensor) -> list:
        if not probs.requires_grad or not np.any(rows.coef):  # the whole pack's: every rank
            return []
        part = rows.part
        c = torch.as_tensor(rows.coef[part.lo:part.hi], device=probs.device, dtype=probs.dtype)
        c = part.pad(c, 0)
        return [((c * probs).sum(), torch.ones((), device=probs.device, dtype=probs.dtype))]

    def pushed(self, i: int, layout, path, routed, is_leaf: bool) -> list:
        """After pack i's forward: its rows' counts; the sequences ending in it add their
        value and their coefficients along the path. A leaf pack's (output, gradient) pairs
        to backpropagate now (a pack above it returns them at pop)."""
        part = self.placement.part(layout.tokens)
        counts, probs = layer_probs(routed)
        mine = torch.stack([torch.as_tensor(counts[: part.real], device=probs.device,
                                            dtype=torch.float64),
                            probs[: part.real].detach().to(torch.float64)], dim=1)
        whole = self.placement.gather_rows(mine, part).cpu().numpy()  # [T, 2, E]
        counts = whole[:, 0]
        rows = _PackRows(counts, whole[:, 1], np.zeros_like(counts), part,
                         None if is_leaf else probs)
        self.packs[i] = rows
        tree = self.tree
        # the rows of each frame on the path that this pack's tokens follow
        heads = [f.layout.tree_nodes[0] for f in path[1:]] + [layout.tree_nodes[0]]
        on_path = []
        for f, head in zip(path, heads):
            through = int(tree.parent[head])
            local = int(np.flatnonzero(f.layout.tree_nodes == through)[0])
            on_path.append((self.packs[f.pack], f.layout.path_rows(local)))
        pre_c = sum((r.counts[idx].sum(0) for r, idx in on_path), np.zeros(counts.shape[1]))
        pre_p = sum((r.probs[idx].sum(0) for r, idx in on_path), np.zeros(counts.shape[1]))
        E = counts.shape[1]
        carried = np.zeros(E)  # Σ coefficient vectors of the sequences ending in this pack
        for local, u in enumerate(layout.tree_nodes):
            ending = [int(s) for s in tree.ending[int(u)] if self.omega[int(s)] != 0]
            if not ending:
                continue
            own = layout.path_rows(local)
            c_s = pre_c + counts[own].sum(0)
            p_s = pre_p + rows.probs[own].sum(0)
            n = layout.prefix + len(own)  # a pack hangs below one node: its rows follow it
            denom = (self.L * n) ** 2
            for s in ending:
                if len(tree.sequences[s]) != n:
                    raise RuntimeError(f"router aux loss: sequence {s} has "
                                       f"{len(tree.sequences[s])} tokens, its path {n}")
                w = self.coef * self.omega[s] * E / denom
                self.value += float(w * (c_s * p_s).sum())
                g = w * c_s
                rows.coef[own] += g
                carried += g
        if carried.any():
            for r, idx in on_path:
                r.coef[idx] += carried
        if is_leaf:
            del self.packs[i]
            return self._surrogate(rows, probs)
        return []

    def popped(self, i: int, routed) -> list:
        """Pack i's (output, gradient) pairs at its pop: its accumulated coefficients times
        its rows' probabilities (retain: kept from the push; recompute: the re-forward's)."""
        rows = self.packs.pop(i)
        probs = rows.graph if routed is None else layer_probs(routed)[1]
        return self._surrogate(rows, probs)


def router_aux(coef: float, tree, objective, io) -> RouterAux | NoRouterAux:
    """The bookkeeping of one walk (``io``: its ``dta.model.modeling.ModelInterface``):
    ``RouterAux`` for coef > 0, else the no-op."""
    if coef > 0:
        return RouterAux(coef, tree, objective.sequence_weights, io.moe.layers, io.placement)
    return NoRouterAux()

"""Every attention family of the registry under every packing, float64: the packed walk's
loss, log-probs and every gradient equal one-sequence-at-a-time training to <= 1e-10, under
both memory policies. (``tests/test_families.py`` checks each family through ``verify`` with
the default ``auto`` plan, an AdamW update included; ``tests/test_packs.py`` checks every
policy on one model. This is their product. The hybrid families (Gated DeltaNet layers, whose state
follows the pack's tree) run the same matrix in tests/test_hybrid_packs.py.)"""
import pytest
import torch

from dta.model.models import build_model, make_truly_float64
from dta.planning.packs import PACKINGS
from dta.reference import unpacked_gradients
from dta.train import accumulate_gradients
from dta.verify import ZERO_FLOOR, _rel, _whole_norm, worst
from tests.test_families import ATTENTION_FAMILIES, LOSS, family_batch

CAP = 20  # tokens per pack: subtrees, siblings and auto plan differently on this batch


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}


def _worst(got: dict, ref: dict) -> float:
    """Largest per-parameter relative L2 error, as ``dta.verify`` measures it (a gradient that
    is zero in exact arithmetic against the whole gradient's norm; NaN kept)."""
    floor = ZERO_FLOOR * _whole_norm(ref.values())
    return worst(_rel(got[n], g, floor) for n, g in ref.items())


@pytest.fixture(scope="module", params=ATTENTION_FAMILIES)
def reference(request):
    model = build_model(request.param, "tiny", dtype="float64", seed=0, matrix=True)
    make_truly_float64(model)
    batch = family_batch(model)
    model.zero_grad(set_to_none=True)
    ref = unpacked_gradients(model, batch, LOSS)
    return request.param, model, batch, ref, _grads(model)


@pytest.mark.parametrize("packing", PACKINGS)
def test_family_every_packing_float64(reference, packing):
    family, model, batch, ref, g_ref = reference
    for policy in ("retain", "recompute"):
        model.zero_grad(set_to_none=True)
        res = accumulate_gradients(model, batch, LOSS, policy=policy, packing=packing,
                                   pack_tokens=CAP, logits_chunk=7, record=True)
        case = (family, packing, policy)
        assert abs(res.loss - ref.loss) <= 1e-10 * abs(ref.loss), case
        lp = max(float((a - b).abs().max()) for a, b in zip(res.walk.logprobs, ref.logprobs))
        assert lp <= 1e-10, case
        assert _worst(_grads(model), g_ref) <= 1e-10, case
        assert res.walk.packs == res.walk.plan["packs"], case
        if packing == "node":
            assert res.walk.packs == res.walk.nodes, case
        elif packing == "tree":
            assert res.walk.packs == 1 and res.walk.masked_packs == 1, case

"""Memory facts of the packed walk: the LM head's logits budget, the default pack cap by memory
policy, and what a hybrid (GDN) pack saves for backward against the model's own forward.

(The step-level figures -- peak live bytes by source line against micro-batching -- come from
``python -m experiments.hybrid_memory``; no memory figure is asserted here beyond these
structural bounds.)
"""
import numpy as np
import torch

from dta.batch import Batch
from dta.losses import PPO
from dta.model.head import LOGITS_BYTES, MIN_ROWS, logits_rows
from dta.planning.packs import DEFAULT_CAP, RECOMPUTE_CAP_DIVISOR, default_cap
from dta.train import accumulate_gradients
from dta.tree import PrefixTree
from tests.cases import make_records
from tests.test_hybrid import hybrid_model


def test_logits_rows_budget():
    assert logits_rows(1024, 32000) == LOGITS_BYTES // (32000 * 4)  # 131 rows, 16 MiB
    assert logits_rows(7, 32000) == 7  # a smaller chunk is kept
    assert logits_rows(1024, 151936, 2) == MIN_ROWS  # half precision: float32 logits, floor
    assert logits_rows(1024, 512, 8) == 1024  # a small vocabulary: the chunk itself


def test_default_cap_by_policy():
    rng = np.random.default_rng(0)
    short = PrefixTree([rng.integers(3, 500, n) for n in (40, 300, 700)])
    long = PrefixTree([rng.integers(3, 500, n) for n in (40, 2708)])
    assert default_cap(short, "retain") == default_cap(long, "retain") == DEFAULT_CAP
    assert default_cap(short, "recompute") == DEFAULT_CAP
    assert default_cap(long, "recompute") == 2708 // RECOMPUTE_CAP_DIVISOR > DEFAULT_CAP


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_gdn_pack_saves_no_more_than_the_models_forward():
    """One 300-token sequence as one pack: the walk saves for backward at most 1.1x what the
    model's own (HF) forward saves for the same tokens (the pack path once saved each conv
    window and a copy of every chunked operand per product: 1.18x on this model)."""
    torch.manual_seed(0)
    model = hybrid_model("qwen3_5", torch.float32)
    ids = np.random.default_rng(0).integers(3, 500, 300)
    x = torch.as_tensor(ids)[None]
    hf = _saved_bytes(lambda: model.get_decoder()(input_ids=x, use_cache=False).last_hidden_state)
    batch = Batch.from_records(make_records([ids]))
    walked = _saved_bytes(lambda: accumulate_gradients(model, batch, PPO(eps_clip=0.2),
                                                       packing="tree", self_check=False))
    if walked > 1.1 * hf:
        raise AssertionError(f"the pack walk saves {walked} bytes, HF's forward {hf}")

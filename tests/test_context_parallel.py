"""Context parallelism (dta/model/context_parallel.py): a group of C gloo ranks on CPU walks one
tree, each rank forwarding its rows of every pack and attending for its heads (the path's
K/V stored split by heads). float64 on a truly float64 model: the group's gradient -- the
sum of the ranks' partial gradients -- against one-sequence-at-a-time training
(``dta.verify``: log-probs, loss, every gradient, one AdamW update) <= 1e-10, on every
rank; each rank's own gradient is a partial one (it differs from the group's); the ranks
exchanged data (bytes sent > 0); each rank stored its share of the path's K/V.

The batch: the window tree (forks beyond the sliding window of 8; paths up to 45 tokens) and
the hard batch (a chain of depth 8, duplicates, a strict prefix, single-token branches,
unrelated trees). Walked node by node in blocks of 5 tokens (1..5-row packs split unevenly,
ranks with no row of a pack forwarding a phantom row) and in packs of up to 12 tokens
(masked packs). The tiny models have 4 query heads over 2 K/V heads (and 4 Gated DeltaNet
value heads over 2 key heads): C = 3 and 4 share K/V heads between ranks. Default suite: a
few cases at C = 2 and 3; ``slow``: C = 2, 3, 4 x llama, qwen3, mistral, qwen3_moe (replay +
aux loss), qwen3_5 (Gated DeltaNet) x both policies x both walks, and LoRA and the opaque
sequence-level loss.
"""
import numpy as np
import pytest
import torch

from dta.local_ranks import run_group

TOL = 1e-10
WALKS = {"blocks": dict(packing="node", block_tokens=5),
         "packs": dict(packing="auto", pack_tokens=12, block_tokens=0)}
MOE = {"qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe", "qwen3_next"}
COEF = 0.01


KV4 = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)  # "kv4": 4 K/V heads


def _model_and_batch(family: str, lora: bool = False, kv4: bool = False):
    from dta.batch import Batch
    from dta.model.models import SIZES, build_model, make_truly_float64
    from dta.train import forward_logprobs
    from tests.cases import hard_sequences, make_records
    from tests.test_families import window_sequences

    size = dict(SIZES["tiny"], **KV4) if kv4 else "tiny"
    model = build_model(family, size, dtype="float64", seed=0, matrix=True)
    if lora:  # adapters on q and v only: the keys of the first layer need no gradient
        from dta.model.lora import apply_lora

        model = apply_lora(model, r=2, alpha=4.0, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)
    make_truly_float64(model)
    seqs = window_sequences() + hard_sequences()
    if family in MOE:  # replayed routing (not the router's own choice) and the aux loss
        from tests.test_moe import replay_batch

        return model, replay_batch(model, seqs)
    lp = forward_logprobs(model, Batch.from_records([{"input_ids": s} for s in seqs])).logprobs
    return model, Batch.from_records(make_records(seqs, old_logprobs=[x.numpy() for x in lp]))


def run_cases(group, cases):
    """On one rank: verify each case on the group (``dta.verify`` sums the ranks' gradients);
    walk it once more to read this rank's own (partial) gradient, and once alone (the same
    code on a group of one: the path K/V one process stores)."""
    import copy

    import torch.distributed as dist

    from dta.losses import PPO
    from dta.model.context_parallel import ContextParallel, parallelize_context
    from dta.train import accumulate_gradients
    from dta.verify import verify
    from tests.cases import SEQUENCE_LOSS

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    solo = ContextParallel([dist.new_group([r]) for r in range(size)][rank])
    out = []
    for family, policy, walk, *extra in cases:
        cp = ContextParallel(group)
        model, batch = _model_and_batch(family, lora="lora" in extra, kv4="kv4" in extra)
        loss = SEQUENCE_LOSS if "sequence_loss" in extra else PPO(eps_clip=0.2, dual_clip=3.0)
        kw = dict(WALKS[walk], router_aux_loss=COEF if family in MOE else "refuse")
        report = verify(model, batch, loss, policy=policy, context_parallel_group=cp, **kw)
        dfs = parallelize_context(copy.deepcopy(model), cp)
        res = accumulate_gradients(dfs, batch, loss, policy=policy, **kw)
        own = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                         for p in dfs.parameters() if p.requires_grad])
        solo.path_bytes_peak = solo.path_bytes
        accumulate_gradients(parallelize_context(copy.deepcopy(model), solo), batch, loss,
                             policy=policy, **kw)
        out.append(dict(case=(family, policy, walk, *extra), report=report.as_dict(),
                        loss=res.loss, own=own, alone_kv=solo.path_bytes_peak))
    return out


def check(size: int, cases) -> list:
    ranks = run_group(run_cases, size, cases)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in ranks]
        for rank, got in enumerate(per_rank):
            rep = got["report"]
            for err in ("logprobs", "loss", "grad", "params", "update"):
                assert rep[f"{err}_rel_err"] <= TOL, (size, case, rank, err, rep)
            assert rep["truly_float64"] and rep["packs"] > 10, (case, rep)
            assert rep["context_parallel"] == size
            assert rep["context_parallel_sent_bytes"] > 0, (case, rank)  # the ranks exchanged
            assert rep["context_parallel_path_kv_bytes"] > 0, (case, rank)
        # the walk's loss is the group's on every rank; each rank's gradient is its share
        assert len({g["loss"] for g in per_rank}) == 1, (size, case)
        whole = sum(g["own"] for g in per_rank)
        for got in per_rank:
            assert float((got["own"] - whole).norm()) > 1e-3 * float(whole.norm()), (size, case)
        # each rank stored its share of the path's K/V and their gradients (its K/V heads,
        # or its rows of one where C exceeds the K/V heads): at most half of one process's
        # (2 K/V heads; with 4, at C = 3: ranks of 1, 1, 2 heads)
        kv = [g["report"]["context_parallel_path_kv_bytes"] for g in per_rank]
        alone = per_rank[0]["alone_kv"]
        assert alone > 0 and max(kv) <= 0.5 * alone * (1 + 1e-9), (size, case, kv, alone)
        if "kv4" in case and size == 3:
            assert sorted(round(4 * b / alone) for b in kv) == [1, 1, 2], (case, kv, alone)
    return ranks


def test_two_ranks():
    check(2, [("qwen3", "retain", "blocks"), ("qwen3_5", "recompute", "packs")])


def test_three_ranks():
    check(3, [("mistral", "recompute", "packs"), ("qwen3_moe", "retain", "blocks")])


FAMILIES = ["llama", "qwen3", "mistral", "qwen3_moe", "qwen3_5"]


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3, 4])
def test_grid(size):
    check(size, [(f, p, w) for f in FAMILIES for p in ("retain", "recompute") for w in WALKS])


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3, 4])
def test_lora_and_sequence_loss(size):
    """LoRA (a frozen base: some K/V need no gradient) and the opaque sequence-level loss
    (a forward-only walk first, its log-probs combined over the group, then the linearized
    training walk), both on the group."""
    check(size, [("qwen3", "recompute", "blocks", "lora"), ("llama", "retain", "packs", "lora"),
                 ("qwen3", "recompute", "blocks", "sequence_loss"),
                 ("mistral", "retain", "packs", "sequence_loss"),
                 ("qwen3_5", "recompute", "packs", "sequence_loss")])


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_every_sdpa_family(size):
    """Every family of the tested matrix that runs on sdpa (all but gemma2's eager attention,
    refused), recompute in blocks and retain in packs."""
    from dta.model.families import FAMILIES

    fams = [f for f, fam in FAMILIES.items() if fam.attn_implementation == "sdpa"]
    check(size, [(f, "recompute", "blocks") for f in fams] + [(f, "retain", "packs") for f in fams])


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_four_kv_heads(size):
    """8 query heads over 4 K/V heads (and GDN: 8 value heads over 4 key heads): C = 2 splits
    them evenly, C = 3 unevenly (1, 1, 2 K/V heads; 2, 3, 3 value heads), no head shared."""
    check(size, [("qwen3", "retain", "packs", "kv4"), ("mistral", "recompute", "blocks", "kv4"),
                 ("qwen3_5", "recompute", "blocks", "kv4")])


# --------------------------------------------------------------- one process --
def _cp(rank: int, size: int):
    from dta.model.context_parallel import ContextParallel

    cp = ContextParallel.__new__(ContextParallel)
    cp.rank, cp.size = rank, size
    return cp


def test_rows_cover_a_pack_unevenly():
    """Every row of an n-row pack real on exactly one rank, in order, sizes differing by <= 1;
    a rank without a real row forwards the pack's last row as a phantom."""
    for size in (1, 2, 3, 4):
        for n in (1, 2, 5, 7, 12):
            parts = [_cp(rank, size).part(n) for rank in range(size)]
            assert parts[0].lo == 0 and parts[-1].hi == n
            assert all(a.hi == b.lo for a, b in zip(parts, parts[1:]))
            assert max(p.real for p in parts) - min(p.real for p in parts) <= 1
            for p in parts:
                assert (p.rows == slice(n - 1, n)) if p.phantom else (p.rows == slice(p.lo, p.hi))
                assert p.phantom == (p.real == 0)


@pytest.mark.parametrize("heads,kv", [(4, 2), (8, 4), (6, 3), (4, 1)])
def test_head_split_stores_every_kv_cell_once(heads, kv):
    """Every (K/V head, row) of a pack is stored by exactly one rank; every query head's
    output comes from the ranks holding its K/V head (several where they share it); each
    rank's columns of a row's [q | k | v] are its heads'."""
    from dta.model.cp_attention import HeadSplit

    D = 3
    for size in range(1, 7):
        splits = [HeadSplit(heads, kv, size, r) for r in range(size)]
        for T in (1, 2, 5, 9):
            stored = np.zeros((kv, T), int)
            for r, s in enumerate(splits):
                h0, h1 = s.kv[r]
                a, b = s.kv_rows(T)
                stored[h0:h1, a:b] += 1
            assert (stored == 1).all(), (heads, kv, size, T, stored)
        covered = sorted(h for (h0, h1), ranks in splits[0].groups for h in range(h0, h1))
        assert covered == list(range(kv))
        for (h0, h1), ranks in splits[0].groups:
            assert ranks and all(splits[0].kv[p] == (h0, h1) for p in ranks)
        for r, s in enumerate(splits):
            cols = s.columns(D, "cpu")[r].tolist()
            h0, h1 = s.kv[r]
            G = heads // kv
            want = list(range(h0 * G * D, h1 * G * D)) + \
                [heads * D + x for x in range(h0 * D, h1 * D)] + \
                [(heads + kv) * D + x for x in range(h0 * D, h1 * D)]
            assert cols == want


def test_partial_attention_is_the_masked_softmax():
    """The rank's attention alone: pieces merged by lse into a partial (out, lse), the
    partials of two key sets merged by the row owner's formula, and the backward from
    (dout, dlse) -- equal to one masked softmax over the union of keys (GQA, a window, rows
    that see none of a rank's keys)."""
    from dta.model.cp_attention import PartialAttention, _bias, _merge_rows

    g = torch.Generator().manual_seed(0)
    H, KV, T, S, D = 4, 2, 5, 9, 3
    q = torch.randn(1, H, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, KV, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, KV, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    vis = torch.rand(T, S, generator=g) > 0.4
    vis[:, 0] = True  # every row sees some key; the second rank's keys leave rows empty
    vis[:, 4:] &= torch.arange(T)[:, None] > 1
    rep = H // KV
    scores = torch.einsum("bhtd,bhsd->bhts", q, k.repeat_interleave(rep, 1)) * 0.5
    ref = torch.softmax(scores.masked_fill(~vis, float("-inf")), -1) @ v.repeat_interleave(rep, 1)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    ref.backward(dout)
    want = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    # rank A holds keys 0..3 as its "own" piece and 7..8 as a path piece; rank B keys 4..6
    a = PartialAttention.apply(q, k[:, :, :4], v[:, :, :4], 0.5, _bias(vis[:, :4], q.dtype),
                               [_bias(vis[:, 7:], q.dtype)], None, 0, 1, k[:, :, 7:], v[:, :, 7:])
    b = PartialAttention.apply(q, k[:, :, 4:7], v[:, :, 4:7], 0.5, _bias(vis[:, 4:7], q.dtype),
                               [], None, 0, 0)
    assert torch.isinf(b[1]).any()  # rows that see none of rank B's keys
    rows = lambda o, l: (o[0].transpose(0, 1), l[0].transpose(0, 1))  # [T, H, D], [T, H]
    out = _merge_rows([rows(*a), rows(*b)]).transpose(0, 1).unsqueeze(0)
    assert float((out.detach() - ref.detach()).abs().max()) < 1e-13
    out.backward(dout)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert float((got - w).abs().max()) < 1e-13


def test_refusals():
    """No group: nothing applied; a ContextParallel given explicitly is used even for one rank
    (the benchmark's C = 1 baseline); an eager-attention model, and a hybrid whose GDN layers
    have fewer value heads than the group has ranks: refused."""
    from dta.model.context_parallel import (
        ContextParallelError,
        context_parallel_of,
        parallelize_context,
    )
    from dta.model.models import build_model
    from dta.model.placement import WHOLE, placement_of

    model = build_model("llama", "tiny")
    assert context_parallel_of(parallelize_context(model, None)) is None
    one = _cp(0, 1)
    assert context_parallel_of(parallelize_context(model, one)) is one
    assert placement_of(model).partial_gradients and one.partial_gradients
    assert context_parallel_of(parallelize_context(model, None)) is None
    assert placement_of(model) is WHOLE and not WHOLE.partial_gradients
    eager = build_model("llama", "tiny", attn_implementation="eager")
    with pytest.raises(ContextParallelError, match="attention implementation 'sdpa'"):
        parallelize_context(eager, _cp(0, 2))
    hybrid = build_model("qwen3_5", "tiny")  # 4 value heads
    parallelize_context(hybrid, _cp(0, 4))
    with pytest.raises(ContextParallelError, match="4 value heads.*at most 4 ranks"):
        parallelize_context(hybrid, _cp(0, 5))


def _out_of_order(group):
    """Two exchanges forward; rank 1 backpropagates them in the other order."""
    from dta.model.context_parallel import ContextParallel, ContextParallelError

    cp = ContextParallel(group)
    part = cp.part(4)
    cols = [torch.tensor([0]), torch.tensor([1])]
    xs = [torch.randn(part.real, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    ys = [cp.rows_to_heads(x, cols, part) for x in xs]
    order = (0, 1) if cp.rank == 0 else (1, 0)
    for i in order:
        ys[i].sum().backward()
    try:
        cp.total(0.0)
    except ContextParallelError as e:
        return str(e)
    return None


def test_backward_exchanges_out_of_order_are_caught():
    """The ranks' backward exchanges must pair up: an exchange that meets another one of a
    peer (here: the same shapes, the other order) is counted and raised at the walk's end."""
    msgs = run_group(_out_of_order, 2)
    assert all(m and "different orders" in m for m in msgs), msgs


# ------------------------------------------------------------------------ the CLI --
def test_cli_verify_refuses_a_bad_group_size(capsys):
    from dta_cli.main import main

    with pytest.raises(SystemExit, match="--context-parallel must be an integer >= 1"):
        main(["verify", "--family", "qwen3", "--context-parallel", "0"])


@pytest.mark.slow
def test_cli_verify_context_parallel(capsys):
    """The issue's command (one pack: every row and head exchanged, no path), and a walk that
    spreads a path over 3 ranks."""
    import json

    from dta_cli.main import main

    assert main(["verify", "--family", "qwen3", "--dtype", "float64", "--context-parallel", "2",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["passed"] and got["context_parallel"] == 2 and got["max_rel_err"] <= TOL
    assert min(got["context_parallel_ranks"]["sent_bytes"]) > 0
    assert main(["verify", "--family", "qwen3", "--dtype", "float64", "--context-parallel", "3",
                 "--packing", "node", "--block-tokens", "16", "--policy", "recompute",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["passed"] and got["context_parallel"] == 3 and got["max_rel_err"] <= TOL
    ranks = got["context_parallel_ranks"]
    assert min(ranks["sent_bytes"]) > 0 and got["path_tokens"] > 16
    assert ranks["path_kv_alone_bytes"] > 0 and max(ranks["path_kv_share"]) <= 0.5 + 1e-9

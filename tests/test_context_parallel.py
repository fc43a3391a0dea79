"""Context parallelism (dta/model/context_parallel.py): a group of C gloo ranks on CPU walks
one tree with every pack's K/V stored spread over the group. float64 on a truly float64
model, every rank against one-sequence-at-a-time training (``dta.verify``: log-probs, loss,
every gradient, one AdamW update) <= 1e-10; the parameter gradients bitwise identical on
every rank; the group really exchanged the path attention (collectives counted).

The batch: the window tree (forks beyond the sliding window of 8; paths up to 45 tokens) and
the hard batch (a chain of depth 8, duplicates, a strict prefix, single-token branches,
unrelated trees). Walked node by node in blocks of 5 tokens (blocks shorter than nodes, C
ranks splitting 1..5-row packs unevenly, some ranks holding no row of a pack) and in packs of
up to 12 tokens (masked packs). Default suite: C = 2 and 3 on a few families (one spawned
group per test); ``slow``: C = 2, 3, 4 x llama, qwen3, mistral, qwen3_moe (replay + aux loss),
qwen3_5 (Gated DeltaNet) x both policies x both walks, and LoRA and the opaque sequence-level
loss on C = 2, 3.
"""
import hashlib

import numpy as np
import pytest
import torch

from dta.context_parallel import run_group

TOL = 1e-10
WALKS = {"blocks": dict(packing="node", block_tokens=5),
         "packs": dict(packing="auto", pack_tokens=12, block_tokens=None)}
MOE = {"qwen3_moe", "mixtral", "olmoe", "qwen3_5_moe", "qwen3_next"}
COEF = 0.01


def _model_and_batch(family: str, lora: bool = False):
    from dta.batch import Batch
    from dta.model.models import build_model, make_truly_float64
    from dta.train import forward_logprobs
    from tests.cases import hard_sequences, make_records
    from tests.test_families import window_sequences

    model = build_model(family, "tiny", dtype="float64", seed=0, matrix=True)
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


def _digest(model) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        if p.grad is not None:
            h.update(p.grad.detach().numpy().tobytes())
    return h.hexdigest()


def run_cases(group, cases):
    """On one rank: verify each case, and digest its DFS gradient (for the ranks' equality)."""
    import copy

    from dta.losses import PPO
    from dta.model.context_parallel import ContextParallel, parallelize_context
    from dta.train import accumulate_gradients
    from dta.verify import verify

    from tests.cases import SEQUENCE_LOSS

    out = []
    for family, policy, walk, *extra in cases:
        cp = ContextParallel(group)
        model, batch = _model_and_batch(family, lora="lora" in extra)
        loss = SEQUENCE_LOSS if "sequence_loss" in extra else PPO(eps_clip=0.2, dual_clip=3.0)
        kw = dict(WALKS[walk], router_aux_loss_coef=COEF if family in MOE else 0.0)
        report = verify(model, batch, loss, policy=policy, context_parallel_group=cp, **kw)
        sent = cp.sent_bytes
        dfs = parallelize_context(copy.deepcopy(model), cp)
        accumulate_gradients(dfs, batch, loss, policy=policy, **kw)
        out.append(dict(case=(family, policy, walk, *extra), report=report.as_dict(),
                        packs=report.packs, sent=sent, digest=_digest(dfs)))
    return out


def check(size: int, cases) -> list:
    ranks = run_group(run_cases, size, cases)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in ranks]
        for rank, got in enumerate(per_rank):
            rep = got["report"]
            for err in ("logprobs", "loss", "grad", "params", "update"):
                assert rep[f"{err}_rel_err"] <= TOL, (size, case, rank, err, rep)
            assert rep["truly_float64"] and got["packs"] > 10, (case, got)
            assert got["sent"] > 0, (case, rank)  # the path attention was exchanged
        assert len({g["digest"] for g in per_rank}) == 1, (size, case)  # identical gradients
    return ranks


def test_two_ranks():
    check(2, [("qwen3", "retain", "blocks"), ("mistral", "recompute", "packs"),
              ("qwen3_moe", "recompute", "blocks")])


def test_three_ranks():
    check(3, [("llama", "retain", "blocks"), ("qwen3_5", "recompute", "packs")])


FAMILIES = ["llama", "qwen3", "mistral", "qwen3_moe", "qwen3_5"]


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3, 4])
def test_grid(size):
    check(size, [(f, p, w) for f in FAMILIES for p in ("retain", "recompute") for w in WALKS])


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_lora_and_sequence_loss(size):
    """LoRA (a frozen base: some K/V need no gradient) and the opaque sequence-level loss
    (a forward-only walk first, then the linearized training walk), both on the group."""
    check(size, [("qwen3", "recompute", "blocks", "lora"), ("llama", "retain", "packs", "lora"),
                 ("qwen3", "recompute", "blocks", "sequence_loss"),
                 ("mistral", "retain", "packs", "sequence_loss")])


# --------------------------------------------------------------- one process --
def test_rows_cover_a_pack_unevenly():
    """Every row of an n-row pack on exactly one rank, in order, sizes differing by <= 1."""
    from dta.model.context_parallel import ContextParallel

    for size in (2, 3, 4):
        for n in (1, 2, 5, 7, 12):
            spans = []
            for rank in range(size):
                cp = ContextParallel.__new__(ContextParallel)
                cp.rank, cp.size = rank, size
                spans.append(cp.rows(n))
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            lengths = [b - a for a, b in spans]
            assert max(lengths) - min(lengths) <= 1


def test_piece_attention_is_the_masked_softmax():
    """The piece algebra alone: pieces merged by lse, and their backward from the merged
    out/lse, equal one masked softmax over the union of keys (GQA, a window, empty rows)."""
    from dta.model.context_parallel import _bias, _fold, _merge, _piece_backward, _piece_forward

    g = torch.Generator().manual_seed(0)
    H, KV, T, S, D = 4, 2, 5, 9, 3
    q = torch.randn(1, H, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(1, KV, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(1, KV, S, D, dtype=torch.float64, generator=g, requires_grad=True)
    vis = torch.rand(T, S, generator=g) > 0.4
    vis[:, 0] = True  # every row sees some key; the pieces below have empty rows
    vis[:, 4:] &= torch.arange(T)[:, None] > 1
    scores = torch.einsum("bhtd,bhsd->bhts", q, k.repeat_interleave(H // KV, 1)) * 0.5
    ref = torch.softmax(scores.masked_fill(~vis, float("-inf")), -1) @ v.repeat_interleave(H // KV, 1)
    dout = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    ref.backward(dout)
    ref = ref.detach()
    qf, cuts = _fold(q.detach(), KV), [(0, 4), (4, 9)]
    parts = [_piece_forward(qf, k.detach()[:, :, a:b], v.detach()[:, :, a:b],
                            _bias(vis[:, a:b], torch.float64), 0.5, H // KV) for a, b in cuts]
    assert torch.isinf(parts[1][1]).any()  # rows that see none of the second piece
    out, lse = _merge(parts)
    assert float((out.reshape(ref.shape) - ref).abs().max()) < 1e-13
    dof = _fold(dout, KV)
    delta = (dof * out).sum(-1)
    grads = [_piece_backward(qf, k.detach()[:, :, a:b], v.detach()[:, :, a:b],
                             _bias(vis[:, a:b], torch.float64), 0.5, H // KV, dof, lse, delta)
             for a, b in cuts]
    dq = sum(x[0] for x in grads).reshape(q.shape)
    assert float((dq - q.grad).abs().max()) < 1e-13
    assert float((torch.cat([x[1] for x in grads], 2) - k.grad).abs().max()) < 1e-13
    assert float((torch.cat([x[2] for x in grads], 2) - v.grad).abs().max()) < 1e-13


def test_refusals():
    """No group: nothing applied; a ContextParallel given explicitly is used even for one rank
    (the benchmark's C = 1 baseline); an eager-attention model: refused."""
    from dta.model.context_parallel import (ContextParallel, ContextParallelError,
                                            context_parallel_of, parallelize_context)
    from dta.model.models import build_model

    model = build_model("llama", "tiny")
    assert context_parallel_of(parallelize_context(model, None)) is None
    one = ContextParallel.__new__(ContextParallel)
    one.size, one.rank = 1, 0
    assert context_parallel_of(parallelize_context(model, one)) is one
    assert context_parallel_of(parallelize_context(model, None)) is None
    two = ContextParallel.__new__(ContextParallel)
    two.size, two.rank = 2, 0
    eager = build_model("llama", "tiny", attn_implementation="eager")
    with pytest.raises(ContextParallelError, match="attention implementation 'sdpa'"):
        parallelize_context(eager, two)


# ------------------------------------------------------------------------ the CLI --
def test_cli_verify_refuses_a_bad_group_size(capsys):
    from dta_cli.main import main

    with pytest.raises(SystemExit, match="--context-parallel must be an integer >= 1"):
        main(["verify", "--family", "qwen3", "--context-parallel", "0"])


@pytest.mark.slow
def test_cli_verify_context_parallel(capsys):
    """The issue's command, and a walk that spreads a path over 3 ranks."""
    import json

    from dta_cli.main import main

    assert main(["verify", "--family", "qwen3", "--dtype", "float64", "--context-parallel", "2",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["passed"] and got["context_parallel"] == 2 and got["max_rel_err"] <= TOL
    assert main(["verify", "--family", "qwen3", "--dtype", "float64", "--context-parallel", "3",
                 "--packing", "node", "--block-tokens", "16", "--policy", "recompute",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["passed"] and got["context_parallel"] == 3 and got["max_rel_err"] <= TOL
    assert got["context_parallel_sent_bytes"] > 0

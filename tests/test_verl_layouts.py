"""The dta verl engine on the engine core's layouts, against verl 0.9.1's own FSDP engine
(float64): two ``train_batch`` steps of verl's GRPO ``ppo_loss`` on the τ²-airline rows, on 2
gloo ranks with ``dta_sharding: zero1``, ``dta_sharding: fsdp`` and
``ulysses_sequence_parallel_size: 2`` (context parallelism; the sharding left to verl's
``fsdp_size: -1``, i.e. fsdp), end at the parameters verl's FSDP engine reaches in one process
on the whole batches (rel. <= 1e-10); the weights the rollout would load
(``get_per_tensor_param``, gathered under fsdp) are those parameters; under context
parallelism the ranks exchanged data; a sharded checkpoint (DCP) taken after step 1, loaded
into a fresh engine, repeats step 2 bit-identically. Settings verl cannot honour with a layout
are refused naming the key (LoRA under fsdp: the core's refusal, with verl's keys). LoRA
under zero1 with C = 2: the reference policy (``disable_adapter``) walks the base model and
the adapters after 2 steps equal one process's.

The rows of each step are split over the data-parallel groups (the ranks of a
context-parallel group receive the same rows, as verl dispatches to a Ulysses group).
tests/test_engine_front_doors.py runs every layout (replicate / zero1 / fsdp x C = 1, 2)
against one process through this front door."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests.test_verl import (  # noqa: F401
    VOCAB,
    fp64_verl,
    grpo,
    make_engine,
    model_dir,
    params,
    records,
    rel,
    verl_batch,
    world1,
)

pytestmark = pytest.mark.verl

MODE = "seq-mean-token-mean"  # normalized by the global batch size: the rank split matters
STEPS = [[0, 1, 2, 3, 4, 5, 6, 7, 8], [8, 6, 4, 2, 0, 1, 3]]  # two batches of the 9 rows
# (dta_sharding, ulysses_sequence_parallel_size); None: verl's fsdp_size=-1 says (fsdp)
LAYOUTS = [("zero1", 1), ("fsdp", 1), (None, 2)]
WALK = {"policy": "recompute", "block_tokens": 16}  # paths over several packs: C=2 exchanges


def use_fp64_verl() -> None:
    """verl's dtype table with ``fp64`` in a spawned rank (the fixture's patch, by hand)."""
    from verl.utils import torch_dtypes

    original = torch_dtypes.PrecisionType.to_dtype
    if getattr(original, "dta_fp64", False):
        return

    def to_dtype(p):
        return torch.float64 if p in ("fp64", "float64", torch.float64) else original(p)

    to_dtype.dta_fp64 = True
    torch_dtypes.PrecisionType.to_dtype = staticmethod(to_dtype)


def layout_engine(path: str, sharding: str | None, cp: int, **kw):
    """The dta engine for a layout: ``dta_sharding`` (None: from ``fsdp_size=-1``) and
    ``ulysses_sequence_parallel_size``, float64."""
    return make_engine("dta", path, "fp64", fsdp_size=-1, dta_sharding=sharding,
                       ulysses_sequence_parallel_size=cp, dta=dict(WALK), **kw)


def rows_of(td, layout):
    """This rank's rows of a step's batch: its data-parallel group's contiguous share (verl's
    dispatch), split after verl's conversion (the whole batch's normalizers kept)."""
    from verl.utils import tensordict_utils as tu

    n, dp, g = len(td), layout.data_parallel, layout.dp_rank
    return tu.index_select_tensor_dict(td, list(range(g * n // dp, (g + 1) * n // dp)))


def train(engine, batches, loss) -> None:
    """``train_batch`` and the LR schedule's step per batch (verl's grad_norm metric is on
    the ranks verl collects outputs from: the context-parallel groups' heads)."""
    for td in batches:
        out = engine.train_batch(td.clone(), loss_function=loss)
        assert ("grad_norm" in out["metrics"]) == engine.is_mp_src_rank_with_outputs()
        engine.lr_scheduler_step()


def _on_rank(rank: int, world: int, path: str, layouts: list, tmp: str) -> dict:
    from experiments.workloads import make_workload
    from runtime.verl import use_cpu_platform

    warnings.simplefilter("ignore")
    use_fp64_verl()
    use_cpu_platform()
    recs = make_workload("tau2-airline", scale="tiny", seed=0, vocab_size=VOCAB).records
    wholes = [verl_batch(recs, rows=r) for r in STEPS]
    loss = grpo(MODE)
    out = []
    for i, (sharding, cp) in enumerate(layouts):
        engine = layout_engine(path, sharding, cp)
        layout = engine.core.layout
        mine = [rows_of(td, layout) for td in wholes]
        train(engine, mine[:1], loss)
        fresh = resumed = None
        if i == len(layouts) - 1:  # a sharded checkpoint after step 1, into a fresh engine
            ckpt = os.path.join(tmp, "ckpt")
            engine.save_checkpoint(ckpt, global_step=1)
            fresh = layout_engine(path, sharding, cp)
            fresh.load_checkpoint(ckpt)
            train(fresh, mine[1:], loss)
        train(engine, mine[1:], loss)
        if fresh is not None:
            a, b = params(engine), params(fresh)  # gathered: every rank
            resumed = all(torch.equal(a[k], b[k]) for k in a) and \
                engine.lr_scheduler.get_last_lr() == fresh.lr_scheduler.get_last_lr()
        exported, _ = engine.get_per_tensor_param()  # gathered under fsdp: every rank
        out.append(dict(layout=layout, params=params(engine),
                        exported={k: v.detach().cpu() for k, v in exported},
                        sent=engine.last["context_parallel_sent_bytes"], resumed=resumed))
    return {"layouts": out, "lora": _lora_on_rank(path, wholes, loss)}


LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def _lora_on_rank(path: str, wholes, loss) -> dict:
    """LoRA under fsdp (verl's fsdp_size=-1 on 2 ranks): the core's refusal, named with
    verl's keys; under zero1 with C = 2: the reference policy's log-probs (adapters off) and
    the adapters after 2 steps."""
    from tests.test_verl import log_probs

    try:
        layout_engine(path, None, 1, model=LORA)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    engine = layout_engine(path, "zero1", 2, model=LORA)
    mine = [rows_of(td, engine.core.layout) for td in wholes]
    with engine.disable_adapter():
        base, _ = log_probs(engine, mine[0])
    train(engine, mine, loss)
    return dict(refused=refused, base_log_probs=base,
                adapters={k: v for k, v in params(engine).items() if "lora_" in k})


def test_zero1_fsdp_and_ulysses_equal_verl_fsdp(model_dir, records, world1, fp64_verl, tmp_path):
    from experiments.local_ranks import run_ranks
    from tests.test_verl import assert_close_dicts, assert_close_rows, log_probs

    fsdp = make_engine("fsdp2", model_dir, "fp64")
    loss = grpo(MODE)
    base, _ = log_probs(fsdp, verl_batch(records, rows=STEPS[0]))
    train(fsdp, [verl_batch(records, rows=r) for r in STEPS], loss)
    want = params(fsdp)
    lora = make_engine("dta", model_dir, "fp64", model=LORA)  # one process: replicate
    train(lora, [verl_batch(records, rows=r) for r in STEPS], loss)
    adapters = {k: v for k, v in params(lora).items() if "lora_" in k}
    results = run_ranks(_on_rank, 2, model_dir, LAYOUTS, str(tmp_path), timeout=900.0)
    for rank, res in enumerate(r["lora"] for r in results):
        assert res["refused"] is not None and res["refused"].startswith(
            "engine_config.fsdp_size=-1 (fsdp), model_dtype=fp64, model_config.lora_rank=4: "
            "sharding=fsdp"), res["refused"]
        assert_close_rows(res["base_log_probs"], base, 1e-10,
                          f"rank {rank}: LoRA zero1 C=2, adapters off vs the base model")
        assert_close_dicts(res["adapters"], adapters, 1e-10,
                           f"rank {rank}: LoRA zero1 C=2 adapters vs one process")
    for i, (sharding, cp) in enumerate(LAYOUTS):
        for rank, res in enumerate(r["layouts"][i] for r in results):
            layout = res["layout"]
            assert (layout.sharding, layout.context_parallel, layout.rank) == \
                (sharding or "fsdp", cp, rank)
            assert (res["sent"] > 0) == (cp > 1), (sharding, cp, rank, res["sent"])
            what = f"dta_sharding={sharding} ulysses={cp} rank {rank}"
            worst = max((rel(res["params"][k], want[k]), k) for k in want)
            assert worst[0] <= 1e-10, f"{what}: {worst[1]} rel. error {worst[0]:.3e}"
            exported = res["exported"]
            assert set(exported) == set(fsdp.module.state_dict()), what
            assert all(torch.equal(exported[k].double(), res["params"][k]) for k in want), what
            if i == len(LAYOUTS) - 1:
                assert res["resumed"] is True, f"{what}: step 2 after loading not bit-identical"
            print(f"{what}: rel. error vs verl FSDP {worst[0]:.2e}, sent {res['sent']:.0f} B")


def test_node_resident_and_prefetch_keys_reach_the_layout():
    """``dta_node_resident`` (fsdp's hpZ gathers under HSDP: ``1 < fsdp_size < W``) and verl's
    own ``forward_prefetch`` (fsdp's next-layer all-gather) set the layout's
    ``node_resident`` / ``prefetch`` (default off); outside fsdp (or, node residency, without
    HSDP) the layout refuses them naming the verl key."""
    from runtime.verl import DTAEngineConfig
    from runtime.verl.config import layout_of

    plain = layout_of(DTAEngineConfig(fsdp_size=2), world=4, rank=1)
    assert (plain.node_resident, plain.prefetch) == (False, False)
    hpz = layout_of(DTAEngineConfig(fsdp_size=2, dta_node_resident=True), world=4, rank=1)
    assert (hpz.sharding, hpz.shard_size, hpz.node_resident) == ("fsdp", 2, True)
    both = layout_of(DTAEngineConfig(dta_sharding="fsdp", forward_prefetch=True), world=2,
                     rank=0)
    assert (both.sharding, both.prefetch) == ("fsdp", True)
    with pytest.raises(ValueError, match=r"^bad value for engine_config\.dta_node_resident: "
                                         r"True must be false under sharding=fsdp, shard size 4"):
        layout_of(DTAEngineConfig(dta_node_resident=True), world=4, rank=0)
    with pytest.raises(ValueError, match=r"^bad value for engine_config\.dta_node_resident: "
                                         r"True must be false under sharding=zero2"):
        layout_of(DTAEngineConfig(dta_sharding="zero2", fsdp_size=2, dta_node_resident=True),
                  world=4, rank=0)
    with pytest.raises(ValueError, match=r"^bad value for engine_config\.forward_prefetch: "
                                         r"True must be false under sharding=zero1"):
        layout_of(DTAEngineConfig(dta_sharding="zero1", forward_prefetch=True), world=2, rank=0)


def test_layout_settings_are_refused_naming_the_key(model_dir, world1):
    """One rank: C=2 does not divide the world; an unknown mode; ``fsdp_size`` as HSDP's
    shard size (one that does not divide the world, or beside replicate, refused naming it);
    ``optimizer_offload`` as offload, ``param_offload`` / ``offload_policy`` refused (LoRA
    under fsdp: on the ranks above)."""
    from runtime.verl import DTAEngineConfig
    from runtime.verl.config import layout_of, settings_of

    with pytest.raises(ValueError, match="engine_config.ulysses_sequence_parallel_size: 2"):
        layout_engine(model_dir, None, 2)
    with pytest.raises(ValueError, match="engine_config.dta_sharding: 'zero3'"):
        layout_of(DTAEngineConfig(dta_sharding="zero3"), world=2, rank=0)
    # fsdp_size: HSDP's shard size, as verl's (W / S, S) mesh; beside replicate -1 or W
    hsdp = layout_of(DTAEngineConfig(fsdp_size=2), world=4, rank=3)
    assert (hsdp.sharding, hsdp.shard_size, hsdp.replicas) == ("fsdp", 2, 2)
    hsdp = layout_of(DTAEngineConfig(dta_sharding="zero1", fsdp_size=2), world=4, rank=0)
    assert (hsdp.sharding, hsdp.shard_size) == ("zero1", 2)
    with pytest.raises(ValueError, match="bad value for engine_config.fsdp_size: 3"):
        layout_of(DTAEngineConfig(fsdp_size=3), world=4, rank=0)
    with pytest.raises(ValueError, match="bad value for engine_config.fsdp_size: 2"):
        layout_of(DTAEngineConfig(dta_sharding="replicate", fsdp_size=2), world=4, rank=0)
    assert layout_of(DTAEngineConfig(fsdp_size=1), world=4, rank=0).sharding == "replicate"
    with pytest.raises(ValueError, match="bad value for engine_config.fsdp_size: 1"):
        layout_of(DTAEngineConfig(dta_sharding="replicate", fsdp_size=1), world=4, rank=0)
    assert layout_of(DTAEngineConfig(dta_sharding="replicate"), world=4, rank=0).shard_size == 4
    # optimizer_offload: the optimizer state in host memory; the other offloads refused
    assert layout_of(DTAEngineConfig(optimizer_offload=True), world=2, rank=0).offload == \
        "optimizer"
    from runtime.verl.config import check_engine_config
    for key in ("param_offload", "offload_policy"):
        with pytest.raises(NotImplementedError, match=f"engine_config.{key}=True"):
            check_engine_config(DTAEngineConfig(**{key: True}))
    assert layout_of(DTAEngineConfig(), world=4, rank=3).sharding == "fsdp"
    assert layout_of(DTAEngineConfig(dta_sharding="fsdp"), world=1, rank=0).sharding == \
        "replicate"  # one rank holds everything

    class Model:
        path, enable_gradient_checkpointing = model_dir, True

    settings = settings_of(DTAEngineConfig(dta_sharding="zero1", ulysses_sequence_parallel_size=2),
                           Model(), world=4, rank=3)
    layout = settings.layout
    assert settings.walk.policy == "recompute"  # verl's gradient checkpointing
    assert (layout.sharding, layout.data_parallel, layout.dp_rank, layout.is_head) == \
        ("zero1", 2, 1, False)


# --------------------------------------------- the front door (test_engine_front_doors) --
def front_door(rank: int, world: int, mode: str, cp: int, cfg, ep: int = 1) -> dict:
    """verl's ``DTAEngine`` as a front door of tests/test_engine_front_doors.py, on what the
    Ray worker trains there (``cfg``, a validated run config): the same model saved as a
    local Hugging Face folder, the same batches as verl's trainer hands them to an engine
    (``records_to_verl``: the advantages and old log-probs of ``dta_cli``'s batch), the run
    config's loss as verl writes it (``ppo_loss``, vanilla clip, token-mean, no entropy or KL
    term; ``clip_ratio_c`` so large that the dual clip never binds, as the run config's
    ``loss.dual_clip: null``), verl's AdamW with the run config's settings and verl's constant
    LR schedule; ``dta_sharding=mode``, ``ulysses_sequence_parallel_size=cp``,
    ``expert_parallel_size=ep``, ``train.node_resident`` / ``train.prefetch`` as verl's
    ``dta_node_resident`` / ``forward_prefetch``; 2
    ``train_batch`` steps, the rows of each split over the data-parallel groups."""
    import functools

    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from dta_cli.batches import BatchSource
    from runtime.verl import use_cpu_platform
    from runtime.verl.records import records_to_verl

    warnings.simplefilter("ignore")
    use_fp64_verl()
    use_cpu_platform()
    lo, o, w = cfg.loss, cfg.optimizer, cfg.walker
    if (lo.name, lo.dual_clip, lo.decoupled, lo.entropy_coef, o.name) != \
            ("ppo", None, False, 0.0, "adamw") or tuple(o.betas) != (0.9, 0.999) or \
            float(o.eps) != 1e-8 or float(cfg.actor.temperature) != 1.0:
        raise ValueError("the verl front door translates the default ppo loss, AdamW (betas "
                         "0.9/0.999, eps 1e-8) and temperature 1 only")
    path = _door_model(cfg)
    shard = cfg.train.shard_size  # HSDP: verl's fsdp_size; offload: optimizer_offload
    engine = make_engine("dta", path, "fp64", fsdp_size=-1 if shard is None else int(shard),
                         dta_sharding=mode, optimizer_offload=cfg.train.offload != "none",
                         dta_gradient_offload=cfg.train.offload == "gradients",
                         dta_node_resident=cfg.train.node_resident is True,
                         forward_prefetch=cfg.train.prefetch is True,
                         ulysses_sequence_parallel_size=cp, expert_parallel_size=ep,
                         lr=float(o.lr),
                         clip_grad=float(o.max_grad_norm), weight_decay=float(o.weight_decay),
                         dta={"policy": str(w.policy), "block_tokens": int(w.block_tokens)})
    eps_high = lo.eps_clip_high if lo.eps_clip_high is not None else lo.eps_clip
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                         loss_agg_mode="token-mean", clip_ratio_low=float(lo.eps_clip),
                         clip_ratio_high=float(eps_high), clip_ratio_c=1e30, entropy_coeff=0.0)
    loss = functools.partial(ppo_loss, config)
    source, sent = BatchSource(cfg, VOCAB), 0
    for step in range(2):
        batch = source.batch(step)
        if not (batch.weight == 1.0).all():
            raise ValueError("the verl front door trains unweighted sequences only")
        recs = [{"input_ids": batch.input_ids[i], "loss_mask": batch.fields["loss_mask"][i],
                 "advantages": batch.fields["advantages"][i],
                 "logprobs": batch.fields["old_logprobs"][i]} for i in range(len(batch))]
        td = records_to_verl(recs, temperature=1.0, dtype=torch.float64,
                             calculate_entropy=False)
        train(engine, [rows_of(td, engine.core.layout)], loss)
        sent += int(engine.last["context_parallel_sent_bytes"])
    from dta.model.expert_parallel import expert_parallel_of

    experts = expert_parallel_of(engine.core.model)
    return {"state": engine.core.full_state(),  # gathered under fsdp: every rank
            "param_norm": engine.core.param_norm(), "layout": engine.core.layout,
            "sent": sent, "expert_sent": experts.sent_bytes if experts is not None else 0}


_DOOR_MODELS: dict[str, str] = {}


def _door_model(cfg) -> str:
    """The run config's model (built as the Ray worker builds it) in a local Hugging Face
    folder with a word-level tokenizer, once per process (removed at its exit). Written
    without ``save_pretrained``, which writes on rank 0 of a process group only."""
    import atexit
    import shutil
    import tempfile

    from safetensors.torch import save_model

    from dta.model.models import save_word_tokenizer
    from runtime.ray_runtime.worker import build_replica

    key = str(cfg.model)
    if key not in _DOOR_MODELS:
        path = tempfile.mkdtemp(prefix="dta-verl-door-")
        atexit.register(shutil.rmtree, path, True)
        model = build_replica(cfg)
        model.config.architectures = [type(model).__name__]  # as save_pretrained writes it
        model.config.save_pretrained(path)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(path)
        save_model(model, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        _DOOR_MODELS[key] = save_word_tokenizer(path, VOCAB)
    return _DOOR_MODELS[key]

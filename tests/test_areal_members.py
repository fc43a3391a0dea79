"""DTATrainEngine's rollout, weight-update, offload and single-controller members (CPU).

* ``xccl``: connect_engine builds the weight-update group as FSDPEngine does (trainer rank 0 +
  the inference workers, a tcp:// rendezvous the inference engine is told about), and
  update_weights pauses generation, announces each bucket's ``ParamSpec`` list, broadcasts
  the compute-dtype tensors, continues. No GPU here: everything up to the collective runs; the
  process-group constructor and the broadcast are recorded instead of run.
* ``xccl`` over a real collective: the same path with AReaL's CPU backend (gloo) and a
  subprocess standing in for the inference worker, which joins the weight-update group,
  receives every bucket by broadcast and reports what it got.
* no inference engine connected: rollout and weight members refuse clearly.
* offload/onload: state, the automatic onload before compute, an offload-aware save, and a
  train step after onload bit-identical to one that never offloaded.
* single-controller: ``as_controller`` gives AReaL's PPOActorController on
  ``runtime.areal.actor.DTAPPOActor`` (what its workers import), and the worker members
  ``clear_batches`` / ``fetch_buffer_stats``.
"""
from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from areal.api.alloc_mode import ModelAllocation  # noqa: E402
from areal.api.cli_args import OptimizerConfig, PPOActorConfig, TrainEngineConfig  # noqa: E402
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta  # noqa: E402

from runtime.areal import DTAPPOActor, DTATrainEngine  # noqa: E402
from runtime.areal import rollout as rollout_module  # noqa: E402
from runtime.areal.examples.tau2_grpo import make_smoke_model  # noqa: E402

FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_smoke_model(str(tmp_path_factory.mktemp("members") / "model"), vocab_size=128)


@pytest.fixture
def single(monkeypatch):
    import torch._dynamo
    import torch.distributed as dist

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    with torch._dynamo.config.patch(disable=True):
        yield
    if dist.is_initialized():  # connect_engine made a one-process group
        dist.destroy_process_group()


def new_engine(path, cls=DTATrainEngine, config_cls=TrainEngineConfig, **kw):
    config = config_cls(backend="fsdp:d1", experiment_name="members", trial_name="t0", path=path,
                        attn_impl="sdpa", optimizer=OptimizerConfig(lr=1e-3), **kw)
    engine = cls(config)
    engine.create_process_group()
    engine.initialize(None, FT_SPEC)
    return engine


def done(value=None) -> Future:
    fut = Future()
    fut.set_result(value)
    return fut


class RecordingInferenceEngine:
    """The calls FSDPEngine's xccl path makes on an inference engine, recorded."""

    def __init__(self):
        self.calls = []

    def init_weights_update_group(self, meta, rank_ids=None):
        self.calls.append(("init_group", meta.nccl_master_address, meta.nccl_master_port,
                           meta.nccl_group_name))
        return done()

    def update_weights_from_distributed(self, meta, param_specs):
        self.calls.append(("bucket", [(s.name, s.shape, s.dtype) for s in param_specs]))
        return done()

    def pause_generation(self):
        self.calls.append(("pause",))

    def continue_generation(self):
        self.calls.append(("continue",))


def batch(n=2, length=12, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.bool)
    return dict(input_ids=ids, attention_mask=mask, loss_mask=mask.clone())


def loss_fn(logprobs, entropy, mb, **kw):
    return -(logprobs * mb["loss_mask"]).sum() / mb["loss_mask"].count_nonzero()


def weight(mb):
    return mb["loss_mask"].count_nonzero()


def test_param_buckets_respect_the_chunk_size():
    named = [(f"p{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([4, 4, 10, 1])]
    sizes = [[n for n, _ in b] for b in rollout_module.param_buckets(named, chunk_bytes=16)]
    assert sizes == [["p0", "p1"], ["p2"], ["p3"]]  # 8+8 bytes; 20 alone; 2


def test_xccl_weight_update_up_to_the_collective(model_dir, single, monkeypatch):
    import areal.engine.core.distributed as areal_dist

    groups, sent = [], []

    def fake_group(**kw):
        groups.append(kw)
        return "weight-update-group"

    monkeypatch.setattr(areal_dist, "init_custom_process_group", fake_group)
    monkeypatch.setattr(rollout_module, "broadcast_bucket",
                        lambda tensors, group: sent.append((group, list(tensors))))
    engine = new_engine(model_dir)  # bf16 compute, fp32 masters
    inference = RecordingInferenceEngine()
    meta = WeightUpdateMeta.from_fsdp_xccl(gen_allocation=ModelAllocation.from_str("sglang:d2"))
    engine.connect_engine(inference, meta)
    (group,) = groups
    assert group["world_size"] == 3 and group["rank"] == 0  # 2 inference workers + trainer
    assert group["init_method"] == f"tcp://{meta.nccl_master_address}:{meta.nccl_master_port}"
    assert inference.calls == [("init_group", meta.nccl_master_address,
                                meta.nccl_master_port, "update_weight_group")]
    engine.update_weights(meta.with_version(1))
    kinds = [c[0] for c in inference.calls[1:]]
    assert kinds == ["pause", "bucket", "continue"]  # 1 GiB chunks: the tiny model is 1 bucket
    specs = inference.calls[2][1]
    named = list(engine.model.named_parameters())
    assert [s[0] for s in specs] == [n for n, _ in named]
    (group_used, tensors), = sent
    assert group_used == "weight-update-group"
    for (name, p), t, spec in zip(named, tensors, specs):
        assert t.dtype == torch.bfloat16 and spec[2] == "bfloat16" and spec[1] == tuple(p.shape)
        assert torch.equal(t, p.detach())
    # small chunks: one announcement per bucket, every bucket broadcast after its announcement
    sent.clear()
    engine.update_weights(WeightUpdateMeta.from_fsdp_xccl(
        gen_allocation=ModelAllocation.from_str("sglang:d2"), weight_chunked_mem_mb=0))
    assert len(sent) == len(named) and all(len(ts) == 1 for _, ts in sent)
    engine.destroy()


_WORKER = r"""
import importlib.util, json, os, sys, torch, torch.distributed as dist
# the reports travel on the original stdout only: gloo (torch 2.10) prints "[Gloo] Rank 1 is
# connected to ..." on fd 1, which is sent to stderr here
report = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
host, port, name, helper = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
spec = importlib.util.spec_from_file_location("areal_distributed", helper)
areal_distributed = importlib.util.module_from_spec(spec)  # AReaL's own group helper, without
spec.loader.exec_module(areal_distributed)                  # importing all of areal (slow)
group = areal_distributed.init_custom_process_group(backend="gloo", init_method=f"tcp://{host}:{port}",
                                  world_size=2, rank=1, group_name=name)
for line in sys.stdin:
    got = []
    for spec in json.loads(line):
        t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
        dist.broadcast(t, src=0, group=group)
        got.append([spec["name"], float(t.double().sum())])
    print(json.dumps(got), file=report, flush=True)
dist.destroy_process_group(group)
report.close()
os._exit(0)  # past the interpreter's finalization: gloo's threads can abort it (torch 2.13,
             # "terminate called without an active exception"; pytorch/pytorch#179291)
"""


class SubprocessInferenceWorker(RecordingInferenceEngine):
    """An inference worker in another process, on the weight-update group (gloo)."""

    def init_weights_update_group(self, meta, rank_ids=None):
        import subprocess
        import sys

        import areal.engine.core.distributed as helper

        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, meta.nccl_master_address,
             str(meta.nccl_master_port), meta.nccl_group_name, helper.__file__],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return super().init_weights_update_group(meta)

    def update_weights_from_distributed(self, meta, param_specs):
        import json
        import threading

        super().update_weights_from_distributed(meta, param_specs)
        self.proc.stdin.write(json.dumps([dict(name=s.name, shape=list(s.shape), dtype=s.dtype)
                                          for s in param_specs]) + "\n")
        self.proc.stdin.flush()
        fut = Future()  # done when the worker has received the bucket; a bad report fails it

        def read():
            line = self.proc.stdout.readline()
            try:
                fut.set_result(json.loads(line))
            except ValueError:
                fut.set_exception(RuntimeError(f"inference worker reported {line!r}"))

        threading.Thread(target=read, daemon=True).start()
        self.received = fut
        return fut


def test_xccl_weight_update_over_a_real_gloo_group(model_dir, single, monkeypatch):
    import torch.distributed as dist
    from areal.utils import network

    monkeypatch.setattr(network, "gethostip", lambda: "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    engine = new_engine(model_dir)
    worker = SubprocessInferenceWorker()
    meta = WeightUpdateMeta.from_fsdp_xccl(gen_allocation=ModelAllocation.from_str("sglang:d1"))
    try:
        engine.connect_engine(worker, meta)
        engine.update_weights(meta.with_version(1))
        got = dict(worker.received.result(timeout=60))
        for name, p in engine.model.named_parameters():
            assert got[name] == float(p.detach().double().sum()), name
        assert [c[0] for c in worker.calls] == ["init_group", "pause", "bucket", "continue"]
    finally:
        worker.proc.stdin.close()
        worker.proc.wait(timeout=60)
        if engine.weight_update_group is not None:
            dist.destroy_process_group(engine.weight_update_group)
        engine.destroy()
    assert worker.proc.returncode == 0


def test_rollout_members_need_a_connected_engine(model_dir, single):
    engine = new_engine(model_dir)
    meta = WeightUpdateMeta(type="disk", path="/nonexistent")
    for call in (lambda: engine.update_weights(meta), lambda: engine.rollout_batch([], "w"),
                 lambda: engine.prepare_batch(None, "w")):
        with pytest.raises(RuntimeError, match="connect_engine"):
            call()
    with pytest.raises(ValueError, match="'awex'"):
        engine.connect_engine(RecordingInferenceEngine(), WeightUpdateMeta(type="awex"))
    engine.destroy()


def test_offload_onload(model_dir, single, tmp_path):
    data = batch()
    plain = new_engine(model_dir)
    plain.train_batch(data, loss_fn, weight)
    engine = new_engine(model_dir)
    engine.offload()
    assert engine.is_offload
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.save(SaveLoadMeta(path=str(tmp_path / "hf"), weight_format="hf", with_optim=False))
    assert engine.is_offload  # the save onloaded and offloaded again
    stats = engine.train_batch(data, loss_fn, weight)  # onloads first
    assert not engine.is_offload and stats["update_successful"] == 1.0
    engine.offload()
    engine.onload()
    for (name, a), b in zip(engine.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(engine.core.sharding.masters, plain.core.sharding.masters):
        assert torch.equal(a, b)
    engine.destroy()
    plain.destroy()


def test_single_controller_members(model_dir, single):
    from areal.infra.rpc import rtensor
    from areal.trainer.ppo.actor import PPOActorController
    from areal.utils.dynamic_import import import_from_string

    config = PPOActorConfig(backend="fsdp:d1", experiment_name="members", trial_name="t0",
                            path=model_dir, attn_impl="sdpa")
    controller = DTAPPOActor.as_controller(config, scheduler=object())
    assert isinstance(controller, PPOActorController)
    engine_cls = controller.train_engine
    assert import_from_string(f"{engine_cls.__module__}.{engine_cls.__name__}") is DTAPPOActor
    engine = new_engine(model_dir, cls=DTAPPOActor, config_cls=PPOActorConfig)
    rtensor._fetch_buffer["shard-a"] = torch.zeros(1)
    assert engine.fetch_buffer_stats()["num_entries"] >= 1
    engine.clear_batches(["shard-a"])
    assert "shard-a" not in rtensor._fetch_buffer
    engine.destroy()


def test_dcp_checkpoint_is_verified_before_it_is_read(model_dir, single, tmp_path):
    """A DCP checkpoint carries a manifest (trust's checkpoint rules): a flipped byte is
    refused, naming the file, before anything is loaded."""
    from runtime.checkpoints.checkpoint import CheckpointError

    engine = new_engine(model_dir)
    path = tmp_path / "dcp"
    meta = SaveLoadMeta(path=str(path), weight_format="dcp", with_optim=True)
    engine.save(meta)
    (ckpt,) = path.glob("step-*")  # runtime/checkpoints/sharded.py's layout: one folder per step, + latest
    assert (ckpt / "manifest.json").is_file() and (path / "latest").is_file()
    engine.load(meta)  # intact: loads
    (shard,) = ckpt.glob("*.distcp")
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    before = [p.detach().clone() for p in engine.model.parameters()]
    with pytest.raises(CheckpointError, match=shard.name):
        engine.load(meta)
    assert all(torch.equal(a, p) for a, p in zip(before, engine.model.parameters()))
    engine.destroy()

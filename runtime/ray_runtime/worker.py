"""One rank of ``dta train`` on Ray: the adapter between the run config and the engine core.

The class is plain Python (the driver wraps it with ``ray.remote``), so it can be used and
tested without Ray. It translates: the run config into the core's inputs (the model spec,
the optimizer, the loss), the driver's resolved :class:`~runtime.engine.RunSettings` (layout
and walk, handed over unchanged) into its rank's layout, the Ray rendezvous into a
``torch.distributed`` group, and the core's :class:`~runtime.engine.StepOutcome` into the
step's stats. Everything a step does -- the walk with the run's one ``WalkOptions``, the
gradient reduction, the clip, the update or the skip -- is the engine core's
(:mod:`runtime.engine`).

Nothing is applied before the gradient collective has completed: a peer that dies before it
makes the collective fail on every survivor, which then returns without touching its
parameters or optimizer state.
"""
from __future__ import annotations

import datetime
import os
import socket
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from dta.batch import Batch
from dta.config.loss import loss_kwargs
from dta.losses import Totals, batch_totals, make_loss
from dta.options import WalkOptions
from runtime.engine import EngineCore, LoraSpec, ModelSpec, RunSettings, build_model
from runtime.ray_runtime.host import interface_of, node_id, node_ip, peak_memory, reset_peak_memory
from runtime.sharding.common import optimizer_factory

FAULT_ENV = "DTA_FAULT_INJECT"  # "rank=1,step=2": that rank exits before the all-reduce


# ------------------------------------------------------------ config -> the core --
def model_spec(cfg) -> ModelSpec:
    """The run config's ``model.*`` as the engine core's model spec."""
    m = cfg.model
    lora = None
    if int(m.lora.r) > 0:  # the base frozen, LoRA adapters the only trainable weights
        lora = LoraSpec(r=int(m.lora.r), alpha=float(m.lora.alpha),
                        targets=list(m.lora.target_modules), dropout=float(m.lora.dropout),
                        rslora=bool(m.lora.rslora))
    return ModelSpec(path=m.path or None, family=str(m.family), size=str(m.size),
                     seed=int(m.seed), attn_implementation=str(m.attn_implementation),
                     lora=lora)


def build_replica(cfg, device: str | torch.device = "cpu", dtype=None):
    """The configured model on ``device``, in ``dtype`` (default: ``model.dtype``)."""
    return build_model(model_spec(cfg), dtype or cfg.model.dtype).to(device)


def make_optimizer(model, ocfg):
    return optimizer_factory(ocfg)(p for p in model.parameters() if p.requires_grad)


def make_training_loss(cfg):
    return make_loss(cfg.loss.name, **loss_kwargs(cfg))


def recompute_fields(cfg, loss) -> tuple[str, ...]:
    """Fields the worker fills from the current policy before the step (AReaL's
    ``recompute_logprob`` / the decoupled loss's proximal log-probs)."""
    out = []
    if getattr(loss, "decoupled", False):
        out.append("prox_logprobs")
    elif cfg.actor.recompute_logprob and "old_logprobs" in loss.fields:
        out.append("old_logprobs")
    return tuple(out)


def to_recompute(batch: Batch | None, names) -> tuple[str, ...]:
    """Which of ``names`` the step fills with the current policy's log-probs: those the batch
    lacks, and ``old_logprobs`` always (``actor.recompute_logprob``). The core walks them on
    the training walk's own tree (``EngineCore.train_step(recompute=...)``)."""
    if batch is None:
        return ()
    return tuple(n for n in names if n not in batch.fields or n == "old_logprobs")


def parse_fault(spec: str | dict | None) -> dict | None:
    """``"rank=1,step=2"`` -> {"rank": 1, "step": 2}."""
    if not spec:
        return None
    if isinstance(spec, dict):
        return {"rank": int(spec["rank"]), "step": int(spec["step"])}
    out = {}
    for part in str(spec).split(","):
        key, _, value = part.partition("=")
        if key.strip() not in ("rank", "step") or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"bad {FAULT_ENV} {spec!r}: expected rank=R,step=S")
        out[key.strip()] = int(value)
    if set(out) != {"rank", "step"}:
        raise ValueError(f"bad {FAULT_ENV} {spec!r}: expected rank=R,step=S")
    return out


# ---------------------------------------------------------------------- worker --
class DFSWorker:
    """One rank: the engine core and what Ray asks of it. ``cfg_dict``: the driver's
    validated config (not validated again); ``settings``: what the driver resolved, used as
    given."""

    def __init__(self, rank: int, world_size: int, cfg_dict: dict, settings: RunSettings, *,
                 use_gpu: bool = False, fault: dict | None = None):
        self.rank, self.world_size = int(rank), int(world_size)
        self.cfg = OmegaConf.create(cfg_dict)
        if settings.layout.world != self.world_size:
            raise ValueError(f"worker {rank}: the settings are for {settings.layout.world} "
                             f"ranks, the group has {world_size}")
        threads = int(self.cfg.ray.torch_threads) or max(1, round(self.cfg.ray.cpus_per_worker))
        torch.set_num_threads(threads)
        self.device = torch.device("cuda", 0) if use_gpu and torch.cuda.is_available() \
            else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        t0 = time.perf_counter()
        self.core = EngineCore(lambda dtype: build_replica(self.cfg, dtype=dtype),
                               layout=settings.layout.at(self.rank), walk=settings.walk,
                               make_optimizer=optimizer_factory(self.cfg.optimizer),
                               compute_dtype=self.cfg.model.dtype, device=self.device)
        if self.world_size == 1:
            self.core.parallelize()
        self.loss = make_training_loss(self.cfg)
        self.recompute = recompute_fields(self.cfg, self.loss)
        self.fault = parse_fault(fault)
        self.group = False
        self._store = None  # rank 0's TCP store server (multi-node rendezvous)
        self.build_s = time.perf_counter() - t0
        self.completed_steps = 0

    @property
    def model(self):
        return self.core.model

    @property
    def walk(self) -> WalkOptions:
        return self.core.walk

    @property
    def optimizer(self):
        return self.core.optimizer

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "ip": node_ip(), "node_id": node_id(), "device": str(self.device),
                "build_s": self.build_s,
                "threads": torch.get_num_threads(),
                "params": int(sum(p.numel() for p in self.model.parameters()))}

    # -------------------------------------------------------------- the group --
    def open_store(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: serve the group's TCP store on a free port of the address Ray reports
        for this node (a socket bound to that address, handed to the store: no wildcard
        bind, no port race); returns (address, port) for the other ranks."""
        from torch.distributed import TCPStore

        ip = node_ip()
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((ip, 0))
        sock.listen(max(128, self.world_size))
        port = sock.getsockname()[1]
        self._store = TCPStore(ip, port, self.world_size, True,
                               datetime.timedelta(seconds=float(timeout_s)),
                               wait_for_workers=False, master_listen_fd=sock.detach())
        return ip, port

    def setup_group(self, init_method: str, backend: str, timeout_s: float,
                    ifname: str | None = None) -> dict:
        """Join the process group: ``file://PATH`` (same node) or ``tcp://IP:PORT`` (rank 0's
        :meth:`open_store`), then parallelize the core. Without ``ifname``, gloo/NCCL use
        the interface that holds this node's Ray address, unless the environment names one."""
        if self.world_size == 1:
            return self.info()
        import torch.distributed as dist

        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
            os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
        elif (own := interface_of(node_ip())) is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", own)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", own)
        timeout = datetime.timedelta(seconds=float(timeout_s))
        if init_method.startswith("tcp://"):
            from torch.distributed import TCPStore

            host, _, port = init_method[len("tcp://"):].rpartition(":")
            store = self._store if self.rank == 0 else TCPStore(
                host.strip("[]"), int(port), self.world_size, False, timeout)
            if store is None:
                raise RuntimeError("rank 0 has no TCP store: call open_store first")
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=self.rank,
                                    world_size=self.world_size, timeout=timeout)
        self.group = True
        self.core.parallelize()
        return self.info()

    def parallelize(self) -> None:
        """The process group exists already (local test ranks): parallelize the core."""
        self.group = True
        self.core.parallelize()

    # --------------------------------------------------------------- step --
    def step(self, step: int, batch: Batch | None, totals: Totals, board=None) -> dict:
        """One step; ``board`` (a :class:`.progress.ProgressBoard` actor) receives the tokens
        walked as the walk goes."""
        t0 = time.perf_counter()
        reset_peak_memory(self.device)
        if batch is not None and totals is None:
            totals = batch_totals(batch)  # the worker sees the whole batch
        reporter = None
        if board is not None and batch is not None and len(batch):
            from runtime.ray_runtime.progress import Reporter

            reporter = Reporter(board, int(step), self.rank)
        fault = self.fault and self.fault["rank"] == self.rank and \
            self.fault["step"] == int(step)
        out = self.core.train_step(
            None if batch is None else _writable(batch), self.loss, totals=totals,
            reduction=str(self.cfg.walker.reduction),
            max_grad_norm=self.cfg.optimizer.max_grad_norm, progress=reporter,
            recompute=to_recompute(batch, self.recompute),
            before_reduce=(lambda: os._exit(1)) if fault else None)  # fault injection
        if reporter is not None:
            reporter.flush()
        self.completed_steps += 1
        return self._stats(step, out, time.perf_counter() - t0)

    def _stats(self, step: int, out, wall: float) -> dict:
        stats = {"rank": self.rank, "pid": os.getpid(), "step": int(step),
                 "sequences": out.sequences, "tokens": 0, "unique_tokens": 0,
                 "forwarded_tokens": 0, "loss": out.loss, "grad_norm": float(out.grad_norm),
                 "updated": bool(out.updated), "accumulate_s": out.accumulate_s,
                 "update_s": out.update_s, "step_s": wall,
                 "context_parallel_rank": self.core.layout.cp_rank,
                 "context_parallel_sent_bytes": out.sent_bytes,
                 "expert_parallel_sent_bytes": out.expert_sent_bytes,
                 **peak_memory(self.device)}
        if out.tree is not None:
            stats.update(tokens=out.tree.total_tokens, unique_tokens=out.tree.unique_tokens)
        if out.walk is not None:
            stats.update(forwarded_tokens=out.walk.tokens,
                         recomputed_tokens=out.walk.recomputed_tokens,
                         max_live_graphs=out.walk.max_live_graphs,
                         max_call_tokens=out.walk.max_call_tokens)
        if not out.skipped:
            stats.update(sharding=self.core.layout.sharding,
                         state_bytes=self.core.state_bytes())
        return stats

    # ----------------------------------------------------- state / checkpoints --
    def param_norm(self) -> float:
        """L2 norm of all parameters (the masters, where sharded); a collective when the
        mode shards: call it on every rank."""
        return self.core.param_norm()

    @property
    def sharded(self) -> bool:
        """Whether this worker's state is sharded (checkpoints: DCP, written by every rank)."""
        return self.core.layout.sharded

    def save_checkpoint(self, directory: str, step: int, meta: dict, run_id: str | None = None,
                        keep_last: int | None = None) -> str:
        """Replicated: rank 0 writes the whole state (in one process). Sharded: every rank
        calls this and writes its shards (rank 0 then applies keep_last). One format."""
        return self.core.save(directory, step, meta, run_id=run_id, keep_last=keep_last)

    def export_hf(self, path: str) -> str:
        """The model as a Hugging Face directory (``save_pretrained``: config + safetensors;
        LoRA: the adapter, or merged weights with ``train.export_merged``). Sharded: every
        rank calls this and rank 0 writes."""
        return self.core.export_hf(path, merged=bool(self.cfg.train.export_merged))

    def load_checkpoint(self, path: str) -> dict:
        """A checkpoint of any layout (or a legacy one) cut into this rank's pieces; one that
        is not this run's state is refused before a parameter is touched. Every rank calls
        this."""
        meta = self.core.load(path)
        self.completed_steps = int(meta["step"])
        return meta

    def shutdown(self) -> None:
        if self.group:
            import torch.distributed as dist
            try:
                dist.destroy_process_group()
            except Exception:
                pass
            self.group = False
        self._store = None


def _writable(batch: Batch) -> Batch:
    """Ray hands numpy arrays over read-only (zero copy); torch wants writable ones."""
    return Batch([np.array(s) for s in batch.input_ids],
                 {k: [np.array(a) for a in v] for k, v in batch.fields.items()},
                 None if batch.weight is None else np.array(batch.weight), batch.group_id,
                 routed_experts=None if batch.routed_experts is None else
                 [np.array(r) for r in batch.routed_experts])

"""One data-parallel DFS worker: a model replica, its optimizer, and one rank of a
torch.distributed process group.

The class is plain Python (the driver wraps it with ``ray.remote``), so it can be used and
tested without Ray. A step:

1. ``zero_grad``; ``dta.train.accumulate_gradients`` over the worker's sequences with the
   *whole batch's* :class:`~dta.losses.Totals`, so each worker's gradient is its share of
   the global token mean and their sum is the single-worker gradient;
2. the sharding mode (``train.sharding``, :mod:`runtime.sharding`) reduces the gradients
   across the group — ``replicate``: all-reduce (SUM), every replica steps alike;
   ``zero1``: one reduce-scatter, each rank steps its slice of fp32 masters and optimizer
   state, one all-gather of the new weights; ``fsdp``: FSDP2 reduce-scatters per call;
3. clip by the global norm and step.

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

from dta.batch import Batch
from dta.config.schema import from_dict, loss_kwargs
from dta.losses import Totals, batch_totals, make_loss
from dta.model.models import build_model, load_model
from dta.model.models import resolve_dtype
from dta.config.walk import walk_options
from dta.options import WalkOptions
from dta.model.context_parallel import context_parallel_of, parallelize_context
from dta.train import accumulate_gradients, forward_logprobs
from runtime.ray_runtime.host import interface_of, node_id, node_ip, peak_memory, reset_peak_memory
from runtime.sharding import make_strategy, master_dtype_for
from runtime.sharding.common import optimizer_factory

FAULT_ENV = "DTA_FAULT_INJECT"  # "rank=1,step=2": that rank exits before the all-reduce


# -------------------------------------------------------------- replica building --
def build_replica(cfg, device: str | torch.device = "cpu", dtype=None):
    """The configured model on ``device``, in ``dtype`` (default: ``model.dtype``)."""
    m = cfg.model
    dtype = dtype or m.dtype
    if m.path:
        model = load_model(m.path, dtype=dtype, attn_implementation=m.attn_implementation)
    else:
        model = build_model(m.family, m.size, dtype=dtype, seed=int(m.seed),
                            attn_implementation=m.attn_implementation)
    if int(m.lora.r) > 0:  # the base frozen, LoRA adapters the only trainable weights
        from dta.model.lora import apply_lora

        torch.manual_seed(int(m.seed))  # every rank's adapters start alike
        model = apply_lora(model, r=int(m.lora.r), alpha=float(m.lora.alpha),
                           target_modules=list(m.lora.target_modules),
                           dropout=float(m.lora.dropout), rslora=bool(m.lora.rslora))
    return model.to(device)


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


def fill_recomputed(model, batch: Batch, names, walk: WalkOptions) -> Batch:
    """Set ``names`` of ``batch`` to the model's current log-probs (no graph), walked with
    the run's walk settings."""
    missing = [n for n in names if n not in batch.fields or n == "old_logprobs"]
    if not missing:
        return batch
    with torch.no_grad():
        res = forward_logprobs(model, batch, options=walk)
    lps = [np.asarray(lp.detach().double().cpu()) for lp in res.logprobs]
    fields = dict(batch.fields)
    for n in missing:
        fields[n] = lps
    return Batch(batch.input_ids, fields, batch.weight, batch.group_id,
                 routed_experts=batch.routed_experts)


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
    """A model replica + optimizer + one rank. Methods are called by the driver."""

    def __init__(self, rank: int, world_size: int, cfg_dict: dict, *, use_gpu: bool = False,
                 fault: dict | None = None, walk: WalkOptions | None = None):
        self.rank, self.world_size = int(rank), int(world_size)
        self.cfg = from_dict(cfg_dict)
        # the run's walk settings: the driver's (auto resolved there), else the config's
        self.walk = walk if walk is not None else walk_options(self.cfg)
        threads = int(self.cfg.ray.torch_threads) or max(1, round(self.cfg.ray.cpus_per_worker))
        torch.set_num_threads(threads)
        self.device = torch.device("cuda", 0) if use_gpu and torch.cuda.is_available() \
            else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        t0 = time.perf_counter()
        self.mode = str(self.cfg.train.sharding)
        if self.mode not in ("replicate", "zero1", "fsdp"):
            raise ValueError(f"train.sharding={self.mode!r} must be resolved before the "
                             "workers start (the driver resolves auto)")
        self.compute_dtype = resolve_dtype(self.cfg.model.dtype)
        built = self.compute_dtype if self.mode == "replicate" else \
            master_dtype_for(self.compute_dtype)
        self.model = build_replica(self.cfg, self.device, dtype=built)
        self.strategy = None  # built once the process group exists (setup_group)
        if self.world_size == 1:
            self._build_strategy()
        self.loss = make_training_loss(self.cfg)
        self.recompute = recompute_fields(self.cfg, self.loss)
        self.fault = parse_fault(fault)
        self.group = False
        self._store = None  # rank 0's TCP store server (multi-node rendezvous)
        self.build_s = time.perf_counter() - t0
        self.completed_steps = 0

    # -------------------------------------------------------------- setup --
    def _build_strategy(self) -> None:
        mode = self.mode if self.world_size > 1 else "replicate"  # one rank: nothing to shard
        self.strategy = make_strategy(mode, self.model, optimizer_factory(self.cfg.optimizer),
                                      compute_dtype=self.compute_dtype,
                                      policy=self.walk.policy,
                                      context_parallel=int(self.cfg.train.context_parallel))
        self.model = self.strategy.model
        needs = getattr(self.strategy, "walk_options", {})  # what the mode asks of the walk
        if needs:
            self.walk = self.walk.replace(**needs)

    @property
    def optimizer(self):
        return self.strategy.optimizer

    def info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "ip": node_ip(), "node_id": node_id(), "device": str(self.device),
                "build_s": self.build_s,
                "threads": torch.get_num_threads(),
                "params": int(sum(p.numel() for p in self.model.parameters()))}

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
        :meth:`open_store`). Without ``ifname``, gloo/NCCL use the interface that holds this
        node's Ray address, unless the worker's environment names one."""
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
        self._context_parallel()
        self._build_strategy()
        return self.info()

    def _context_parallel(self) -> None:
        """train.context_parallel = C > 1: ranks [g·C, (g+1)·C) walk the same trees with their
        K/V spread over them (docs/context-parallel.md); every rank creates every group (a
        collective), in the same order, and keeps its own."""
        import torch.distributed as dist

        C = int(self.cfg.train.context_parallel)
        self.cp_rank = self.rank % C
        if C == 1:
            return
        groups = [dist.new_group(list(range(g * C, (g + 1) * C)))
                  for g in range(self.world_size // C)]
        parallelize_context(self.model, groups[self.rank // C])

    # --------------------------------------------------------------- step --
    def step(self, step: int, batch: Batch | None, totals: Totals, board=None) -> dict:
        """One step; ``board`` (a :class:`.progress.ProgressBoard` actor) receives the tokens
        walked as the walk goes."""
        t0 = time.perf_counter()
        reset_peak_memory(self.device)
        stats = {"rank": self.rank, "pid": os.getpid(), "step": int(step), "sequences": 0,
                 "tokens": 0, "unique_tokens": 0, "forwarded_tokens": 0, "loss": 0.0}
        if batch is not None and totals is None:
            totals = batch_totals(batch)  # the worker sees the whole batch
        if totals is not None and totals.trainable_tokens == 0:
            # No trained token in the whole batch (every rank sees the same totals, so every
            # rank skips, no collective is entered): no gradient, no optimizer step.
            stats.update(grad_norm=0.0, updated=False, accumulate_s=0.0, allreduce_s=0.0,
                         optimizer_s=0.0, step_s=time.perf_counter() - t0,
                         **peak_memory(self.device))
            self.completed_steps += 1
            return stats
        self.strategy.zero_grad()
        if batch is not None and len(batch):
            batch = _writable(batch)
            batch = fill_recomputed(self.model, batch, self.recompute, self.walk)
            reporter = None
            if board is not None:
                from runtime.ray_runtime.progress import Reporter

                reporter = Reporter(board, int(step), self.rank)
            cp = context_parallel_of(self.model)
            sent = cp.sent_bytes if cp is not None else 0
            res = accumulate_gradients(self.model, batch, self.loss,
                                       reduction=str(self.cfg.walker.reduction), totals=totals,
                                       options=self.walk, progress=reporter)
            stats["context_parallel_sent_bytes"] = cp.sent_bytes - sent if cp is not None else 0
            if reporter is not None:
                reporter.flush()
            stats.update(sequences=len(batch), tokens=res.tree.total_tokens,
                         unique_tokens=res.tree.unique_tokens, forwarded_tokens=res.walk.tokens,
                         recomputed_tokens=res.walk.recomputed_tokens, loss=float(res.loss),
                         max_live_graphs=res.walk.max_live_graphs,
                         max_call_tokens=res.walk.max_call_tokens)
            if getattr(self, "cp_rank", 0):  # context parallel: the group's first rank alone
                # gives the (identical) gradient and the figures summed over ranks; the others
                # give nothing (fsdp's layers were reduced in the backward, divided by C)
                held = getattr(self.strategy, "local_grad_params", None)
                for p in (self.model.parameters() if held is None else held):
                    p.grad = None
                stats.update(loss=0.0, tokens=0, unique_tokens=0)
        stats["context_parallel_rank"] = getattr(self, "cp_rank", 0)
        t1 = time.perf_counter()
        if self.fault and self.fault["rank"] == self.rank and self.fault["step"] == int(step):
            os._exit(1)  # fault injection: die after accumulating, before the all-reduce
        norm, updated = self.strategy.reduce_and_step(self.cfg.optimizer.max_grad_norm)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t3 = time.perf_counter()
        self.completed_steps += 1
        stats.update(grad_norm=float(norm), updated=bool(updated), accumulate_s=t1 - t0,
                     update_s=t3 - t1, step_s=t3 - t0,  # update: collectives + optimizer
                     sharding=self.strategy.mode, state_bytes=self.strategy.state_bytes(),
                     **peak_memory(self.device))
        return stats

    # ----------------------------------------------------- state / checkpoints --
    def state(self) -> dict:
        """CPU copies of the model (gathered, compute dtype) and of this rank's optimizer
        state (for tests and consistency checks)."""
        return {"model": self.strategy.full_state(),
                "optimizer": _to_cpu(self.optimizer.state_dict())}

    def param_norm(self) -> float:
        """L2 norm of all parameters (the masters, where sharded); a collective when the
        mode shards: call it on every rank."""
        return self.strategy.param_norm()

    def gradients(self) -> dict:
        """CPU copies of the last step's (all-reduced, possibly clipped) gradients."""
        return {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()
                if p.grad is not None}

    def digest(self) -> float:
        with torch.no_grad():
            return float(sum(v.double().abs().sum()
                             for v in self.strategy.full_state().values()))

    @property
    def sharded(self) -> bool:
        """Whether this worker's state is sharded (checkpoints: DCP, written by every rank)."""
        return self.strategy.mode != "replicate"

    def save_checkpoint(self, directory: str, step: int, meta: dict, run_id: str | None = None,
                        keep_last: int | None = None) -> str:
        """Replicated: rank 0 writes the whole state. Sharded: every rank calls this and
        writes its shards (:func:`runtime.dcp.save_sharded`; rank 0 then applies keep_last)."""
        if self.sharded:
            from runtime.dcp import save_sharded
            from runtime.checkpoints.checkpoint import prune
            path = save_sharded(directory, step, self.strategy.sharded_state(),
                                meta={**meta, "sharding": self.strategy.mode, "run_id": run_id})
            if keep_last and self.rank == 0:
                prune(directory, keep_last, keep=path, run_id=run_id)
            return path
        from runtime.checkpoints.checkpoint import save_checkpoint
        return save_checkpoint(directory, step, self.model, self.optimizer, meta, run_id=run_id,
                               keep_last=keep_last)

    def export_hf(self, path: str) -> str:
        """The model as a Hugging Face directory (``save_pretrained``: config + safetensors).
        Sharded: every rank calls this (gathering the full state is a collective) and rank 0
        writes it, in the compute dtype (what a replicated run holds and exports)."""
        from dta.model.lora import is_peft_model, save_adapter

        if is_peft_model(self.model):  # LoRA: the adapter in PEFT format, or merged weights
            # zero1 keeps the gathered compute copy in the model itself: nothing to gather
            if self.rank == 0:
                os.makedirs(path, mode=0o755, exist_ok=True)
                save_adapter(self.model, path, merged=bool(self.cfg.train.export_merged))
            return path
        if not self.sharded:
            os.makedirs(path, mode=0o755, exist_ok=True)
            self.model.save_pretrained(path)
            return path
        state = self.strategy.full_state()
        if self.rank == 0:
            state = {k: v.to(self.compute_dtype) if v.is_floating_point() else v
                     for k, v in state.items()}
            os.makedirs(path, mode=0o755, exist_ok=True)
            self.model.save_pretrained(path, state_dict=state)
        return path

    def load_checkpoint(self, path: str) -> dict:
        """A sharded checkpoint in this run's mode at any world size (DCP re-cuts it), or
        re-sharded into this one replica; a replicated checkpoint cut into this rank's shards
        (``runtime.sharding.reshard``); anything else is refused before a parameter is
        touched. Sharded: every rank calls this."""
        from runtime.sharding.reshard import (check_resumable, load_into_replica,
                                              load_replicated_into_sharded)

        saved = check_resumable(path, self.world_size, self.strategy.mode)
        if saved["format"] == "dcp" and not self.sharded:
            meta = load_into_replica(path, self.model, self.optimizer)
        elif saved["format"] == "replicated" and self.sharded:
            meta = load_replicated_into_sharded(path, self.strategy)
        elif self.sharded:  # the same mode; DCP re-cuts for another world size
            from runtime.dcp import load_sharded
            meta = load_sharded(path, self.strategy.sharded_state(), allow_reshard=True)
        else:
            from runtime.checkpoints.checkpoint import load_checkpoint
            meta = load_checkpoint(path, self.model, self.optimizer)
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


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):  # a DTensor (FSDP2): this rank's shard
            obj = obj.to_local()
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj

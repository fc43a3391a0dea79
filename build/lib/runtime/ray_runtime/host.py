"""What a worker reports of its host: the Ray node it runs on, the IP (and network interface)
its peers reach it at, and the peak memory of a step (CUDA's allocator peak, or the
process's peak RSS)."""
from __future__ import annotations

import torch


def reset_peak_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory(device) -> dict:
    if device.type == "cuda":
        return {"peak_bytes": int(torch.cuda.max_memory_allocated(device)), "kind": "cuda"}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"peak_bytes": int(line.split()[1]) * 1024, "kind": "rss"}
    except OSError:
        pass
    import resource
    return {"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "kind": "rss"}


def node_id() -> str | None:
    """The Ray node id of this process's node (None outside Ray)."""
    try:
        import ray
        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return None


def interface_of(ip: str) -> str | None:
    """The network interface holding ``ip`` (None when no interface has it)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addrs):
            return name
    return None


def node_ip() -> str:
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"

"""A CPU platform for verl 0.9.1, which ships CUDA, NPU and ROCm platforms only.

verl asks its platform for the device name (``get_device_name()``), the device module
(``get_torch_device()``), the collective backend and the current device index; on a machine
without an accelerator its detection falls back to ``nvidia`` and the first CUDA call fails.
:func:`use_cpu_platform` registers ``cpu`` (device ``cpu``, backend ``gloo``, module
``torch.cpu``) and makes it verl's platform, so verl's engines, its ``EngineRegistry`` lookup
(``device="cpu"``) and its helpers run on CPU; ``VERL_PLATFORM=cpu`` selects it in a verl
process that imported :mod:`runtime.verl`. Profiling hooks are no-ops; memory figures are 0.
"""
from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any, Optional

import torch
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

__all__ = ["PlatformCPU", "use_cpu_platform"]


class _CPUDevice:
    """``torch.cpu`` plus the few ``torch.cuda`` calls verl makes unconditionally."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def memory_allocated(*_a, **_k) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(*_a, **_k) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def mem_get_info(*_a, **_k) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


CPU_DEVICE = _CPUDevice()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on CPU: one device (``"cpu"``), gloo collectives."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return not torch.cuda.is_available()

    def current_device(self) -> str:
        return "cpu"  # as torch.cpu.current_device(): tensor.to(0) would mean an accelerator

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def use_cpu_platform() -> PlatformBase:
    """Make :class:`PlatformCPU` verl's platform (and ``VERL_PLATFORM=cpu`` for the verl
    processes this one starts); refused where CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError("use_cpu_platform: CUDA is available; verl's own platform detection "
                           "picks it (the cpu platform is for machines without an accelerator)")
    os.environ["VERL_PLATFORM"] = "cpu"
    current = platform_manager._current_platform
    if isinstance(current, PlatformCPU):
        return current
    platform = PlatformCPU()
    platform_manager._current_platform = platform
    return platform

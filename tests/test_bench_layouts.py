"""experiments/bench_layouts.py's overlap measure on made-up profiler events (the stage itself
runs in tests/test_bench_gpu_script.py): the all-gather time covered by compute, device
kernels preferred to CPU events, communication and copies not counted as compute."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from experiments.bench_layouts import _covered, _union, overlap_of


def ev(name, a, b, device=DeviceType.CUDA, parent=None):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=a, end=b),
                           device_type=device, cpu_parent=parent)


def test_union_and_cover():
    assert _union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [[0, 3], [5, 8]]
    assert _covered([[0, 10], [20, 30]], [[5, 25]]) == 10
    assert _covered([[0, 10]], [[0, 1], [2, 3], [9, 12]]) == 3
    assert _covered([[0, 10]], []) == 0


def test_overlap_of_device_kernels():
    events = [ev("ncclDevKernel_AllGather_RING_LL", 0, 100),
              ev("ncclDevKernel_AllGather_RING_LL", 200, 300),
              ev("sm90_xmma_gemm_bf16", 50, 150),  # covers 50 of the first gather
              ev("Memcpy DtoD", 200, 300),  # a copy: not compute
              ev("ncclDevKernel_ReduceScatter", 250, 300),  # communication: not compute
              ev("c10d::_allgather_base_", 0, 400, DeviceType.CPU)]  # device kernels win
    got = overlap_of(events, "cuda")
    assert got["gathers_from"] == "device kernels" and got["all_gathers"] == 2
    assert got["all_gather_us"] == 200 and got["overlapped_us"] == 50
    assert got["overlap_fraction"] == pytest.approx(0.25)


def test_overlap_of_cpu_events():
    parent = object()
    events = [ev("gloo:all_gather", 0, 100, DeviceType.CPU),
              ev("FSDP::all_gather_copy_out", 100, 150, DeviceType.CPU),  # not the transfer
              ev("aten::mm", 100, 200, DeviceType.CPU),
              ev("aten::copy_", 10, 20, DeviceType.CPU, parent=parent)]  # inside the gather
    got = overlap_of(events, "cpu")
    assert got["gathers_from"] == "cpu events" and got["overlapped_us"] == 0
    assert got["all_gathers"] == 1 and got["all_gather_us"] == 100
    assert overlap_of([], "cpu")["overlap_fraction"] == 0.0

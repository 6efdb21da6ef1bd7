"""What we are running on: device kind, count, memory, bf16 support, compute capability, and its measured peak."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# Dense bf16 peak per GPU (TFLOP/s) from vendor data sheets, used when not measured. Matched
# against the CUDA device name in this order, so the PCIe and NVL parts are found before the
# SXM ones they share a prefix with ("NVIDIA H100 PCIe" vs "NVIDIA H100 80GB HBM3").
KNOWN_GPU_PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
    "L4": 121.0,
}
# CUDA compute capability by GPU model, for a node described by hand (`lmforge plan --gpus N --gpu-name`);
# float8 matmuls (`pretrain.float8`) need 8.9 (Ada) or newer. Matched in this order, like the peaks above.
KNOWN_GPU_CAPABILITY = {
    "B200": (10, 0),
    "H200": (9, 0),
    "H100": (9, 0),
    "L40S": (8, 9),
    "L4": (8, 9),
    "A100": (8, 0),
    "A10": (8, 6),
}


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cuda" or "cpu"
    name: str
    count: int  # GPUs on this node; 1 for the CPU host
    memory_bytes: int  # per GPU, or the host's RAM for CPU
    bf16: bool
    cores: int
    host_memory_bytes: int | None = None  # the node's RAM; None when planning for a machine described by hand
    capability: tuple[int, int] | None = None  # CUDA compute capability (NVIDIA only); None on CPU, ROCm or unknown


def known_capability(name: str) -> tuple[int, int] | None:
    """The compute capability of a GPU model named by hand (None for one not in the table)."""
    return next((cap for model, cap in KNOWN_GPU_CAPABILITY.items() if model in name), None)


def no_gpu_here() -> bool:
    """True when this Linux host certainly has no GPU that CUDA or ROCm could use: no device node of either.

    Answering that without importing torch (1-2 s) matters: step keys resolve `precision: auto`
    on every run, including a cached rerun that has nothing else to do.
    """
    if not sys.platform.startswith("linux") or not Path("/dev").is_dir():
        return False
    return not any(Path("/dev").glob("nvidia*")) and not Path("/dev/kfd").exists() and not Path("/dev/dxg").exists()


def detect_device() -> DeviceInfo:
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if no_gpu_here():
        ram = psutil.virtual_memory().total
        return DeviceInfo("cpu", _cpu_name(), 1, ram, _cpu_bf16(), cores, ram)
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceInfo(
            "cuda",
            props.name,
            torch.cuda.device_count(),
            props.total_memory,
            torch.cuda.is_bf16_supported(),
            cores,
            psutil.virtual_memory().total,
            # ROCm reports its gfx version here (MI300: 9.4), which is no CUDA capability
            (props.major, props.minor) if torch.version.hip is None else None,
        )
    ram = psutil.virtual_memory().total
    return DeviceInfo("cpu", _cpu_name(), 1, ram, _cpu_bf16(), cores, ram)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def _cpu_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def measure_peak_tflops(dtype_name: str = "fp32", size: int = 2048, repeats: int = 5) -> float:
    """Best-of-N dense matmul throughput on this device (what MFU is measured against)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def peak_tflops(device: DeviceInfo, dtype_name: str, cache_dir: Path | None = None) -> float:
    """Per-device peak: data-sheet value for known GPUs, else measured once and cached."""
    if device.kind == "cuda":
        for name, value in KNOWN_GPU_PEAK_TFLOPS.items():
            if name in device.name:
                return value if dtype_name != "fp32" else value / 2
    cache = (cache_dir or Path.home() / ".cache" / "lmforge") / "peak_tflops.json"
    key = f"{device.kind}:{device.name}:{device.cores}:{dtype_name}"
    try:
        known = json.loads(cache.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        known = {}
    if key not in known:
        known[key] = measure_peak_tflops(dtype_name)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    return float(known[key])

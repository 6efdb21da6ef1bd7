"""What a training rank sets up before DeepSpeed or TRL starts, whatever trains."""

from __future__ import annotations


def disable_shm_comm_op() -> None:
    """On CPU, DeepSpeed would JIT-build its shared-memory all-reduce (inference only, 40-90 s)."""
    import torch

    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def safe_attention_kernels() -> bool:
    """On CUDA with `LMFORGE_CUDNN_SDPA=0`, train without cuDNN's fused attention (SDPA's cuDNN
    backend; flash and memory-efficient attention take its place). Returns whether it was switched off.

    By default cuDNN's kernel stays on, as torch chooses it. The NaN gradients a first H200 run
    blamed on it came from the benchmark's data, not the kernel (measured on an H200, torch 2.11,
    cuDNN 9.19, the 1.2B gpu-1node model, `benchmarks/gpu_check.py --sections attention`): cuDNN
    and flash give the same finite gradients on every window, and the same NaN on the one window
    that starts with the pad id, whose embedding row is zero at initialisation. Training with
    cuDNN's kernel was 3-5% faster than with flash (docs/how-to/gpus.md). The switch stays for a
    torch build whose cuDNN backward is broken (pytorch/pytorch#196678, trl#7181 report one).
    """
    import os

    import torch

    if not torch.cuda.is_available() or os.environ.get("LMFORGE_CUDNN_SDPA", "1") != "0":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True

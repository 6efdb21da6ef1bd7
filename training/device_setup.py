"""What a training rank sets up before DeepSpeed or TRL starts, whatever trains."""

from __future__ import annotations


def disable_shm_comm_op() -> None:
    """On CPU, DeepSpeed would JIT-build its shared-memory all-reduce (inference only, 40-90 s)."""
    import torch

    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def safe_attention_kernels() -> bool:
    """On CUDA, train without cuDNN's fused attention (SDPA's cuDNN backend); flash and
    memory-efficient attention take its place. Returns whether it was switched off.

    Seen here: the gpu-1node model (1.2B Llama, bf16, sequences of 2047 tokens) on one H200 with
    torch 2.11 and cuDNN's SDPA (the default on Hopper) had non-finite gradients from the first
    step on every path: DeepSpeed skipped every step ("OVERFLOW! Skipping step"), FSDP2 and a
    plain PyTorch loop went NaN, while the same model's gradients on a CPU were finite. cuDNN's bf16
    SDPA backward returning NaN on H100/H200 is a known regression since torch 2.11
    (pytorch/pytorch#196678; trl#7181 for DPO, fixed there by this same switch). That this switch
    cures the run above is not yet confirmed on a GPU (see docs/how-to/gpus.md).
    `LMFORGE_CUDNN_SDPA=1` keeps cuDNN's kernel.
    """
    import os

    import torch

    if not torch.cuda.is_available() or os.environ.get("LMFORGE_CUDNN_SDPA") == "1":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True

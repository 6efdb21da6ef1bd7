"""What a training rank sets up before DeepSpeed or TRL starts, whatever trains."""

from __future__ import annotations


def disable_shm_comm_op() -> None:
    """On CPU, DeepSpeed would JIT-build its shared-memory all-reduce (inference only, 40-90 s)."""
    import torch

    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

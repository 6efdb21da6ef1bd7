"""What a training rank sets up before DeepSpeed or TRL starts, whatever trains."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator


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


@contextlib.contextmanager
def imports_without(*names: str) -> Iterator[None]:
    """Within the block `import NAME` fails at once and `importlib.util.find_spec(NAME)` is None, as
    if the package were not installed; afterwards both work again (Python's own marker: None in
    `sys.modules`)."""
    absent = [name for name in names if name not in sys.modules]
    for name in absent:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in absent:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def preload_libraries() -> None:
    """Import DeepSpeed (where installed) and transformers' model code without what they import only
    because it is installed: DeepSpeed's autotuner imports mlflow (1.3 s of CPU), transformers'
    assisted generation scikit-learn (1 s), its torchao checkpoint loader torchao (1.3 s; a rank
    that trains in float8 imports torchao itself, `training/float8.py`) and its object-detection
    losses SciPy (1.2 s: 15.4
    against 16.6 CPU-s of a pretraining rank's imports on an AVX2 host). A rank uses none of them
    and paid all at every start, on 2 cores the largest part of a short launch. They stay importable
    afterwards (a plug-in's method may use them): DeepSpeed and transformers have only recorded them
    as absent. (Leaving DeepSpeed out of an alignment rank on plain DDP saved nothing measurable:
    11.9 against 12.1 CPU-s; what it imports, the rank imports anyway.)"""
    with imports_without("mlflow", "sklearn", "scipy", "torchao"):
        if importlib.util.find_spec("deepspeed") is not None:
            import deepspeed  # noqa: F401

        import transformers.generation.candidate_generator  # noqa: F401  (the one that asks for sklearn)
        import transformers.modeling_utils  # noqa: F401
        import transformers.quantizers.auto  # noqa: F401  (its torchao loader imports torchao: 1.3 s)

"""`w8a8-fp8`: FP8 (E4M3) weights with one scale per output channel, FP8 activations quantized per
token at run time. Needs no calibration: the weight scales are each channel's absolute maximum
(what llmcompressor's FP8_DYNAMIC recipe computes too), so it is written in the main environment
with compressed-tensors alone.

Where it is served: vLLM runs FP8 W8A8 on GPUs of compute capability 8.9 and above (Ada, Hopper,
Blackwell: FP8 tensor cores); 8.0-8.6 (Ampere) serve the checkpoint weight-only (Marlin FP8,
activations in 16 bits); vLLM on CPU has no FP8 W8A8 kernel. Where it cannot be served, the
checkpoint is still written and gated in transformers (compressed-tensors decompresses it)."""

from __future__ import annotations

from serving.quantize.schemes import Scheme, cuda_capability


def serving(host: str) -> str | None:
    if host.startswith("cpu"):
        return (
            "vLLM on CPU has no FP8 W8A8 kernel: it needs a CUDA GPU of compute capability 8.9+ "
            "(8.0-8.6 serve it weight-only)"
        )
    capability = cuda_capability(host)
    if capability is not None and capability < (8, 0):
        return f"vLLM needs compute capability 8.0+ for FP8 checkpoints (8.9+ for FP8 activations); this GPU is {host}"
    return None


SCHEME = Scheme(
    "w8a8-fp8",
    "FP8_DYNAMIC",
    8,
    grouped=False,
    weight_type="float",
    activation_bits=8,
    activation_type="float",
    method="minmax",
    serving=serving,
    order=40,
)

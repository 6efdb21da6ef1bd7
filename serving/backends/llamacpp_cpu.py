"""llama.cpp's CPU backend without its weight repacking (AMX and other "extra buffer types").

On an Intel CPU with AMX (this project's development and CI host: a Xeon in a Firecracker VM),
llama.cpp built natively moves Q8_0 weights into its AMX buffers and its AMX matmul
(`ggml_backend_amx_mul_mat`) crashes at `ldtilecfg` (SIGSEGV, exit 139; a SIGILL in the OpenMP
threads) even once the process holds the AMX tile state; bf16 files, which it does not repack, run.
`llama_model_params.use_extra_bufts = false` keeps every weight in ggml's plain CPU buffers, whose
AVX-512/AVX2 kernels run on every x86 host, so lmforge's GGUF measurement and llama.cpp serving set
it. llama-cpp-python builds its model parameters from `llama_model_default_params()` and offers no
argument for this field, hence the wrapper installed here before a model is loaded.
"""

from __future__ import annotations

from typing import Any


def without_weight_repacking() -> None:
    """Make every model loaded from now on in this process keep its weights in plain CPU buffers."""
    import llama_cpp
    import llama_cpp.llama

    default = llama_cpp.llama_model_default_params
    if getattr(default, "lmforge_no_repacking", False):
        return

    def params() -> Any:
        value = default()
        value.use_extra_bufts = False
        return value

    params.lmforge_no_repacking = True  # type: ignore[attr-defined]
    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params

"""Loading a transformers model inside a long-lived process that runs other steps in threads.

transformers 5's `from_pretrained` is not thread-safe: while it builds a model it replaces
class-wide and module-wide functions (`PreTrainedModel.tie_weights` under `no_tie_weights()`,
`torch.nn.init.*` under `guard_torch_init_functions()`, and `init_weights` under
`no_init_weights()`) and puts back what it found on the way out. Two loads in two threads of one
process interleave: the second saves the first's stand-in as "the original" and restores it last,
so **`PreTrainedModel.tie_weights` stays a no-op for the rest of the process**. Every later load
of a model with tied embeddings then leaves `lm_head.weight` untied and never initialized
(`torch.empty`: whatever the allocator hands back), and its logits read 1e+22 .. 1e+38. That is
issue 57: under Prefect, steps of a stage run in threads of one flow process (the quantization
report and the GGUF check load models in-process), and the adapter release's parity check, run
later in the same process, compared a merged model with a base whose head was garbage.

Hence, for every model lmforge loads in a process that may run other steps:

- one process-wide lock around building it (`load_causal_lm`, `loading()` for anything else, such
  as peft wrapping a model);
- a check before building that the process is not already poisoned (`check_pristine`: a stand-in
  left in place is refused in one line, since nothing loaded afterwards can be trusted);
- a check after building that a model whose config ties its embeddings really shares them
  (`check_tied`).

Checks whose answer must not depend on the process's history (the adapter release's parity) run in
a fresh process besides (`serving/parity_entry.py`).

Written by hand because transformers offers no lock or check of its own for this (its loading
contexts are documented for single-threaded use).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmforge.errors import DeterministicError

_LOCK = threading.RLock()
# names of the stand-ins transformers' loading contexts put in place (initialization.py)
_STAND_IN = "empty_func"
_INIT_FUNCTIONS = ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")


class ModelLoadError(DeterministicError):
    """A model would be built from transformers' loading stand-ins, or came out with its tied head untied."""


def _stand_ins() -> list[str]:
    import torch.nn.init as torch_init
    from transformers import PreTrainedModel

    found = [
        f"PreTrainedModel.{name}"
        for name in ("tie_weights", "init_weights")
        if getattr(getattr(PreTrainedModel, name), "__name__", "") == _STAND_IN
    ]
    found += [
        f"torch.nn.init.{name}"
        for name in _INIT_FUNCTIONS
        if getattr(getattr(torch_init, name, None), "__name__", "") == _STAND_IN
    ]
    return found


def check_pristine() -> None:
    """Refuse to build a model while transformers' loading stand-ins are in place (a load outside the
    lock is running in another thread, or one interleaved with another and left them behind)."""
    found = _stand_ins()
    if found:
        raise ModelLoadError(
            f"transformers' loading stand-ins are in place in this process ({', '.join(found)}): a model loaded "
            "concurrently outside lmforge's lock; a model built now would have an uninitialized, untied head"
        )


def check_tied(model: Any, where: str = "") -> Any:
    """`model` as it is, after checking that a config asking for tied embeddings got them."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return model
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embeddings is None:
        return model
    if head.weight.data_ptr() != embeddings.weight.data_ptr():
        raise ModelLoadError(
            f"{where or type(model).__name__}: tie_word_embeddings is set but the loaded output head does not share "
            "the input embeddings (its weights were never loaded): transformers' tie_weights was not run"
        )
    return model


@contextmanager
def loading() -> Iterator[None]:
    """Hold the process-wide model-building lock (re-entrant), checking the process first."""
    with _LOCK:
        check_pristine()
        yield


def load_causal_lm(path: str | Path, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)`, serialized with every other model built
    in this process and checked (tied head really tied)."""
    from transformers import AutoModelForCausalLM

    with loading():
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return check_tied(model, str(path))

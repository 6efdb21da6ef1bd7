"""Issue 57: the adapter release's parity check failed at random (1.84e+37, 2.58e+33 in the logits).

The cause was not vLLM's LoRA ops (the parity check never runs vLLM) but transformers 5's
`from_pretrained`, which swaps class-wide functions while it builds a model
(`PreTrainedModel.tie_weights` under `no_tie_weights()`, `torch.nn.init.*`) and is not thread-safe.
Under Prefect the steps of a stage run in threads of one flow process; two loads there interleave,
and the process is left with `tie_weights` a no-op: every later load of a tied model gets an
untied, never-initialized `lm_head` (`torch.empty`), so its logits are whatever memory held. The
release's parity check, run later in that process, then compared garbage with the merged model.

These tests make that state deterministic (holding `no_tie_weights()` open in another thread, as a
concurrent load does) instead of waiting for a race; `lmforge.inference.hf_load` has the fix.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def lineage(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A tiny tied Llama (the root), a LoRA adapter on it with non-zero B, and the merged model."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("hf-loading")
    root, adapter, merged = tmp / "root", tmp / "adapter", tmp / "merged"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,  # lmforge's own Llama ties them (pretrain.model.tie_embeddings)
    )
    LlamaForCausalLM(config).save_pretrained(root)
    base = LlamaForCausalLM.from_pretrained(root, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False)
    peft_model = get_peft_model(base, lora)
    peft_model.save_pretrained(adapter)
    peft_model.merge_and_unload().save_pretrained(merged)
    return root, adapter, merged


@contextmanager
def interleaved_loads_left_behind() -> Iterator[None]:
    """The state two interleaved loads leave: thread A enters `no_tie_weights()`, thread B enters it
    (saving A's stand-in as "the original"), A leaves (restoring the real one), B leaves (restoring
    A's stand-in). Forced in that order here; a Prefect stage does it by chance. Undone afterwards."""
    from transformers import PreTrainedModel
    from transformers.initialization import no_tie_weights

    real = PreTrainedModel.__dict__["tie_weights"]
    order = [threading.Event() for _ in range(3)]

    def a() -> None:
        with no_tie_weights():
            order[0].set()
            order[1].wait(10)
        order[2].set()

    def b() -> None:
        order[0].wait(10)
        with no_tie_weights():
            order[1].set()
            order[2].wait(10)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert PreTrainedModel.tie_weights.__name__ == "empty_func"  # the process is poisoned
    try:
        yield
    finally:
        PreTrainedModel.tie_weights = real


def test_after_two_interleaved_loads_every_tied_model_has_a_garbage_head(lineage) -> None:
    """The mechanism, shown with transformers alone: once two loads have interleaved, a tied model
    built in that process comes back with an untied head that was never initialized."""
    from transformers import AutoModelForCausalLM

    root, _, _ = lineage
    good = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
    assert good.lm_head.weight.data_ptr() == good.model.embed_tokens.weight.data_ptr()
    with interleaved_loads_left_behind():
        bad = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
    assert bad.lm_head.weight.data_ptr() != bad.model.embed_tokens.weight.data_ptr()
    # never loaded: left on the meta device, or `torch.empty` memory once moved (the release's 1e+23 logits)
    assert bad.lm_head.weight.is_meta or not torch.equal(bad.lm_head.weight, good.lm_head.weight)


def test_lmforges_loader_refuses_to_build_a_model_in_a_poisoned_process(lineage) -> None:
    """Instead of a model with a garbage head, one line saying why; and a model whose config ties its
    embeddings but whose head came out separate is refused too."""
    from transformers import AutoModelForCausalLM

    from lmforge.inference.hf_load import ModelLoadError, check_tied, load_causal_lm

    root, _, _ = lineage
    with interleaved_loads_left_behind(), pytest.raises(ModelLoadError, match="PreTrainedModel.tie_weights"):
        load_causal_lm(root, dtype=torch.float32)
    with interleaved_loads_left_behind():
        untied = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
    with pytest.raises(ModelLoadError, match="does not share the input embeddings"):
        check_tied(untied, "root")
    model = load_causal_lm(root, dtype=torch.float32)  # the stand-in is gone again: loads and is tied
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_the_releases_parity_check_is_right_whatever_the_process_loaded_before(lineage, tmp_path: Path) -> None:
    """On 3e99bca the release called `adapters.parity` in the flow process: in the state above it
    returned a difference of 1e+22 .. 1e+38 (NaN with uninitialized memory filled), every time. The
    release now checks in a fresh process (`serving.parity_entry`), so the answer is the files'."""
    from serving import adapters

    root, adapter, merged = lineage
    stacked = tmp_path / "stacked"
    adapters._copy_adapter(adapter, stacked / "sft")
    chain = adapters.Adapter("sft", merged, (adapter,), root)
    with interleaved_loads_left_behind():
        gaps = adapters.parities([chain], stacked, tmp_path)
    assert set(gaps) == {"sft"} and gaps["sft"] < 1e-4, gaps
    assert json.loads((tmp_path / "logs" / "parity.json").read_text())["sft"] == gaps["sft"]


def test_two_threads_loading_through_the_lock_leave_the_process_sound(lineage) -> None:
    """Two steps' threads loading at once, as a Prefect stage does: through `load_causal_lm` every
    model is tied and the process keeps transformers' own functions (plain `from_pretrained` in this
    loop left `tie_weights` a no-op in 19 of 20 tries while writing the fix)."""
    from lmforge.inference import hf_load

    root, adapter, merged = lineage
    errors: list[BaseException] = []

    def loads(path: Path) -> None:
        try:
            for _ in range(6):
                model = hf_load.load_causal_lm(path, dtype=torch.float32)
                assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=loads, args=(p,)) for p in (root, merged)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert hf_load._stand_ins() == []


def test_a_non_finite_difference_is_never_a_pass(lineage, tmp_path: Path) -> None:
    """`gap > tolerance` is False for NaN, so a NaN difference passed every parity check; now none does."""
    from safetensors.torch import load_file, save_file

    from serving import adapters

    root, adapter, merged = lineage
    broken = tmp_path / "merged"
    broken.mkdir()
    for item in merged.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    name = next(k for k in weights if k.endswith("norm.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    stacked = tmp_path / "stacked"
    adapters._copy_adapter(adapter, stacked / "sft")
    gaps = adapters.parities([adapters.Adapter("sft", broken, (adapter,), root)], stacked, tmp_path)
    assert math.isnan(gaps["sft"]) and not gaps["sft"] <= 1e-3

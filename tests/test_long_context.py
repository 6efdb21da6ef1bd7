"""Context extension (lmforge/rope.py): the shared lineage's model, trained at 64 tokens, continued
at 256 with YaRN by a short pretraining on 2 ranks. The scaling reaches the export (both config
shapes), vLLM's served length and the GGUF metadata, and the run learns the longer positions."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from serving.backends.llamacpp import DEFAULT_VENV

EXTEND = [
    "pretrain.seq_len=256",
    "pretrain.global_batch_size=4",
    "pretrain.distributed.micro_batch_size=2",
    "pretrain.max_steps=30",
    "pretrain.optim.warmup_steps=3",
    "pretrain.optim.lr=3e-3",
    "pretrain.checkpoint.every_steps=30",
    "pretrain.eval_every=30",
    "pretrain.eval_batches=2",
]


@pytest.fixture(scope="module")
def extended(curated: tuple[Path, dict], trained: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from lmforge.engine.executor import run_pipeline_locally
    from tests.conftest import small_config

    workspace = tmp_path_factory.mktemp("extended") / "ws"
    shutil.copytree(curated[0], workspace, symlinks=True)
    base = Path(trained["dir"]) / "hf"
    result = run_pipeline_locally(small_config(workspace, f"base_model.path={base}", *EXTEND), ["pretrain"])
    return result["pretrain/train"]


def test_yarn_extends_the_trained_context_fourfold_and_the_export_and_vllm_carry_it(extended: dict) -> None:
    rope = extended["extra"]["rope"]
    assert rope == {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    metrics = extended["metrics"]
    assert 0.0 <= metrics["long_document_fraction"] <= 1.0
    assert extended["extra"]["document_mask"] is True  # auto: an extension attends within each document
    # the base, read at 256 positions with the stretched rotary table, before any step; then after 30
    assert metrics["final_val_loss"] < metrics["base_val_loss"], metrics
    out = Path(extended["dir"]) / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 256
    assert {k: config["rope_parameters"][k] for k in rope} == rope  # transformers 5's shape
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_theta"] == 10_000.0  # and the legacy one
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.model.rotary_emb.rope_type == "yarn" and model.model.rotary_emb.attention_scaling > 1.0

    # vLLM's own reading of the directory: the length it would serve, and the rotary settings
    from vllm.config import ModelConfig

    served = ModelConfig(model=str(out), tokenizer=str(out), dtype="float32")
    assert served.max_model_len == 256
    assert served.hf_config.rope_parameters["rope_type"] == "yarn"
    assert served.hf_config.rope_parameters["original_max_position_embeddings"] == 64


@pytest.mark.skipif(
    not (DEFAULT_VENV / "bin" / "python").exists() and not os.environ.get("CI"),
    reason="no llama.cpp environment (LMFORGE_LLAMACPP_ENV=1 bash scripts/setup.sh); CI always runs this",
)
def test_the_gguf_file_keeps_the_scaling(extended: dict, tmp_path: Path) -> None:
    from serving.backends.llamacpp import llamacpp_python
    from serving.quantize import gguf
    from tests.test_gguf import gguf_fields

    out = Path(extended["dir"]) / "hf"
    python = llamacpp_python(None, "quantize.gguf.python")
    gguf.convert(out, tmp_path / "model.gguf", python, tmp_path)
    names = ("llama.context_length", "llama.rope.freq_base")
    names += tuple(f"llama.rope.scaling.{k}" for k in ("type", "factor", "original_context_length"))
    fields = gguf_fields(tmp_path / "model.gguf", python, names)
    assert fields["llama.context_length"] == 256
    assert fields["llama.rope.scaling.type"] == "yarn"
    assert fields["llama.rope.scaling.factor"] == 4.0
    assert fields["llama.rope.scaling.original_context_length"] == 64
    assert fields["llama.rope.freq_base"] == 10_000.0


LENGTH_EVAL = [
    "evaluate.tasks=[lmforge_passkey, lmforge_ppl_by_length]",
    "evaluate.models=[base, pretrained]",
    "evaluate.backends=[hf]",
    "evaluate.backend_models={}",
    "evaluate.builtin.context_lengths=[64, 256]",
    "evaluate.builtin.passkey_depths=[0.0, 0.5, 1.0]",
    "evaluate.builtin.passkey_per_cell=2",
    "evaluate.limit={}",
]


def test_the_card_measures_both_models_by_context_length(extended: dict) -> None:
    from lmforge.engine.executor import run_pipeline_locally
    from tests.conftest import small_config

    workspace = Path(extended["dir"]).parents[2]
    trained_base = json.loads((Path(extended["dir"]) / "run_spec.json").read_text())["base_dir"]
    result = run_pipeline_locally(
        small_config(workspace, f"base_model.path={trained_base}", *EXTEND, *LENGTH_EVAL), ["evaluate"]
    )
    report = Path(result["evaluate/report"]["dir"])
    card = (report / "comparison.md").read_text()
    assert "## By context length (tokens)" in card
    rows = {(r["model"], r["task"]): r for r in json.loads((report / "report.json").read_text())["results"]}
    assert {m for m, _ in rows} == {"base", "pretrained"}
    for row in rows.values():
        assert [length for length, _ in row["by_length"]] == [64, 256]

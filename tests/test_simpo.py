"""SimPO (`training/align/methods/simpo.py`): one module and its registration, on 2 CPU ranks from the
session's SFT model, measured, evaluated, quantized and served like every aligned model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmforge.executor import run_pipeline_locally
from tests.conftest import small_config

SMALL_SIMPO = [
    "align.recipe=[sft, simpo]",
    "align.simpo.max_steps=12",
    "align.simpo.lr=1e-3",  # as the tiny preset's DPO: the paper's 5e-7 (8B models) does not move a tiny one
    "align.simpo.global_batch_size=16",
    "align.simpo.micro_batch_size=8",
    "align.simpo.save_steps=6",
    "align.simpo.eval_every=6",
    "align.eval_generations=16",  # held-out answers generated before and after (runtime: no key changes)
]


@pytest.fixture(scope="module")
def simpo(aligned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    workspace = tmp_path_factory.mktemp("simpo")
    shutil.copytree(Path(aligned["align/sft"]["dir"]).parents[2], workspace, dirs_exist_ok=True)
    return run_pipeline_locally(small_config(workspace, *SMALL_SIMPO), ["align"])


@pytest.mark.slow
def test_simpo_trains_on_two_ranks_from_the_cached_sft_model_and_is_measured_like_dpo(
    simpo: dict, aligned: dict
) -> None:
    step = simpo["align/simpo"]
    assert simpo["align/sft"]["key"] == aligned["align/sft"]["key"]  # SFT reused, not retrained
    assert "align/dpo" not in simpo  # the recipe names SimPO alone after SFT
    assert step["extra"]["world_size"] == 2 and step["counts"]["steps"] == 12
    m = step["metrics"]
    for name in ("before", "after"):
        assert 0 <= m[f"preference_accuracy_{name}"] <= 1
        low, high = m[f"preference_accuracy_{name}_ci"]
        assert low <= m[f"preference_accuracy_{name}"] <= high
    low, high = m["preference_accuracy_delta_ci"]  # the paired change on the same held-out pairs
    assert low <= m["preference_accuracy_delta"] <= high
    assert m["heldout_items"] == step["counts"]["heldout_items"] > 0
    hf = Path(step["dir"]) / "hf"
    assert (hf / "model.safetensors").exists() and not (hf / "training_args.bin").exists()
    from transformers import AutoTokenizer

    eos = json.loads((hf / "generation_config.json").read_text())["eos_token_id"]
    assert AutoTokenizer.from_pretrained(str(hf)).convert_tokens_to_ids("<|im_end|>") in eos  # stops at a turn's end
    logged = set().union(*(json.loads(line) for line in (Path(step["dir"]) / "metrics.jsonl").read_text().splitlines()))
    # TRL's ORPO and CPO trainers log no `num_tokens`, so there is no tokens/s row (KTO's and DPO's have one)
    assert "loss" in logged and any(k.startswith("rewards/") for k in logged), sorted(logged)


def test_simpo_is_a_model_role_that_evaluation_quantization_and_serving_take() -> None:
    """No edit outside its module: the registry gives SimPO's model a role, an evaluation run per backend,
    a place in quantization's and serving's auto order and a LoRA adapter when served as one."""
    from evaluation.steps import RUN_STEPS
    from lmforge.registry import role_names
    from serving.steps import adapter_roles, auto_order

    assert "simpo" in role_names() and "simpo" in adapter_roles()
    assert {"evaluate/simpo-hf", "evaluate/simpo-vllm"} <= {s.name for s in RUN_STEPS}
    assert auto_order()[0] == "quantized" and "simpo" in auto_order()

"""What the tests of KTO, ORPO and SimPO share: a short run of one method on the session's lineage,
and the checks every preference method must pass (trained on 2 ranks, exported, measured like DPO,
a lineage role that evaluation, quantization and serving take)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmforge.engine.executor import run_pipeline_locally
from tests.conftest import small_config

STEPS = 12


def small(name: str, *extra: str) -> list[str]:
    """The recipe [sft, <name>] at test size; lr 1e-3 as the tiny preset's DPO (the papers' values, for
    7-8B models, do not move the tests' 64-wide one)."""
    return [
        f"align.recipe=[sft, {name}]",
        f"align.{name}.max_steps={STEPS}",
        f"align.{name}.lr=1e-3",
        f"align.{name}.global_batch_size=16",
        f"align.{name}.micro_batch_size=8",
        f"align.{name}.save_steps=6",
        f"align.{name}.eval_every=6",
        "align.eval_generations=16",  # held-out answers generated before and after (runtime: no key changes)
        *extra,
    ]


def run_from_aligned(
    aligned: dict,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    overrides: list[str],
    workspace: Path | None = None,
) -> dict:
    """The align stage of a copy of the session's aligned workspace (into `workspace`), with `overrides`."""
    workspace = workspace or tmp_path_factory.mktemp(name)
    shutil.copytree(Path(aligned["align/sft"]["dir"]).parents[2], workspace, dirs_exist_ok=True)
    return run_pipeline_locally(small_config(workspace, *overrides), ["align"])


def check_trained_and_measured(run: dict, aligned: dict, name: str) -> set[str]:
    """The method's step trained on 2 ranks from the cached SFT step, exported a model that stops at a
    turn's end, and measured held-out preference accuracy before and after with its intervals; returns
    the metric names its metrics.jsonl logged."""
    from transformers import AutoTokenizer

    step = run[f"align/{name}"]
    assert run["align/sft"]["key"] == aligned["align/sft"]["key"]  # SFT reused, not retrained
    assert "align/dpo" not in run  # the recipe names the method alone after SFT
    assert step["extra"]["world_size"] == 2 and step["counts"]["steps"] == STEPS
    m = step["metrics"]
    for when in ("before", "after"):
        assert 0 <= m[f"preference_accuracy_{when}"] <= 1
        low, high = m[f"preference_accuracy_{when}_ci"]
        assert low <= m[f"preference_accuracy_{when}"] <= high
    low, high = m["preference_accuracy_delta_ci"]  # the paired change on the same held-out pairs
    assert low <= m["preference_accuracy_delta"] <= high
    assert m["heldout_items"] == step["counts"]["heldout_items"] > 0
    hf = Path(step["dir"]) / "hf"
    assert (hf / "model.safetensors").exists() and not (hf / "training_args.bin").exists()
    eos = json.loads((hf / "generation_config.json").read_text())["eos_token_id"]
    assert AutoTokenizer.from_pretrained(str(hf)).convert_tokens_to_ids("<|im_end|>") in eos  # stops at a turn's end
    rows = (Path(step["dir"]) / "metrics.jsonl").read_text().splitlines()
    return set().union(*(json.loads(line) for line in rows))


def check_lineage_role(name: str) -> None:
    """No edit outside its module: the registry gives the method's model a role, an evaluation run per
    backend, a place in quantization's and serving's auto order and a LoRA adapter when served as one."""
    from evaluation.steps import RUN_STEPS
    from lmforge.engine.registry import role_names
    from serving.steps import adapter_roles, auto_order

    assert name in role_names() and name in adapter_roles()
    assert {f"evaluate/{name}-hf", f"evaluate/{name}-vllm"} <= {s.name for s in RUN_STEPS}
    assert auto_order()[0] == "quantized" and name in auto_order()  # serve.model auto takes it when present


def check_resumes_after_a_killed_rank(
    reference: dict, aligned: dict, tmp_path_factory: pytest.TempPathFactory, name: str, overrides: list[str]
) -> None:
    """The method's trainer resumes from lmforge's sealed checkpoints as DPO's does: a rank SIGKILLed
    after step 7 costs one retry from checkpoint-6, and the result is the uninterrupted run's (the
    same key, the same held-out figures)."""
    import threading

    from tests.test_align import _kill_rank_when

    workspace = tmp_path_factory.mktemp(f"{name}-killed")
    done = threading.Event()
    killer = threading.Thread(target=_kill_rank_when, args=(workspace, 1, 7, done, name), daemon=True)
    killer.start()
    try:
        run = run_from_aligned(aligned, tmp_path_factory, name, overrides, workspace=workspace)
    finally:
        done.set()
    resumed, uninterrupted = run[f"align/{name}"], reference[f"align/{name}"]
    assert resumed["key"] == uninterrupted["key"] and resumed["counts"]["attempts"] == 2
    assert "resuming from checkpoint-6" in (Path(resumed["dir"]) / "logs" / "rank-0.log").read_text()
    for metric in ("preference_accuracy_after", "logprob_margin_after"):  # the held-out figures of the result
        assert abs(resumed["metrics"][metric] - uninterrupted["metrics"][metric]) < 1e-4, metric

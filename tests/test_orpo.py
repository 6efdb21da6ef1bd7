"""ORPO (`training/align/methods/orpo.py`): one module and its registration, on 2 CPU ranks from the
session's pretrained model (init: base: ORPO needs no SFT model), measured, evaluated, quantized and
served like every aligned model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.preference_methods import (
    check_lineage_role,
    check_trained_and_measured,
    run_from_aligned,
    small,
)

# ORPO's own use: alignment straight from the model SFT starts from
SMALL_ORPO = small("orpo", "align.orpo.init=base")


@pytest.fixture(scope="module")
def orpo(aligned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_from_aligned(aligned, tmp_path_factory, "orpo", SMALL_ORPO)


@pytest.mark.slow
def test_orpo_trains_on_two_ranks_from_the_pretrained_model_and_is_measured_like_dpo(orpo: dict, aligned: dict) -> None:
    logged = check_trained_and_measured(orpo, aligned, "orpo")  # SFT still runs (the recipe starts with it), cached
    started = json.loads((Path(orpo["align/orpo"]["dir"]) / "run_spec.json").read_text())["base_dir"]
    assert "/pretrain/" in started, started  # init: base: from the pretrained model, not SFT's
    # TRL's ORPO trainer counts no tokens: the entry does (AlignMethod.token_keys), so tokens/s is logged
    assert {"loss", "num_tokens", "tokens_per_s"} <= logged, sorted(logged)
    assert any(k.startswith("rewards/") for k in logged), sorted(logged)


def test_orpo_is_a_model_role_that_evaluation_quantization_and_serving_take() -> None:
    check_lineage_role("orpo")

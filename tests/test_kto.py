"""KTO (`training/align/methods/kto.py`): one module and its registration, on 2 CPU ranks from the
session's SFT model, measured, evaluated, quantized and served like every aligned model."""

from __future__ import annotations

import pytest

from tests.preference_methods import (
    check_lineage_role,
    check_resumes_after_a_killed_rank,
    check_trained_and_measured,
    run_from_aligned,
    small,
)


@pytest.fixture(scope="module")
def kto(aligned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_from_aligned(aligned, tmp_path_factory, "kto", small("kto"))


@pytest.mark.slow
def test_kto_trains_on_two_ranks_from_the_cached_sft_model_and_is_measured_like_dpo(kto: dict, aligned: dict) -> None:
    logged = check_trained_and_measured(kto, aligned, "kto")
    assert {"loss", "kl", "tokens_per_s"} <= logged, sorted(logged)


def test_kto_is_a_model_role_that_evaluation_quantization_and_serving_take() -> None:
    check_lineage_role("kto")


@pytest.mark.slow
def test_a_killed_kto_rank_is_retried_and_resumes_to_the_same_result(
    kto: dict, aligned: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The rank entry's resume (`training/align/entry.py`) is the same code for every preference
    method (the method only builds TRL's trainer): one killed-rank launch here stands for SFT's, DPO's,
    ORPO's and SimPO's too (QLoRA's, whose checkpoints hold an adapter on a 4-bit base, is in
    test_base_model.py)."""
    check_resumes_after_a_killed_rank(kto, aligned, tmp_path_factory, "kto", small("kto"))

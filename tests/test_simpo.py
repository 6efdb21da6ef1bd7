"""SimPO (`training/align/methods/simpo.py`): one module and its registration, on 2 CPU ranks from the
session's SFT model, measured, evaluated, quantized and served like every aligned model."""

from __future__ import annotations

import pytest

from tests.preference_methods import (
    check_lineage_role,
    check_trained_and_measured,
    run_from_aligned,
    small,
)


@pytest.fixture(scope="module")
def simpo(aligned: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_from_aligned(aligned, tmp_path_factory, "simpo", small("simpo"))


@pytest.mark.slow
def test_simpo_trains_on_two_ranks_from_the_cached_sft_model_and_is_measured_like_dpo(
    simpo: dict, aligned: dict
) -> None:
    logged = check_trained_and_measured(simpo, aligned, "simpo")
    # TRL's ORPO and CPO trainers log no `num_tokens`, so there is no tokens/s row (KTO's and DPO's have one)
    assert {"loss", "num_tokens", "tokens_per_s"} <= logged and any(k.startswith("rewards/") for k in logged), sorted(
        logged
    )


def test_simpo_is_a_model_role_that_evaluation_quantization_and_serving_take() -> None:
    check_lineage_role("simpo")

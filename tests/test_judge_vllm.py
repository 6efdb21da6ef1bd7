"""The judge against a real vLLM server: an OpenAI-compatible endpoint that wants its key.

The small lineage (the session's `evaluated` workspace: every metric run cached) gets the judged
steps: its SFT and DPO models answer on their own temporary vLLM servers, and a judge served by
vLLM at a URL, reached through the `openai` client with the key from the environment, compares
them, grades them, measures itself on the verifiable pairs and classifies the safety suite. Then
the same judge, unreachable: one line, retried by the executor, nothing cached.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from tests.conftest import small_config


@pytest.fixture(scope="module")
def judge_server(evaluated: dict, tmp_path_factory: pytest.TempPathFactory):
    """The small SFT model with a 512-token context (its RoPE extends; the judge's prompts hold two
    answers), served by vLLM with a key."""
    from lmforge.inference.vllm_server import EngineConfig, TemporaryServer

    workspace = Path(evaluated["evaluate/report"]["dir"]).parents[2]
    source = next((workspace / "align" / "sft").glob("*/hf"))
    folder = tmp_path_factory.mktemp("judge") / "hf"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    with TemporaryServer(folder, EngineConfig(), folder.parent / "server", "small-judge") as server:
        yield server


@pytest.fixture(scope="module")
def judged_workspace(evaluated: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the evaluated lineage both tests use (the second finds the first's answers cached)."""
    target = tmp_path_factory.mktemp("judged") / "ws"
    shutil.copytree(Path(evaluated["evaluate/report"]["dir"]).parents[2], target, symlinks=True)
    return target


def _judged(workspace: Path, url: str, *extra: str):
    return small_config(
        workspace,
        "evaluate.judge.enabled=true",
        "evaluate.judge.model=null",  # the preset's judge is a model of the lineage: this one is an endpoint
        f"evaluate.judge.endpoint.url={url}",
        "evaluate.judge.endpoint.model=small-judge",
        "evaluate.judge.endpoint.api_key_env=TEST_JUDGE_KEY",
        "evaluate.judge.constrained=true",  # the endpoint is vLLM: structured outputs
        "evaluate.judge.template=compact",
        "evaluate.judge.max_prompts=16",
        "evaluate.judge.retries=1",
        "evaluate.judge.backoff_s=0.1",
        "evaluate.safety.enabled=true",
        "evaluate.answers.max_tokens=12",
        *extra,
    )


def test_a_vllm_judge_endpoint_judges_the_lineage_and_a_rerun_asks_nothing(
    judged_workspace: Path, judge_server, monkeypatch
) -> None:
    from lmforge.engine.executor import run_pipeline_locally

    monkeypatch.setenv("TEST_JUDGE_KEY", judge_server.api_key)
    workspace = judged_workspace
    config = _judged(workspace, f"{judge_server.base_url}/v1")
    manifests = run_pipeline_locally(config, ["evaluate"])

    judge = json.loads((Path(manifests["evaluate/judge"]["dir"]) / "judge.json").read_text())
    assert judge["judge"]["kind"] == "endpoint" and judge["calls"] > 0
    agree = judge["agreement"]
    assert agree["n"] > 0 and 0.0 <= agree["estimate"] <= 1.0 and agree["low"] <= agree["estimate"] <= agree["high"]
    (pair,) = judge["pairwise"]
    assert (pair["first"], pair["second"]) == ("sft", "dpo") and pair["prompts"] == 16
    assert 0.0 <= pair["swap_consistency"] <= 1.0 and pair["unparsed"] == 0  # constrained: always a verdict
    assert pair["order_averaged"]["n"] == 16  # defined for every prompt, whatever the judge's consistency
    assert set(judge["grades"]) == {"sft", "dpo"} and all(g["unparsed"] == 0 for g in judge["grades"].values())
    safety = json.loads((Path(manifests["evaluate/safety"]["dir"]) / "safety.json").read_text())
    assert set(safety["models"]) == {"sft", "dpo"} and safety["judge_accuracy"]["n"] == 60
    assert "judge" in safety["classifier"] or "rule-based" in safety["classifier"]

    card = (Path(manifests["evaluate/report"]["dir"]) / "comparison.md").read_text()
    assert "## Judged by an LLM" in card and "| dpo vs sft |" in card and "## Safety suite" in card
    verdict = json.loads((Path(manifests["evaluate/report"]["dir"]) / "report.json").read_text())
    assert verdict["judge"]["pairwise"][0]["second"] == "dpo" and "dpo" in verdict["safety"]["rates"]
    assert manifests["evaluate/judge"]["metrics"]["judge/agreement"] == agree["estimate"]

    # the same run again: every step reused
    again = run_pipeline_locally(config, ["evaluate"])
    assert again["evaluate/judge"]["key"] == manifests["evaluate/judge"]["key"]
    # a setting that re-keys the judge step but asks the same questions: every call from the cache
    rekeyed = run_pipeline_locally(
        _judged(workspace, f"{judge_server.base_url}/v1", "evaluate.judge.min_agreement=0.55"), ["evaluate"]
    )
    assert rekeyed["evaluate/judge"]["key"] != manifests["evaluate/judge"]["key"]
    assert rekeyed["evaluate/judge"]["counts"]["judge_calls"] == 0
    assert rekeyed["evaluate/judge"]["counts"]["cached_calls"] == judge["calls"] + judge["cached"]


def test_an_unreachable_judge_fails_in_one_line_is_retried_and_caches_nothing(
    judged_workspace: Path, judge_server, monkeypatch, caplog
) -> None:
    from lmforge.engine.executor import run_pipeline_locally
    from lmforge.inference.chat_client import EndpointUnreachable
    from lmforge.processes.launch import free_port

    monkeypatch.setenv("TEST_JUDGE_KEY", judge_server.api_key)
    workspace = judged_workspace
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens
    config = _judged(workspace, url, "evaluate.safety.enabled=false")

    def made() -> set[Path]:  # complete judge calls and judge step outputs
        return set(workspace.glob("evaluate/judgments/*/manifest.json")) | set(
            workspace.glob("evaluate/judge/*/manifest.json")
        )

    before = made()
    with (
        caplog.at_level(logging.WARNING, logger="lmforge.engine.executor"),
        pytest.raises(EndpointUnreachable) as caught,
    ):
        run_pipeline_locally(config, ["evaluate"])
    message = str(caught.value)
    assert "\n" not in message and url in message and "unreachable" in message
    assert judge_server.api_key not in message and judge_server.api_key not in caplog.text
    retries = [r for r in caplog.records if "evaluate/judge failed with EndpointUnreachable" in r.getMessage()]
    assert len(retries) == 2  # the step's two retries, then the failure
    assert made() == before  # nothing cached: no judge call, no judge output

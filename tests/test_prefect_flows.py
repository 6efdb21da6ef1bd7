"""Prefect wiring: stage-key caching across runs, invalidation, retries, artifacts, logs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prefect import flow, task

from lmforge.errors import ConfigError, TrainingInterrupted
from tasks.retry import should_retry
from tests.conftest import SMALL_CURATE, SMALL_PRETRAIN


def _run(workspace: Path, *extra: str) -> dict:
    from flows.pipeline import pipeline

    return pipeline(
        preset="tiny-cpu",
        overrides=[*SMALL_CURATE, *SMALL_PRETRAIN, *extra],
        workspace=str(workspace),
        stages=["curate"],
    )


def test_outputs_built_without_prefect_are_cache_hits_under_prefect(curated_copy: Path, prefect_server) -> None:
    first = _run(curated_copy)  # the workspace was curated with --local: one cache for both
    assert {s["status"] for s in first["steps"].values()} == {"cached"}
    assert {s["status"] for s in _run(curated_copy)["steps"].values()} == {"cached"}


def test_damaged_output_is_recomputed_not_served_from_prefect(curated_copy: Path, prefect_server) -> None:
    _run(curated_copy)
    _run(curated_copy)
    victim = next((curated_copy / "curate" / "heuristics").glob("*/attributes/*.parquet"))
    victim.write_bytes(b"garbage")
    third = _run(curated_copy)
    status = {n: s["status"] for n, s in third["steps"].items()}
    assert status["curate/heuristics"] == "computed"
    assert status["curate/select"] == "cached"  # same bytes rebuilt: downstream keys unchanged
    assert victim.read_bytes() != b"garbage"


def test_config_change_recomputes_that_step_and_downstream_only(curated_copy: Path, prefect_server) -> None:
    _run(curated_copy)
    changed = _run(curated_copy, "curate.tokenizer.vocab_size=1100")
    status = {n: s["status"] for n, s in changed["steps"].items()}
    assert status["curate/tokenizer"] == status["curate/pack"] == "computed"
    assert all(s != "computed" for n, s in status.items() if n not in ("curate/tokenizer", "curate/pack"))


def test_a_cache_hit_counts_as_the_latest_use(curated_copy: Path, prefect_server) -> None:
    """Switching back to an earlier config is a cache hit; `explain` must compare against it next time."""
    from lmforge.engine.store import StageStore

    original = _run(curated_copy)
    _run(curated_copy, "curate.tokenizer.vocab_size=1100")
    back = _run(curated_copy)
    assert back["steps"]["curate/tokenizer"]["status"] == "cached"
    latest = StageStore(curated_copy).latest("curate/tokenizer")
    assert latest is not None and latest["key"] == original["steps"]["curate/tokenizer"]["key"]


def test_artifacts_are_published_under_stable_keys(curated_copy: Path, prefect_server) -> None:
    import json

    from prefect.client.orchestration import get_client

    result = _run(curated_copy)

    async def latest():
        async with get_client() as client:
            return {a.key: a for a in await client.read_latest_artifacts()}

    artifacts = asyncio.run(latest())
    assert {"curation-stats", "curate-steps", "curate-card", "pipeline-lineage"} <= set(artifacts)

    def table(key: str) -> list[dict]:
        data = artifacts[key].data
        return json.loads(data) if isinstance(data, str) else data

    stats = {row["metric"]: row["value"] for row in table("curation-stats")}
    removed = sum(v for k, v in stats.items() if k.startswith("removed: "))
    assert stats["input records"] == stats["kept"] + removed + stats["quarantined (malformed)"]
    steps = {row["step"]: row for row in table("curate-steps")}
    assert set(steps) == set(result["steps"]) and all(
        row["output"] == result["steps"][name]["dir"] for name, row in steps.items()
    )
    card, lineage = artifacts["curate-card"].data, artifacts["pipeline-lineage"].data
    assert all(f"`{row['output']}`" in card for row in steps.values())
    assert all(f"`{name}`" in lineage and result["steps"][name]["key"] in lineage for name in result["steps"])


def _logged(run_id: str, wanted: str) -> bool:
    """Whether the flow run's log has a message containing `wanted` (logs are shipped in the background)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def messages() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            return [line.message for line in logs]

    for _ in range(20):
        if any(wanted in m for m in asyncio.run(messages())):
            return True
        time.sleep(0.5)
    return False


def test_library_logs_reach_the_prefect_run_log(curated_copy: Path, prefect_server) -> None:
    import logging

    @flow
    def emit() -> str:
        from prefect.runtime import flow_run

        import tasks  # noqa: F401  (connects the domain loggers)

        logging.getLogger("data_prep.unit_test").info("hello from the domain")
        return flow_run.id

    run_id = emit()
    assert _logged(run_id, "hello from the domain")


@pytest.mark.parametrize("error, attempts", [(TrainingInterrupted("rank killed"), 3), (ConfigError("bad field"), 1)])
def test_retry_condition_retries_only_retryable_failures(error: Exception, attempts: int, prefect_server) -> None:
    calls: list[int] = []

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=should_retry)
    def flaky() -> None:
        calls.append(1)
        raise error

    @flow
    def run() -> None:
        flaky()

    with pytest.raises(type(error)):
        run()
    assert len(calls) == attempts


def test_worker_process_logs_reach_the_prefect_run_log(tmp_path: Path, prefect_server) -> None:
    """Shard units run in spawned worker processes; what they log must still reach the run's log."""
    from lmforge.config import load_config
    from lmforge.engine.graph import StepContext
    from tasks.steps import run_unit_task

    bad = tmp_path / "mixed.jsonl"
    bad.write_text('{"id": "a", "text": "good text here"}\n{"id": "b", "text": broken\n')
    config = load_config("tiny-cpu", [f"curate.inputs=[{bad}]"], str(tmp_path / "ws"))
    from lmforge.engine.executor import graph
    from lmforge.engine.graph import config_identity

    ctx = StepContext(
        "curate/ingest",
        "k",
        tmp_path / "out",
        config,
        {},
        tmp_path / "ws",
        identity=config_identity(graph().get("curate/ingest"), config),
    )

    @flow
    def one_unit() -> str:
        from prefect.runtime import flow_run

        import tasks  # noqa: F401  (connects the domain loggers)

        assert run_unit_task("curate/ingest", "f0000", ctx, 2, "checksum")["quarantined"] == {"invalid_json": 1}
        return flow_run.id

    run_id = one_unit()
    assert _logged(run_id, "quarantined 1 of 2 records")


def test_a_step_recomputed_outside_prefect_with_new_bytes_is_not_served_stale(
    curated_copy: Path, prefect_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--local recomputes the tokenizer with different bytes under the same key (a non-deterministic
    rerun); the next Prefect run must see the new digest, not the manifest Prefect cached before."""
    import data_prep.steps
    from lmforge.engine.executor import run_pipeline_locally
    from lmforge.engine.store import StageStore
    from tests.conftest import small_config

    before = _run(curated_copy)
    assert _run(curated_copy)["steps"]["curate/tokenizer"]["status"] == "cached"
    store = StageStore(curated_copy)
    old = store.latest("curate/tokenizer")
    store.invalidate(
        store.step_dir("curate/tokenizer", old["key"])
    )  # as if lost; the rerun below makes other bytes under the same key
    original = data_prep.steps.train_bpe
    monkeypatch.setattr(
        data_prep.steps,
        "train_bpe",
        lambda texts, vocab, freq, out: original(texts[: len(texts) // 2], vocab, freq, out),
    )
    local = run_pipeline_locally(small_config(curated_copy), ["curate"])
    monkeypatch.setattr(data_prep.steps, "train_bpe", original)
    assert local["curate/tokenizer"]["key"] == old["key"] and local["curate/tokenizer"]["digest"] != old["digest"]

    after = _run(curated_copy)
    assert {s["status"] for s in after["steps"].values()} == {"cached"}
    pack = after["manifests"]["curate/pack"]  # built on the bytes that are really there now
    assert pack["key_components"]["upstream"]["curate/tokenizer"] == local["curate/tokenizer"]["digest"]
    assert pack["key"] == local["curate/pack"]["key"] != before["steps"]["curate/pack"]["key"]


def test_each_output_is_hashed_once_per_run(
    curated_copy: Path, prefect_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmforge.engine.store

    _run(curated_copy)
    for stamps in curated_copy.rglob(lmforge.engine.store.VERIFIED):  # else files verified by the first run are trusted
        stamps.unlink()  # by their stat stamps and, timing permitting, nothing is left to hash
    hashed: list[str] = []
    real = lmforge.engine.store.file_sha256
    monkeypatch.setattr(lmforge.engine.store, "file_sha256", lambda path: hashed.append(str(path)) or real(path))
    _run(curated_copy)
    assert hashed, "the run verified nothing"
    assert len(hashed) == len(set(hashed)), [h for h in set(hashed) if hashed.count(h) > 1][:5]

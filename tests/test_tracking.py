"""MLflow tracking against a real `mlflow server` on 127.0.0.1 (from .venv-mlflow, made by scripts/setup.sh).

The small pipeline runs once with tracking on (pretraining, SFT, evaluation of the SFT model on the
hf backend); what it logged is read back with `mlflow.MlflowClient`. Then: a rerun that reuses
everything logs nothing, a pipeline flow under Prefect logs under its flow run, and with the
server stopped the pipeline still completes, with one warning line. A pipeline run whose server dies
under it is not left RUNNING: it is ended once the server answers again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import load_config
from lmforge.engine.executor import graph, run_pipeline_locally
from tests.conftest import SMALL_ALIGN, SMALL_CURATE, SMALL_EVAL, SMALL_PRETRAIN, small_config

ROOT = Path(__file__).resolve().parent.parent
# the SFT model evaluated on the hf backend: every tracked kind of step, without DPO or vLLM's minutes
# fewer steps than the session's lineage: what is logged is the point here, not how well it trained
PRETRAIN_STEPS, SFT_STEPS = 40, 30
SCOPE = [
    "evaluate.models=[sft]",
    "evaluate.backends=[hf]",
    "align.dpo.enabled=false",
    f"pretrain.max_steps={PRETRAIN_STEPS}",
    f"align.sft.max_steps={SFT_STEPS}",
]
LOGGED = {"pretrain/train", "align/sft", "evaluate/sft-hf", "evaluate/report"}


def _mlflow_command() -> str:
    found = ROOT / ".venv-mlflow" / "bin" / "mlflow"
    if found.exists():
        return str(found)
    if os.environ.get("LMFORGE_SKIP_MLFLOW_ENV") == "1":
        pytest.skip("LMFORGE_SKIP_MLFLOW_ENV=1: no MLflow server environment (.venv-mlflow)")
    pytest.fail(
        f"{found} is missing: run `bash scripts/setup.sh` (it makes .venv-mlflow from requirements/mlflow.lock)"
    )


class MlflowServer:
    """`mlflow server` in its own process group, on a free loopback port (or `port`: the same server
    started again on the same store), with SQLite and served artifacts."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        if port is None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = int(probe.getsockname()[1])
        self.root, self.port = root, port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        command = [
            _mlflow_command(),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
        ]
        # MLflow 3's server also starts a job runner and a dozen huey consumers (GenAI jobs: prompt
        # optimisation, scorers) that lmforge never submits to: 14 Python processes and about 25 s of CPU
        # per start on 2 cores. The tracking API and the artifact proxy run without them.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"mlflow server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        # the server dies (SIGKILL, the whole group: the server and its uvicorn worker). A graceful
        # SIGTERM waited on the worker's open connections, up to 20 s a stop on a loaded machine (the
        # server-dies test stops it four times: 146 s in the full suite against 29 s alone). The worker
        # can outlive the parent while it holds the listening socket: a request then gets a reset, not
        # a refusal. Stopped means every process of the group gone and the port refusing.
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while _listening(self.port) and time.monotonic() < deadline:
            time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    """Whether a live process of the group is left. Zombies do not count: once a test made this process
    a child subreaper (lmforge's launcher does), an orphaned worker that exited stays a zombie here
    until reaped, and `killpg(pgid, 0)` would call the group alive for as long."""
    import psutil

    for process in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    started = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield started
    finally:
        started.stop()


def _config(workspace: Path, uri: str, *extra: str) -> Any:
    return small_config(
        workspace, *SCOPE, "tracking.mlflow.enabled=true", f"tracking.mlflow.tracking_uri={uri}", *extra
    )


@pytest.fixture(scope="module")
def tracked(curated: tuple[Path, dict], server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The small pipeline, pretraining to evaluation, run once with tracking on."""
    workspace = tmp_path_factory.mktemp("tracked")
    shutil.copytree(curated[0], workspace, dirs_exist_ok=True, symlinks=True)
    started = time.monotonic()
    manifests = run_pipeline_locally(_config(workspace, server.url), ["evaluate"])
    return {"workspace": workspace, "manifests": manifests, "seconds": time.monotonic() - started}


def _client(server: MlflowServer) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server.url)


def _runs(server: MlflowServer) -> list[Any]:
    client = _client(server)
    experiment = client.get_experiment_by_name("tiny-cpu")
    return [] if experiment is None else list(client.search_runs([experiment.experiment_id], max_results=1000))


def _measured(out: Path, step: str) -> dict[str, Any]:
    """The manifest of a computed evaluation step that measured one number (what tracking logs)."""
    out.mkdir(parents=True)
    now = time.time()
    return {
        "stage": "evaluate",
        "step": step,
        "key": f"key-of-{step.replace('/', '-')}",
        "dir": str(out),
        "metrics": {"acc": 0.5},
        "params": {"evaluate": {"limit": 8}},
        "timings": {"started_at": now - 1, "finished_at": now},
    }


def _pipelines(server: MlflowServer) -> dict[str, Any]:
    """The pipeline runs in the store, by their lmforge pipeline run id."""
    return {r.data.tags["lmforge.pipeline_run"]: r for r in _runs(server) if r.data.tags["lmforge.kind"] == "pipeline"}


# -- no server needed ------------------------------------------------------------------------------


def test_tracking_is_in_no_step_key() -> None:
    from lmforge.hashing import digest

    def identities(*overrides: str) -> dict[str, str]:
        config = load_config("tiny-cpu", list(overrides), "/tmp/lmforge-keys-test")
        return {step.name: digest([step.version, step.identity(config)]) for step in graph().steps}

    base = identities()
    tracked = identities(
        "tracking.mlflow.enabled=true",
        "tracking.mlflow.tracking_uri=http://127.0.0.1:5999",
        "tracking.mlflow.experiment=elsewhere",
    )
    assert tracked == base
    config = load_config("tiny-cpu", [], "/tmp/lmforge-keys-test")
    reads = [r for step in graph().steps for r in step.declared_reads(config)]
    assert not [r for r in reads if r == "tracking" or r.startswith("tracking.")]


def test_what_a_step_output_becomes_in_mlflow(tmp_path: Path) -> None:
    from lmforge import tracking

    assert tracking.metric_name("lmforge_humaneval/pass@1") == "lmforge_humaneval/pass_at_1"
    assert tracking.metric_name("a//b/../c d#e") == "a/b/_/c d_e"
    metrics = tracking.numeric_metrics({"acc": 0.5, "acc_ci": [0.25, 0.75], "by": {"x": 1}, "flag": True, "nan": 1e400})
    assert metrics == {"acc": 0.5, "acc_ci_low": 0.25, "acc_ci_high": 0.75, "by.x": 1.0}
    params = tracking.step_params(
        {"params": {"serve": {"api_key": "sk-123", "max_tokens": 8}, "hf_token": "x", "url": "Bearer abc", "l": [1]}}
    )
    assert params == {
        "serve.api_key": "<redacted>",
        "serve.max_tokens": "8",
        "hf_token": "<redacted>",
        "url": "<redacted>",
        "l": "[1]",
    }
    assert tracking.public_uri("https://user:secret@mlflow.example:8443/x?token=t") == "https://mlflow.example:8443/x"
    assert tracking.public_uri("sqlite:////ws/mlflow.db") == "sqlite:////ws/mlflow.db"
    refused = Exception("API request to http://127.0.0.1:1/api failed ... [Errno 111] Connection refused'))")
    assert tracking.short_reason(refused) == "Connection refused"
    for cause, reason in [  # the forms a server going down mid-request takes
        (
            "ProtocolError('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
            "Connection reset by peer",
        ),
        (
            "ProtocolError('Connection aborted.', RemoteDisconnected('Remote end closed connection without response'))",
            "Remote end closed connection without response",
        ),
        ("ResponseError('too many 503 error responses')", "too many 503 error responses"),
    ]:
        text = (
            "API request to http://127.0.0.1:1/api failed with exception HTTPConnectionPool(host='127.0.0.1', "
            f"port=1): Max retries exceeded with url: /api (Caused by {cause})"
        )
        assert tracking.short_reason(Exception(text)) == reason
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "lr": 0.1}\n{"step": 2, "loss": 1.5, "val_loss": 1.7}\n'
    )
    assert sorted(tracking.read_series(tmp_path / "metrics.jsonl", 7)) == [
        ("loss", 1.5, 7, 2),
        ("loss", 2.0, 7, 1),
        ("lr", 0.1, 7, 1),
        ("val_loss", 1.7, 7, 2),
    ]


def test_summary_artifacts_link_to_the_mlflow_runs() -> None:
    from flows.stage import with_tracking_links
    from lmforge.engine.stage import ArtifactSpec

    link = "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    table, card = with_tracking_links(
        [ArtifactSpec("pretrain-summary", "table", [], "final"), ArtifactSpec("eval-card", "markdown", "# card", "")],
        {"pretrain/train": link},
    )
    assert table.description == f"final (MLflow: [pretrain/train]({link}))"
    assert card.data.endswith(f"MLflow run (pretrain/train): {link}\n")
    assert with_tracking_links([table], {}) == [table]


# -- against the real server -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_pipeline_run_is_not_left_running_when_the_server_dies_under_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server dies after a step was logged: the pipeline's MLflow run ends anyway once the server
    answers again, at the pipeline's own end or at the next pipeline run of the workspace. FAILED when
    steps went unlogged (the record is incomplete), else the pipeline's own status; tags say why."""
    from lmforge import tracking

    root = tmp_path / "mlflow-server"
    root.mkdir()
    server = MlflowServer(root)
    config = load_config(
        "tiny-cpu",
        ["tracking.mlflow.enabled=true", f"tracking.mlflow.tracking_uri={server.url}"],
        str(tmp_path / "ws"),
    )
    try:
        # 1. the server is back before the pipeline ends: the pipeline's end ends its run
        with caplog.at_level(logging.WARNING), tracking.pipeline_run(config) as first:
            assert tracking.step_computed(config, _measured(tmp_path / "a1", "evaluate/a1"))
            server.stop()
            assert tracking.step_computed(config, _measured(tmp_path / "a2", "evaluate/a2")) is None
            server = MlflowServer(root, port=server.port)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0], warnings  # still one line per pipeline run
        ended = _pipelines(server)[first.id]
        assert ended.info.status == "FAILED" and ended.info.end_time is not None
        assert ended.data.tags["lmforge.pipeline_status"] == "FINISHED"
        assert "Connection refused" in ended.data.tags["lmforge.tracking_incomplete"]

        # 2. the server is still down when the pipeline ends: the next pipeline run ends it
        with tracking.pipeline_run(config) as second:
            assert tracking.step_computed(config, _measured(tmp_path / "b1", "evaluate/b1"))
            server.stop()
        stopped_at = time.time()
        server = MlflowServer(root, port=server.port)
        assert _pipelines(server)[second.id].info.status == "RUNNING"  # nothing could end it yet
        with tracking.pipeline_run(config):  # computes nothing, logs nothing
            pass
        ended = _pipelines(server)[second.id]
        assert ended.info.status == "FINISHED"  # every step was logged; only its end was late
        assert ended.info.end_time <= 1000 * stopped_at  # when the pipeline ended, not when it was recorded
        assert ended.data.tags["lmforge.pipeline_status"] == "FINISHED"
        assert "Connection refused" in ended.data.tags["lmforge.ended_late"]
        assert [r for r in _runs(server) if r.info.status == "RUNNING"] == []
        assert tracking.unended(config) == []  # the workspace's record of runs to end is empty again
    finally:
        server.stop()


@pytest.mark.slow
def test_the_pipeline_run_and_its_steps_are_read_back_from_mlflow(tracked: dict, server: MlflowServer) -> None:
    manifests = tracked["manifests"]
    client = _client(server)
    runs = _runs(server)
    parents = [r for r in runs if r.data.tags.get("lmforge.kind") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    steps = {r.info.run_name: r for r in runs if r.data.tags.get("lmforge.kind") == "step"}
    assert set(steps) == LOGGED  # trains, evaluates: yes; prepares data, indexes, task files: no
    for name, run in steps.items():
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["lmforge.step_key"] == manifests[name]["key"]
        assert tags["lmforge.step"] == name and tags["lmforge.engine.stage"] == name.split("/")[0]
        assert tags["lmforge.pipeline_run"] == parent.data.tags["lmforge.pipeline_run"]
        assert run.info.status == "FINISHED"

    # pretraining: the whole loss series, one point per optimizer step, as metrics.jsonl has it
    train = steps["pretrain/train"]
    rows = [json.loads(line) for line in (Path(manifests["pretrain/train"]["dir"]) / "metrics.jsonl").open()]
    history = sorted(client.get_metric_history(train.info.run_id, "loss"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert len(history) == PRETRAIN_STEPS
    for series in ("val_loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
        assert client.get_metric_history(train.info.run_id, series), series
    assert train.data.params["pretrain.max_steps"] == str(PRETRAIN_STEPS)
    assert train.data.params["pretrain.model.hidden_size"] == "64"
    assert train.data.tags["lmforge.lineage_key"] == manifests["pretrain/train"]["key"]
    assert {f.path for f in client.list_artifacts(train.info.run_id, "curves")} == {"curves/pretrain-train-curves.png"}

    # SFT: its series and its held-out metrics with their intervals
    sft = steps["align/sft"]
    assert len(client.get_metric_history(sft.info.run_id, "loss")) == SFT_STEPS
    metrics = sft.data.metrics
    assert (
        metrics["heldout_loss_after_ci_low"] <= metrics["heldout_loss_after"] <= metrics["heldout_loss_after_ci_high"]
    )
    assert metrics["heldout_loss_after"] == pytest.approx(manifests["align/sft"]["metrics"]["heldout_loss_after"])
    assert sft.data.params["align.sft.max_steps"] == str(SFT_STEPS)
    assert sft.data.tags["lmforge.lineage_key"] == manifests["align/sft"]["key"]

    # evaluation: the model's scores, and the card's with their 95% intervals, tagged with the SFT lineage
    evaluated = steps["evaluate/sft-hf"]
    assert evaluated.data.metrics["lmforge_continuation/acc_norm"] == pytest.approx(
        manifests["evaluate/sft-hf"]["metrics"]["lmforge_continuation/acc_norm"]
    )
    assert "lmforge_humaneval/pass_at_1" in evaluated.data.metrics
    report = steps["evaluate/report"]
    card = report.data.metrics
    base = "sft/hf/lmforge_continuation/acc_norm"
    assert card[f"{base}_ci_low"] <= card[base] <= card[f"{base}_ci_high"]
    assert card[base] == pytest.approx(evaluated.data.metrics["lmforge_continuation/acc_norm"])
    for run in (evaluated, report):
        assert run.data.tags["lmforge.lineage_key"] == manifests["align/sft"]["key"]
    assert {"comparison.md", "report.json"} <= {f.path for f in client.list_artifacts(report.info.run_id)}
    print(f"\ntracked pipeline (pretrain, SFT, evaluation) computed and logged in {tracked['seconds']:.0f}s")


@pytest.mark.slow
def test_a_rerun_that_reuses_everything_logs_nothing(tracked: dict, server: MlflowServer) -> None:
    before = {r.info.run_id for r in _runs(server)}
    manifests = run_pipeline_locally(_config(tracked["workspace"], server.url), ["evaluate"])
    assert manifests.keys() == tracked["manifests"].keys()
    assert {r.info.run_id for r in _runs(server)} == before


@pytest.mark.slow
def test_a_prefect_pipeline_logs_under_its_flow_run(tracked: dict, server: MlflowServer, prefect_server) -> None:
    import asyncio

    from prefect.client.orchestration import get_client

    from flows.pipeline import pipeline

    workspace = tracked["workspace"]
    report = Path(tracked["manifests"]["evaluate/report"]["dir"])
    shutil.rmtree(report)  # recomputed (same key) under Prefect; everything else is reused
    before = {r.info.run_id for r in _runs(server)}
    overrides = [
        *SMALL_CURATE,
        *SMALL_PRETRAIN,
        *SMALL_ALIGN,
        *SMALL_EVAL,
        *SCOPE,
        "tracking.mlflow.enabled=true",
        f"tracking.mlflow.tracking_uri={server.url}",
    ]
    state = pipeline(
        preset="tiny-cpu", overrides=overrides, workspace=str(workspace), stages=["evaluate"], return_state=True
    )
    result = state.result()
    assert result["steps"]["evaluate/report"]["status"] == "computed"
    assert [s for s in result["steps"].values() if s["status"] == "computed"] == [result["steps"]["evaluate/report"]]
    new = [r for r in _runs(server) if r.info.run_id not in before]
    parent = next(r for r in new if r.data.tags["lmforge.kind"] == "pipeline")
    step = next(r for r in new if r.data.tags["lmforge.kind"] == "step")
    assert len(new) == 2 and step.info.run_name == "evaluate/report"
    flow_run_id = str(state.state_details.flow_run_id)
    assert parent.data.tags["lmforge.pipeline_run"] == parent.data.tags["prefect.flow_run_id"] == flow_run_id
    assert parent.info.status == "FINISHED"  # ended by the pipeline flow, which owns it
    assert step.data.tags["mlflow.parentRunId"] == parent.info.run_id
    stage_run = step.data.tags["prefect.flow_run_id"]  # the evaluate subflow that computed it
    assert stage_run != flow_run_id and step.data.tags["prefect.flow_run_name"].startswith("evaluate-")
    assert parent.data.tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{flow_run_id}")
    assert step.data.tags["prefect.flow_run_url"].endswith(f"/runs/flow-run/{stage_run}")
    link = f"{server.url}/#/experiments/{step.info.experiment_id}/runs/{step.info.run_id}"

    async def latest() -> dict[str, Any]:
        async with get_client() as client:
            return {a.key: a for a in await client.read_latest_artifacts()}

    artifacts = asyncio.run(latest())
    assert f"MLflow run (evaluate/report): {link}" in artifacts["evaluate-card"].data
    assert link in artifacts["eval-results"].description
    assert f"MLflow run: {server.url}/#/experiments/" in artifacts["pipeline-lineage"].data
    assert parent.info.run_id in artifacts["pipeline-lineage"].data


@pytest.mark.slow
def test_with_the_server_stopped_the_pipeline_completes_with_one_warning(
    tracked: dict, server: MlflowServer, caplog: pytest.LogCaptureFixture
) -> None:
    server.stop()
    workspace = tracked["workspace"]
    for name in ("evaluate/sft-hf", "evaluate/report"):  # two tracked steps compute again
        shutil.rmtree(workspace / name / tracked["manifests"][name]["key"], ignore_errors=True)
    started, wall = time.monotonic(), time.time()
    with caplog.at_level(logging.WARNING):
        manifests = run_pipeline_locally(_config(workspace, server.url), ["evaluate"])
    assert all(manifests[name]["timings"]["finished_at"] >= wall for name in ("evaluate/sft-hf", "evaluate/report"))
    # any logger: urllib3's retry lines or MLflow's own would be more lines on the terminal
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "mlflow" in r.getMessage().lower()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert f"MLflow tracking at {server.url} unavailable" in message and "\n" not in message
    assert time.monotonic() - started < 120

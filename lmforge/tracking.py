"""MLflow experiment tracking: one MLflow run per pipeline run, a nested run per computed step.

`tracking.mlflow.enabled` turns it on; `tracking.mlflow.tracking_uri` says where (default
`sqlite:///<workspace>/mlflow.db`, which needs no server; any MLflow tracking URI otherwise) and
`tracking.mlflow.experiment` in which experiment (default: the preset name). Each step that
trains, evaluates or quantizes and was *computed* in this run gets a nested run under the
pipeline's run, made from the step's finished output:

- parameters: the step's identity fields (`manifest["params"]`, the config part of its key),
  flattened to dotted names; a field named like a secret (`api_key`, `token`, `password`, ...) is
  logged as `<redacted>`;
- metrics: the series in its `metrics.jsonl` at their training steps (loss, val_loss, grad_norm,
  lr, tokens_per_s, mfu, DPO rewards, held-out scores: whatever the step writes), its manifest's
  final metrics and counts (an interval `x_ci: [low, high]` becomes `x_ci_low`/`x_ci_high`; a name
  its series uses too gets a `summary/` prefix), the evaluation card's results with their 95%
  intervals (`<model>/<backend>/<task>/<metric>` and `..._ci_low`/`..._ci_high`) and the
  quantization gate's deltas (`<scheme>/<task>/<metric>_delta`, with their intervals);
- artifacts: the curves (PNG), the evaluation card (`comparison.md`, `report.json`), the
  quantization report (`verdict.json`, `report.json`) and the step's `summary.json`;
- tags: `lmforge.step_key` (the output's content address), `lmforge.lineage_key` (the key of the
  model the step makes, or of the model(s) it evaluates or quantizes: the key the served model's
  name carries), stage, step, output digest and folder, its inputs, the git commit, and the
  Prefect flow run (`prefect.flow_run_id`, `prefect.flow_run_url`) when Prefect runs it.

Why after the step, from the orchestrating process, by reading the step's output:

- one process logs, so "only rank 0 logs" holds by construction: training ranks never import
  MLflow, open no connection and can be neither slowed nor failed by a tracking server;
- a tracking server that cannot be reached costs one warning line, and tracking is then off for
  the rest of that pipeline run (no second warning, no waiting on a dead server per step); the
  step's output is complete already and nothing fails;
- a cached step computed nothing and is not logged again, so a run that reuses every output
  creates no MLflow run at all: the pipeline's run is made by the first step that logs;
- tracking is in no cache key: its section holds runtime fields only, which no step reads.

The pipeline's MLflow run is never left RUNNING because the server went away. Its owner (see
`pipeline_run`) tries to end it when the pipeline ends, even after tracking gave up mid-run (one
more request: the server may be back). Where that fails too, the run is written to the workspace's
record of runs to end (`.tracking/mlflow-unended.json`: the server's address without credentials,
the run, the pipeline's outcome and when it ended), and the next pipeline run of the workspace
ends it, when it starts and again when it ends, as soon as the server answers. A record rather
than a watcher thread: nothing keeps running after the pipeline, and the next run is the first
moment anything of lmforge talks to that server again. The status says how complete the record
is: the pipeline's own status when every step was logged (`lmforge.ended_late` tags a late end),
FAILED when steps went unlogged (`lmforge.tracking_incomplete` says from when and why); the
pipeline's outcome is kept in `lmforge.pipeline_status` either way. A run ended meanwhile by
someone else keeps its status. Not covered: an owner process killed outright ends nothing and
writes no record.

Under Prefect every task of one pipeline flow run (its stage subflows, or stage deployments on
other workers) logs under the same MLflow run, found by the root flow run id
(`lmforge.pipeline_run` tag); without Prefect, each `run_pipeline_locally` call is one pipeline run.
MLflow is imported only when a step is logged, with a short HTTP timeout and no retries
(`MLFLOW_HTTP_REQUEST_*`, set only where the environment does not set them already).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from lmforge.engine.remote import is_remote, local_workspace

if TYPE_CHECKING:
    from lmforge.pipelinebase import PipelineBase

log = logging.getLogger("lmforge.tracking")

TRACKED_STAGES = ("pretrain", "align", "evaluate", "quantize")  # stages whose steps train, evaluate or quantize
SERIES_FILE = "metrics.jsonl"  # one JSON object per logged training step: {"step": N, "loss": ..., ...}
CARD_FILES = ("comparison.md", "report.json", "verdict.json", "summary.json")
MODEL_KINDS = ("hf-model", "quantized-model")  # products that are models: what a lineage key names
MAX_ARTIFACT_BYTES = 32 * 2**20
MAX_SERIES_POINTS = 10_000  # per metric: a longer series is thinned evenly (its last point kept)
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # a failed request ends tracking for the run: no minutes of backoff
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}
REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"^(.*_)?(key|apikey|token|secret|password|passwd|credentials?)$", re.IGNORECASE)
_SECRET_VALUE = re.compile(r"^(sk-|Bearer\s)", re.IGNORECASE)
_BAD_NAME_CHARS = re.compile(r"[^/\w.\- :]")  # what MLflow accepts in metric and parameter names
_SERIES_META = ("step", "time", "timestamp", "wall_time")


@dataclass
class PipelineRun:
    """One pipeline run as tracking sees it: its id and, under Prefect, where its flow runs are shown."""

    id: str
    orchestrated: bool = False  # a Prefect flow run: other processes may log under the same MLflow run
    ui_url: str | None = None  # the Prefect UI's base URL, when it is known
    others_logged: bool = False  # set by the owner when steps were logged in other processes (deployments)


@dataclass
class _State:
    """This process's MLflow state for one pipeline run."""

    uri: str
    experiment_id: str | None = None
    parent_id: str | None = None
    failed: bool = False
    lost: str | None = None  # why steps went unlogged: tracking gave up (short reason), if it did


_current: contextvars.ContextVar[PipelineRun | None] = contextvars.ContextVar("lmforge_tracking_run", default=None)
_process_run = PipelineRun(uuid.uuid4().hex)  # steps executed outside any pipeline run share this one
_lock = threading.RLock()
_states: dict[str, _State] = {}
_links: dict[tuple[str, str], str] = {}  # (step, key) -> its MLflow run, for the Prefect artifacts
_clients: dict[str, Any] = {}


def enabled(config: PipelineBase) -> bool:
    return bool(config.tracking.mlflow.enabled)


def tracking_uri(config: PipelineBase) -> str:
    """The configured tracking URI, or the workspace's own SQLite store."""
    return config.tracking.mlflow.tracking_uri or f"sqlite:///{local_workspace(config).resolve() / 'mlflow.db'}"


def experiment_name(config: PipelineBase) -> str:
    return config.tracking.mlflow.experiment or config.name


def current_run() -> PipelineRun:
    return _current.get() or _process_run


@contextlib.contextmanager
def pipeline_run(
    config: PipelineBase,
    run_id: str | None = None,
    *,
    orchestrated: bool = False,
    owner: bool = True,
    ui_url: str | None = None,
) -> Iterator[PipelineRun]:
    """Steps executed inside log under one MLflow run: `run_id`'s (a Prefect root flow run), or a new one.

    Without `run_id`, an enclosing pipeline run is joined as it is; otherwise a new one starts. The
    owner (the root flow, or `run_pipeline_locally`) ends the MLflow run when it leaves: FINISHED,
    or FAILED when an exception leaves with it.
    """
    joined = _current.get()
    if run_id is None and joined is not None:
        yield joined
        return
    if owner and enabled(config):
        _end_unended(config)
    run = PipelineRun(run_id or uuid.uuid4().hex, orchestrated=orchestrated, ui_url=ui_url)
    token = _current.set(run)
    status = "FINISHED"
    try:
        yield run
    except BaseException as exc:
        status = "FAILED" if isinstance(exc, Exception) else "KILLED"
        raise
    finally:
        _current.reset(token)
        if owner and enabled(config):
            _end_pipeline(config, run, status)


def step_computed(config: PipelineBase, manifest: dict[str, Any]) -> str | None:
    """Log a step computed in this run (see the module doc); returns where its MLflow run is, if logged.

    Never raises: a tracking problem is one warning line per pipeline run, and tracking stops there.
    """
    if not enabled(config) or not is_tracked(manifest):
        return None
    run = current_run()
    uri = tracking_uri(config)
    with _lock:
        state = _states.setdefault(run.id, _State(uri))
        if state.failed:
            return None
        try:
            client = _client(uri)
            if state.parent_id is None:
                _start_pipeline(client, config, run, state)
            assert state.experiment_id is not None and state.parent_id is not None
            run_id = _log_step(client, config, run, state, manifest)
        except Exception as exc:  # noqa: BLE001 - tracking never fails a step
            _give_up(state, exc, f"{manifest['step']} was not logged")
            return None
        link = run_link(uri, state.experiment_id, run_id)
        _links[(manifest["step"], manifest["key"])] = link
    log.info("%s: logged to MLflow: %s", manifest["step"], link)
    return link


def step_link(manifest: dict[str, Any]) -> str | None:
    """Where this process logged the step output's MLflow run (None: not logged here, e.g. cached)."""
    return _links.get((manifest["step"], manifest["key"]))


def pipeline_link(run: PipelineRun | None = None) -> str | None:
    """Where the pipeline run's MLflow run is, when this process logged to it."""
    state = _states.get((run or current_run()).id)
    if state is None or state.parent_id is None or state.experiment_id is None:
        return None
    return run_link(state.uri, state.experiment_id, state.parent_id)


def summary_line() -> str | None:
    """Where the last pipeline run of this process was logged, for the CLI's closing lines."""
    with _lock:
        logged = [state for state in _states.values() if state.parent_id is not None and state.experiment_id]
    if not logged:
        return None
    state = logged[-1]
    link = run_link(state.uri, str(state.experiment_id), str(state.parent_id))
    if link.startswith("http"):
        return f"MLflow:  {link}"
    return f"MLflow:  {link}  (browse: mlflow ui --backend-store-uri {public_uri(state.uri)})"


def is_tracked(manifest: dict[str, Any]) -> bool:
    """A step that trains, evaluates or quantizes: a tracked stage's step that writes a training series,
    measures something (manifest metrics) or writes a report (the evaluation card, the quantization
    verdict). Steps that only prepare (data, task files, n-gram indexes, calibration samples) count
    things but measure nothing, and are not logged."""
    if manifest.get("stage") not in TRACKED_STAGES:
        return False
    out = Path(manifest["dir"])
    reports = (SERIES_FILE, *(name for name in CARD_FILES if name != "summary.json"))
    return bool(numeric_metrics(manifest.get("metrics") or {})) or any((out / name).is_file() for name in reports)


def run_link(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page for a server URI; otherwise the run, its experiment and its store."""
    public = public_uri(uri)
    if public.startswith(("http://", "https://")):
        return f"{public.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
    return f"run {run_id} of experiment {experiment_id} in {public}"


def public_uri(uri: str) -> str:
    """The URI without credentials (user:password@) and query (tokens), fit for logs and artifacts."""
    parts = urlsplit(uri)
    if not parts.netloc or "@" not in parts.netloc and not parts.query:
        return uri
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, host, parts.path, "", parts.fragment))


# -- MLflow ---------------------------------------------------------------------------------------


def _client(uri: str) -> Any:
    if uri not in _clients:
        for name, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow.tracking import MlflowClient

        mlflow_log = logging.getLogger("mlflow")
        if mlflow_log.getEffectiveLevel() < logging.WARNING:  # its INFO lines (database set-up) are not ours
            mlflow_log.setLevel(logging.WARNING)
        _clients[uri] = MlflowClient(tracking_uri=uri)
    return _clients[uri]


def _give_up(state: _State, exc: BaseException, what: str) -> None:
    state.failed = True
    state.lost = state.lost or short_reason(exc)
    log.warning(
        "MLflow tracking at %s unavailable (%s): %s; no more MLflow logging in this pipeline run",
        public_uri(state.uri),
        short_reason(exc),
        what,
    )


def short_reason(exc: BaseException) -> str:
    """What went wrong, in a few words (MLflow's messages nest the whole urllib3 traceback text)."""
    text = str(exc)
    errno = re.findall(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return errno[-1].strip().rstrip(".")
    # a server going down mid-request: ConnectionResetError(104, 'Connection reset by peer'),
    # RemoteDisconnected('Remote end closed connection without response'), ResponseError('too many 503 ...')
    cause = re.findall(r"(?:Error\(-?\d+, |RemoteDisconnected\(|ResponseError\()'([^']+)'", text)
    if cause:
        return cause[-1].strip().rstrip(".")
    for phrase in ("timed out", "Name or service not known", "No route to host"):
        if phrase.lower() in text.lower():
            return phrase
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first if len(first) <= 160 else first[:157] + "..."


def _experiment(client: Any, config: PipelineBase, uri: str) -> str:
    name = experiment_name(config)
    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    # a store of files (the workspace's SQLite) keeps artifacts beside it, not in the current directory
    location = None if urlsplit(uri).scheme in ("http", "https", "databricks") else _local_artifacts(config)
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except Exception:  # another process created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _local_artifacts(config: PipelineBase) -> str:
    return (local_workspace(config).resolve() / "mlflow-artifacts").as_uri()


def _start_pipeline(client: Any, config: PipelineBase, run: PipelineRun, state: _State) -> None:
    """Find (Prefect: another task may have made it) or make the pipeline's MLflow run."""
    state.experiment_id = _experiment(client, config, state.uri)
    if run.orchestrated:
        found = _find_pipeline(client, state.experiment_id, run.id)
        if found is not None:
            state.parent_id = found
            return
    from lmforge.engine.codeprint import code_version

    tags = {
        "lmforge.kind": "pipeline",
        "lmforge.pipeline_run": run.id,
        "lmforge.preset": config.name,
        "lmforge.workspace": config.workspace
        if is_remote(config.workspace)
        else str(local_workspace(config).resolve()),
        "mlflow.note.content": f"lmforge pipeline run of preset {config.name} in {local_workspace(config).resolve()}",
        **_code_tags(code_version()),
    }
    if run.orchestrated:
        tags["prefect.flow_run_id"] = run.id
        url = flow_run_url(run.ui_url, run.id)
        if url:
            tags["prefect.flow_run_url"] = url
    created = client.create_run(state.experiment_id, tags=tags, run_name=f"{config.name}-{run.id[:8]}")
    state.parent_id = created.info.run_id


def _find_pipeline(client: Any, experiment_id: str, run_id: str) -> str | None:
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`lmforge.pipeline_run` = '{run_id}' and tags.`lmforge.kind` = 'pipeline'",
        max_results=1,
    )
    return str(found[0].info.run_id) if found else None


def _end_pipeline(config: PipelineBase, run: PipelineRun, status: str) -> None:
    """End the pipeline's MLflow run, then the recorded runs of earlier pipelines if the server answered."""
    if _end_own(config, run, status):
        _end_unended(config)


def _end_own(config: PipelineBase, run: PipelineRun, status: str) -> bool:
    """End the pipeline's own MLflow run (if it has one); False when the server did not answer, and the
    run is recorded for the next pipeline run to end."""
    with _lock:
        state = _states.get(run.id)
        if state is None and not run.others_logged:  # nothing logged: nothing to end
            return True
        state = state or _states.setdefault(run.id, _State(tracking_uri(config)))
        if state.failed and state.parent_id is None and not run.others_logged:
            return True  # tracking gave up before any run was made: nothing to end
        ended_ms = int(1000 * time.time())
        try:
            client = _client(state.uri)
            if state.parent_id is None:  # made by a stage deployment's process
                state.experiment_id = _experiment(client, config, state.uri)
                state.parent_id = _find_pipeline(client, state.experiment_id, run.id)
            if state.parent_id is not None:
                _terminate(client, state.parent_id, status, ended_ms, lost=state.lost)
        except Exception as exc:  # noqa: BLE001 - tracking never fails a pipeline
            record = {
                "uri": public_uri(state.uri),
                "experiment": experiment_name(config),
                "pipeline_run": run.id,
                "run_id": state.parent_id,
                "status": status,
                "ended_ms": ended_ms,
                "lost": state.lost,
                "why": short_reason(exc),
            }
            with _unended_records(_unended_path(config)) as records:
                records.append(record)
            if state.failed:  # the warning was given when tracking gave up
                log.info("the pipeline's MLflow run is ended by the next pipeline run of this workspace")
            else:
                _give_up(state, exc, "the pipeline's run is ended by the next pipeline run of this workspace")
            return False
    return True


def _terminate(
    client: Any, run_id: str, status: str, ended_ms: int, *, lost: str | None, late: str | None = None
) -> None:
    """End a pipeline's run: FAILED if steps went unlogged (an incomplete record), else `status`."""
    tags = {}
    if lost:
        tags["lmforge.tracking_incomplete"] = f"MLflow was unreachable ({lost}): steps after that are not logged"
    if late:
        tags["lmforge.ended_late"] = late
    if tags:
        for key, value in {**tags, "lmforge.pipeline_status": status}.items():
            client.set_tag(run_id, key, value)
    client.set_terminated(run_id, "FAILED" if lost and status == "FINISHED" else status, end_time=ended_ms)


def unended(config: PipelineBase) -> list[dict[str, Any]]:
    """Pipeline runs at the config's tracking server that ended while it did not answer (see the module doc)."""
    path, uri = _unended_path(config), public_uri(tracking_uri(config))
    if not path.exists():
        return []
    with _unended_records(path) as records:
        return [dict(r) for r in records if r["uri"] == uri]


def _end_unended(config: PipelineBase) -> None:
    """End the recorded runs at the config's server, if it answers; the others stay recorded."""
    path, uri = _unended_path(config), tracking_uri(config)
    if not path.exists():
        return
    with _lock, _unended_records(path) as records:
        mine = [r for r in records if r["uri"] == public_uri(uri)]
        if not mine:
            return
        try:
            client = _client(uri)
            for record in mine:
                _end_recorded(client, record, path)
                records.remove(record)
        except Exception as exc:  # noqa: BLE001 - tried again by the next pipeline run
            log.info(
                "%d earlier pipeline run(s) stay RUNNING in MLflow at %s until it answers (%s)",
                len(mine),
                public_uri(uri),
                short_reason(exc),
            )


def _end_recorded(client: Any, record: dict[str, Any], path: Path) -> None:
    from mlflow.exceptions import MlflowException

    run_id = record["run_id"]
    if run_id is None:  # made by a stage deployment's process: found by its pipeline run
        experiment = client.get_experiment_by_name(record["experiment"])
        run_id = experiment and _find_pipeline(client, str(experiment.experiment_id), record["pipeline_run"])
    if not run_id:
        return  # never made: nothing to end
    try:
        if client.get_run(run_id).info.status != "RUNNING":
            return  # ended meanwhile, by whoever: its status stands
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # deleted from the store
            return
        raise
    late = f"the server did not answer when the pipeline ended ({record['why']}); ended from {path} later"
    _terminate(client, run_id, record["status"], record["ended_ms"], lost=record["lost"], late=late)


def _unended_path(config: PipelineBase) -> Path:
    return local_workspace(config).resolve() / ".tracking" / "mlflow-unended.json"


@contextlib.contextmanager
def _unended_records(path: Path) -> Iterator[list[dict[str, Any]]]:
    """The record of runs to end, read and written back under a lock: pipeline runs of one workspace
    may end at the same time."""
    import fcntl

    from lmforge.hashing import atomic_write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            records = list(json.loads(path.read_text()))
        except (FileNotFoundError, ValueError):
            records = []
        before = list(records)
        yield records
        if records != before:
            atomic_write_json(path, records)


def flow_run_url(ui_url: str | None, flow_run_id: str | None) -> str | None:
    if not ui_url or not flow_run_id:
        return None
    return f"{ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"


def _code_tags(version: dict[str, Any]) -> dict[str, str]:
    tags = {"lmforge.version": str(version.get("lmforge", ""))}
    if version.get("git"):
        tags["mlflow.source.git.commit"] = str(version["git"])
        tags["lmforge.code_dirty"] = str(bool(version.get("dirty"))).lower()
    return tags


def _log_step(client: Any, config: PipelineBase, run: PipelineRun, state: _State, manifest: dict[str, Any]) -> str:
    from mlflow.entities import Metric, Param, RunTag

    out = Path(manifest["dir"])
    timings = manifest.get("timings", {})
    started_ms = int(1000 * timings.get("started_at", time.time()))
    finished_ms = int(1000 * timings.get("finished_at", time.time()))
    created = client.create_run(
        state.experiment_id,
        start_time=started_ms,
        tags={"mlflow.parentRunId": state.parent_id},
        run_name=manifest["step"],
    )
    run_id = str(created.info.run_id)

    tags = step_tags(config, run, manifest)
    params = step_params(manifest)
    series = read_series(out / SERIES_FILE, finished_ms)
    names = {key for key, *_ in series}
    metrics = [
        (name if name not in names else f"summary/{name}", value, finished_ms, 0)
        for name, value in _summary_metrics(manifest).items()
    ]
    metrics += [(name, value, finished_ms, 0) for name, value in card_metrics(out).items()]
    for chunk in _chunks([RunTag(k, v) for k, v in tags.items()], 100):
        client.log_batch(run_id, tags=chunk)
    for chunk in _chunks([Param(k, v) for k, v in params.items()], 100):
        client.log_batch(run_id, params=chunk)
    for chunk in _chunks([Metric(k, v, ms, step) for k, v, ms, step in [*series, *metrics]], 1000):
        client.log_batch(run_id, metrics=chunk)
    _log_artifacts(client, run_id, manifest)
    client.set_terminated(run_id, "FINISHED", end_time=finished_ms)
    return run_id


def _log_artifacts(client: Any, run_id: str, manifest: dict[str, Any]) -> None:
    out = Path(manifest["dir"])
    for name in CARD_FILES:
        path = out / name
        if path.is_file() and path.stat().st_size <= MAX_ARTIFACT_BYTES:
            client.log_artifact(run_id, str(path))
    from lmforge.curves import panels as step_panels
    from lmforge.curves import render_curves

    panels = step_panels(manifest["step"])
    if not panels or not (out / SERIES_FILE).is_file():
        return
    with tempfile.TemporaryDirectory(prefix="lmforge-mlflow-") as tmp:
        png = Path(tmp) / f"{manifest['step'].replace('/', '-')}-curves.png"
        try:
            drawn = render_curves(out / SERIES_FILE, panels, f"{manifest['step']} @ {manifest['key'][:8]}", png)
        except Exception as exc:  # noqa: BLE001 - a picture is never a reason to lose the run
            log.warning("could not render the curves of %s for MLflow: %s", manifest["step"], exc)
            return
        if drawn is not None:
            client.log_artifact(run_id, str(drawn), "curves")


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# -- what a step's output says (pure functions of its files) --------------------------------------


def step_tags(config: PipelineBase, run: PipelineRun, manifest: dict[str, Any]) -> dict[str, str]:
    from lmforge.engine.codeprint import code_version

    made_by = manifest.get("made_by") or {}
    inputs = manifest.get("inputs") or {}
    tags = {
        "lmforge.kind": "step",
        "lmforge.pipeline_run": run.id,
        "lmforge.preset": config.name,
        "lmforge.engine.stage": str(manifest.get("stage", "")),
        "lmforge.step": str(manifest["step"]),
        "lmforge.step_key": str(manifest["key"]),
        "lmforge.lineage_key": lineage_key(config, manifest),
        "lmforge.digest": str(manifest.get("digest", "")),
        "lmforge.output": str(manifest["dir"]),
        "lmforge.inputs": ", ".join(f"{name}@{m.get('key', '?')}" for name, m in inputs.items()) or "raw inputs",
        "lmforge.host": str(made_by.get("host", "")),
        **_code_tags(manifest.get("code_version") or code_version()),
    }
    if manifest.get("description"):
        tags["mlflow.note.content"] = str(manifest["description"])
    extra = manifest.get("extra") or {}
    verdict = extra.get("decision") or extra.get("verdict")
    if isinstance(verdict, str):
        tags["lmforge.verdict"] = verdict
    if made_by.get("flow_run_id"):
        tags["prefect.flow_run_id"] = str(made_by["flow_run_id"])
        url = flow_run_url(run.ui_url, made_by["flow_run_id"])
        if url:
            tags["prefect.flow_run_url"] = url
        if made_by.get("flow_run_name"):
            tags["prefect.flow_run_name"] = str(made_by["flow_run_name"])
        if made_by.get("work_pool"):
            tags["prefect.work_pool"] = str(made_by["work_pool"])
    if made_by.get("slurm_job_id"):
        tags["slurm.job_id"] = str(made_by["slurm_job_id"])
    return {k: v[:8000] for k, v in tags.items() if v}


def step_params(manifest: dict[str, Any]) -> dict[str, str]:
    """The step's identity fields, flattened; secrets redacted."""
    params: dict[str, str] = {}
    for path, value in _flatten(manifest.get("params") or {}):
        if any(_SECRET_NAME.match(part) for part in path.split(".")) or (
            isinstance(value, str) and _SECRET_VALUE.match(value)
        ):
            text = REDACTED
        elif isinstance(value, str):
            text = value
        else:
            text = json.dumps(value, sort_keys=True)
        params[metric_name(path)] = text[:6000]
    return params


def lineage_key(config: PipelineBase, manifest: dict[str, Any]) -> str:
    """The key of the model the step makes; else of the model(s) it reads, one or two steps up."""
    if _makes_model(manifest):
        return str(manifest["key"])
    frontier, found = [manifest], set()
    for _ in range(2):
        upstream = [m for m in (_input_manifest(config, name, i) for f in frontier for name, i in _inputs(f)) if m]
        found = {str(m["key"]) for m in upstream if _makes_model(m)}
        if found:
            break
        frontier = upstream
    return ",".join(sorted(found)) or str(manifest["key"])


def _inputs(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return list((manifest.get("inputs") or {}).items())


def _makes_model(manifest: dict[str, Any]) -> bool:
    return any(str(p).split(":", 1)[0] in MODEL_KINDS for p in manifest.get("products") or {})


def _input_manifest(config: PipelineBase, name: str, reference: dict[str, Any]) -> dict[str, Any] | None:
    """An input's manifest, found in this workspace by its step and key (<workspace>/<stage>/<step>/<key>)."""
    for directory in (local_workspace(config) / name / str(reference.get("key")), Path(str(reference.get("dir")))):
        try:
            return dict(json.loads((directory / "manifest.json").read_text()))
        except (OSError, ValueError):
            continue
    return None


def read_series(path: Path, default_ms: int) -> list[tuple[str, float, int, int]]:
    """(metric, value, timestamp ms, step) of every number in a `metrics.jsonl`; none when it is absent."""
    if not path.is_file():
        return []
    from lmforge.jsonl import read_jsonl

    points: dict[str, list[tuple[str, float, int, int]]] = {}
    try:
        rows = list(read_jsonl(path))
    except ValueError as exc:
        log.warning("%s: not logged to MLflow (%s)", path, exc)
        return []
    for index, row in enumerate(rows):
        step = int(row["step"]) if _number(row.get("step")) else index
        when = next((row[k] for k in _SERIES_META[1:] if _number(row.get(k))), None)
        ms = int(1000 * when) if when is not None else default_ms
        for key, value in row.items():
            if key not in _SERIES_META and _number(value):
                name = metric_name(key)
                points.setdefault(name, []).append((name, float(value), ms, step))
    series: list[tuple[str, float, int, int]] = []
    for values in points.values():
        if len(values) > MAX_SERIES_POINTS:
            stride = math.ceil(len(values) / MAX_SERIES_POINTS)
            values = values[::stride] + ([values[-1]] if (len(values) - 1) % stride else [])
        series += values
    return series


def _summary_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """The manifest's final metrics, and its counts as `counts/<name>`."""
    metrics = numeric_metrics(manifest.get("metrics") or {})
    metrics.update(numeric_metrics(manifest.get("counts") or {}, "counts"))
    return metrics


def numeric_metrics(data: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number in nested `data`, by dotted path; `x_ci: [low, high]` as `x_ci_low` and `x_ci_high`."""
    out: dict[str, float] = {}
    for path, value in _flatten(data):
        name = f"{prefix}/{path}" if prefix else path
        if isinstance(value, list) and path.endswith("_ci") and len(value) == 2 and all(map(_number, value)):
            out[metric_name(name + "_low")], out[metric_name(name + "_high")] = float(value[0]), float(value[1])
        elif _number(value):
            out[metric_name(name)] = float(value)
    return out


def card_metrics(out: Path) -> dict[str, float]:
    """The evaluation card's results with their intervals, and the quantization gate's deltas."""
    metrics: dict[str, float] = {}
    report = _read_json(out / "report.json")
    for row in report.get("results", []) if isinstance(report.get("results"), list) else []:
        base = "/".join(str(row[k]) for k in ("model", "backend", "task", "metric") if row.get(k) is not None)
        _put(metrics, base, row.get("value"))
        for field, suffix in (
            ("ci_low", "_ci_low"),
            ("ci_high", "_ci_high"),
            ("clean_value", "_clean"),
            ("stderr", "_stderr"),
        ):
            _put(metrics, base + suffix, row.get(field))
    for row in report.get("deltas", []) if isinstance(report.get("deltas"), list) else []:
        base = f"delta/{row.get('from')}-{row.get('to')}/{row.get('backend')}/{row.get('task')}/{row.get('metric')}"
        _put(metrics, base, row.get("delta"))
        _put(metrics, base + "_ci_low", row.get("low"))
        _put(metrics, base + "_ci_high", row.get("high"))
    verdict = _read_json(out / "verdict.json")
    schemes = verdict.get("schemes")
    for scheme, result in schemes.items() if isinstance(schemes, dict) else []:
        if not isinstance(result, dict):
            continue
        for field in ("bytes", "bits_per_parameter", "compression_ratio"):
            _put(metrics, f"{scheme}/{field}", result.get(field))
        for row in result.get("comparisons") or []:
            base = f"{scheme}/{row.get('task')}/{row.get('metric')}"
            _put(metrics, base + "_delta", row.get("delta"))
            _put(metrics, base + "_delta_ci_low", row.get("ci_low"))
            _put(metrics, base + "_delta_ci_high", row.get("ci_high"))
            _put(metrics, base + "_quantized", row.get("quantized"))
            _put(metrics, base + "_unquantized", row.get("unquantized"))
    return metrics


def _put(metrics: dict[str, float], name: str, value: Any) -> None:
    if _number(value):
        metrics[metric_name(name)] = float(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def metric_name(key: str) -> str:
    """`key` as MLflow accepts it: letters, digits, _ - . / : and spaces, no empty or dot path segment."""
    parts = [_BAD_NAME_CHARS.sub("_", part.replace("@", "_at_")) for part in key.split("/")]
    parts = [("_" if part in (".", "..") else part) for part in parts if part]
    return "/".join(parts)[:250] or "_"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and (value or not prefix):
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value

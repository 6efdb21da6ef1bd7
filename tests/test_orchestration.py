"""Orchestration: deployments on two process work pools with real workers, dispatch from the pipeline,
curation units on a Dask cluster, progress artifacts that move, SLURM scripts, work-pool job templates."""

from __future__ import annotations

import contextvars
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import SMALL_CURATE, SMALL_PRETRAIN

REPO = Path(__file__).resolve().parent.parent


# -- SLURM --------------------------------------------------------------------------------------------


def test_slurm_script_is_valid_bash_and_builds_the_hostfile_from_the_nodelist(tmp_path: Path) -> None:
    render = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "slurm",
            "render",
            "pretrain",
            "-c",
            "gpu-multinode",
            "--set",
            "cluster.nodes=4",
            "--set",
            "cluster.gpus_per_node=8",
            "--set",
            "cluster.partition=gpu",
            "--workspace",
            str(tmp_path / "ws"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert render.returncode == 0, render.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(render.stdout)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:TERM@180",
    ):
        assert line in render.stdout
    exec_line = next(line for line in render.stdout.splitlines() if line.startswith("exec "))
    assert "stage pretrain" in exec_line and "pretrain.distributed.node_launcher=slurm" in exec_line
    assert 'pretrain.distributed.num_nodes="$SLURM_JOB_NUM_NODES"' in exec_line
    # run the script's hostfile logic against a faked allocation and a stub scontrol
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text(
        '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] || exit 2\n'
        'case "$3" in "gpu[01-03],big7") printf "gpu01\\ngpu02\\ngpu03\\nbig7\\n" ;; *) exit 3 ;; esac\n'
    )
    (stub / "scontrol").chmod(0o755)
    function = render.stdout[render.stdout.index("lmforge_hostfile() {") :]
    function = function[: function.index("\n}\n") + 3]
    ran = subprocess.run(
        ["bash", "-c", function + "lmforge_hostfile 8"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[01-03],big7"},
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "gpu01 slots=8\ngpu02 slots=8\ngpu03 slots=8\nbig7 slots=8\n"


def test_slurm_refuses_several_nodes_for_a_single_node_stage() -> None:
    from lmforge.config import load_config
    from lmforge.errors import ConfigError
    from lmforge.processes.slurm import render

    config = load_config("tiny-cpu", ["cluster.nodes=2"], "/tmp/lmforge-slurm-test")
    with pytest.raises(ConfigError, match="curate runs on one node"):
        render(config, "curate", "tiny-cpu", [], None)
    single = render(load_config("tiny-cpu", [], "/tmp/lmforge-slurm-test"), "evaluate", "tiny-cpu", [], None)
    assert "lmforge_hostfile 1" not in single and "stage evaluate" in single


# -- work pools and deployments as data ----------------------------------------------------------------


@pytest.mark.parametrize("worker_type", ["process", "docker", "kubernetes"])
def test_gpu_pool_job_templates_render_with_their_defaults(worker_type: str) -> None:
    from prefect.utilities.templating import apply_values

    from flows.deployments import base_job_template

    template = base_job_template(worker_type)
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    rendered = json.dumps(apply_values(template["job_configuration"], defaults))
    assert "{{" not in rendered
    if worker_type == "kubernetes":
        container = apply_values(template["job_configuration"], defaults)["job_manifest"]["spec"]["template"]["spec"]
        assert container["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["nodeSelector"] and container["volumes"][0]["persistentVolumeClaim"]["claimName"]
    if worker_type == "docker":
        assert defaults["container_create_kwargs"]["device_requests"][0]["capabilities"] == [["gpu"]]


def test_prefect_yaml_is_what_lmforge_deploy_applies() -> None:
    from flows.deployments import deployment_specs, prefect_yaml

    specs = deployment_specs("tiny-cpu", "tiny-cpu", [], None)
    assert (REPO / "prefect.yaml").read_text() == prefect_yaml(specs)
    pools = {s["flow"]: s["work_pool"] for s in specs}
    assert pools["lmforge-pipeline"] == pools["lmforge-curate"] == "lmforge-cpu"
    assert {pools[f"lmforge-{s}"] for s in ("pretrain", "align", "evaluate", "quantize", "serve")} == {"lmforge-gpu"}


# -- real workers on two pools --------------------------------------------------------------------------


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _start_worker(pool: str, log: Path, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        **(env_extra or {}),
        "PREFECT_API_URL": _api_url(),
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool, "--name", f"test-{pool}"],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )


def _stop(*processes: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM every worker's process group at once, then SIGKILL what is left after `grace_s` (a worker
    with no run in flight has nothing to hand back; waiting for each in turn cost a minute per module)."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.time() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _manifest_times(workspace: Path) -> dict[str, float]:
    return {str(p): json.loads(p.read_text())["timings"]["finished_at"] for p in workspace.glob("*/*/*/manifest.json")}


def _child_runs(parent_id) -> dict[str, object]:  # type: ignore[no-untyped-def]
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id]))
        )
        flows = {f.id: f.name for f in client.read_flows()}
    return {flows[r.flow_id]: r for r in runs}


# the server's sweep for expired leases (15 s by default): a killed stage's GPU slot (its lease is
# 60 s, flows/stage.py, the least Prefect's server takes) comes back within about 63 s instead of 75
FAST_LEASES = {"PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "3"}


@pytest.fixture(scope="module")
def two_pools(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real Prefect server (`lmforge prefect start`: its services expire the concurrency leases of
    killed runs, which the test harness's ephemeral server does not), and lmforge-cpu and
    lmforge-gpu (a process pool standing in for GPUs), each with a real worker; one workspace for
    the module's tests, as a team's shared storage would be."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import apply_deployments, deployment_specs, ensure_gpu_limit, ensure_pools
    from lmforge import server
    from lmforge.processes.launch import free_port

    tmp_path = tmp_path_factory.mktemp("pools")
    workspace = tmp_path / "ws"
    overrides = [
        *SMALL_CURATE,
        *SMALL_PRETRAIN,
        "runtime.dispatch=deployments",
        "stages=[curate, pretrain]",
        "runtime.deployment=orchestration-test",
    ]
    saved = {k: os.environ.get(k) for k in (*FAST_LEASES, "LMFORGE_HOME")}
    os.environ.update({**FAST_LEASES, "LMFORGE_HOME": str(tmp_path / "home")})
    url = server.start("127.0.0.1", free_port())
    workers: list[subprocess.Popen] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            ensure_pools("process")
            ensure_gpu_limit(1)
            apply_deployments(deployment_specs("orchestration-test", "tiny-cpu", overrides, str(workspace)))
            workers = [_start_worker(pool, tmp_path / f"{pool}.log") for pool in ("lmforge-cpu", "lmforge-gpu")]
            yield workspace, overrides, tmp_path
    finally:
        _stop(*workers)
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.slow
def test_pipeline_deployment_dispatches_each_stage_to_its_pool_and_reruns_from_cache(two_pools) -> None:  # type: ignore[no-untyped-def]
    from prefect.deployments import run_deployment

    workspace, overrides, logs = two_pools
    run = run_deployment("lmforge-pipeline/orchestration-test", timeout=900)
    assert run.state.is_completed(), (run.state, (logs / "lmforge-cpu.log").read_text()[-3000:])
    children = _child_runs(run.id)
    assert children["lmforge-curate"].work_pool_name == "lmforge-cpu"
    assert children["lmforge-pretrain"].work_pool_name == "lmforge-gpu"
    train = json.loads(next(workspace.glob("pretrain/train/*/manifest.json")).read_text())
    assert train["made_by"]["work_pool"] == "lmforge-gpu" and train["made_by"]["flow_run_id"] == str(
        children["lmforge-pretrain"].id
    )
    before = _manifest_times(workspace)
    again = run_deployment("lmforge-pipeline/orchestration-test", timeout=600)
    assert again.state.is_completed() and _manifest_times(workspace) == before  # all cache hits
    alone = run_deployment("lmforge-pretrain/orchestration-test", timeout=600)  # a stage deployment on its own
    assert alone.state.is_completed() and alone.work_pool_name == "lmforge-gpu"
    assert _manifest_times(workspace) == before
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        lineage = client.read_artifacts(artifact_filter=None)
    latest = [a for a in lineage if a.key == "pipeline-lineage"][-1]
    assert "lmforge-gpu" in str(latest.data) and children["lmforge-pretrain"].name in str(latest.data)


@pytest.mark.slow
def test_a_failing_child_stage_fails_the_pipeline_naming_the_child_run(two_pools) -> None:  # type: ignore[no-untyped-def]
    from prefect.deployments import run_deployment

    _, overrides, _ = two_pools
    run = run_deployment(
        "lmforge-pipeline/orchestration-test",
        timeout=600,
        parameters={"overrides": [*overrides, "curate.length.min_chars=400000"]},
    )
    assert run.state.is_failed(), run.state
    children = _child_runs(run.id)
    assert "lmforge-curate" in children, (run.state.message, children)
    child = children["lmforge-curate"]
    message = run.state.message or ""
    assert f"'{child.name}' ({child.id})" in message and "selection kept no documents" in message, message


@pytest.mark.slow
def test_a_killed_stage_process_is_dispatched_again_and_resumes(two_pools) -> None:  # type: ignore[no-untyped-def]
    from prefect.deployments import run_deployment

    workspace, overrides, _ = two_pools
    killed = threading.Event()

    def kill_the_training_flow_run() -> None:  # SIGKILL the GPU worker's flow-run process once training has progress
        checked: dict[str, bool] = {}
        while not killed.is_set():
            if _has_checkpoint_of_a_200_step_run(workspace):
                for proc in psutil.process_iter():
                    try:
                        run_id = proc.environ().get("PREFECT__FLOW_RUN_ID")
                    except psutil.Error:
                        continue
                    if run_id and checked.setdefault(run_id, _is_pretrain(run_id)):
                        proc.send_signal(signal.SIGKILL)
                        killed.set()
                        return
            time.sleep(0.2)

    # the thread needs this context: the API URL is a context setting here
    killer = threading.Thread(target=contextvars.copy_context().run, args=(kill_the_training_flow_run,), daemon=True)
    killer.start()
    run = run_deployment(
        "lmforge-pipeline/orchestration-test",
        timeout=900,
        parameters={"overrides": [*overrides, "pretrain.max_steps=200"]},
    )
    killed.set()
    assert run.state.is_completed(), run.state.message
    manifest = json.loads(
        next(
            p
            for p in workspace.glob("pretrain/train/*/manifest.json")
            if json.loads(p.read_text())["counts"]["steps"] == 200
        ).read_text()
    )
    assert manifest["counts"]["attempts"] >= 2  # the second dispatch resumed from a checkpoint
    assert "resumed from step-" in (Path(manifest["dir"]) / "logs" / "rank-0.log").read_text()


def _has_checkpoint_of_a_200_step_run(workspace: Path) -> bool:
    for spec in workspace.glob("pretrain/train/*/run_spec.json"):
        try:
            steps = json.loads(spec.read_text())["config"]["max_steps"]
        except (json.JSONDecodeError, KeyError):
            continue
        if steps == 200 and list(spec.parent.glob("checkpoints/step-0000002*")):
            return True
    return False


def _is_pretrain(flow_run_id: str) -> bool:
    """Whether the run is this server's pretraining stage (a flow run of another test's server, on
    another pytest-xdist worker, is not found here and is not touched)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            return False
        return client.read_flow(run.flow_id).name == "lmforge-pretrain"


# -- Dask -----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_curation_on_a_local_dask_cluster_is_byte_identical(
    curated: tuple[Path, dict], tmp_path: Path, prefect_server
) -> None:
    from flows.pipeline import pipeline
    from lmforge.engine.store import StageStore
    from tasks.steps import close_dask_runners

    workspace, reference = curated
    try:
        result = pipeline(
            preset="tiny-cpu",
            overrides=[*SMALL_CURATE, "runtime.task_runner=dask", "runtime.workers=2"],
            workspace=str(tmp_path / "dask"),
            stages=["curate"],
        )
    finally:  # the cluster lives as long as the process; stopped at exit, pytest's streams are closed by then
        close_dask_runners()
    dask = result["manifests"]
    assert {n: m["key"] for n, m in dask.items()} == {n: m["key"] for n, m in reference.items()}
    assert {n: m["digest"] for n, m in dask.items()} == {n: m["digest"] for n, m in reference.items()}
    kept = sorted((Path(dask["curate/select"]["dir"]) / "kept").glob("*.parquet"))
    assert kept and all(
        p.read_bytes() == (Path(reference["curate/select"]["dir"]) / "kept" / p.name).read_bytes() for p in kept
    )
    assert StageStore(tmp_path / "dask").check("curate/select", dask["curate/select"]["key"])[0] is not None


# -- progress ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_pretraining_progress_artifact_advances_during_a_run(
    curated: tuple[Path, dict], tmp_path: Path, prefect_server
) -> None:
    import shutil

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    from flows.pipeline import pipeline

    workspace = tmp_path / "ws"
    shutil.copytree(curated[0], workspace)
    seen: list[float] = []
    done = threading.Event()
    import datetime

    started = datetime.datetime.now(datetime.UTC)

    def read() -> None:
        with get_client(sync_client=True) as client:  # the newest progress artifact of the key: this run's
            found = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["progress-pretrain-train"])),
                sort=ArtifactSort.CREATED_DESC,
                limit=1,
            )
        values = [float(a.data) for a in found if a.type == "progress" and a.created >= started]
        if values and (not seen or values[0] != seen[-1]):
            seen.append(values[0])

    def poll() -> None:
        while not done.is_set():
            try:
                read()
            except Exception as exc:  # noqa: BLE001 - a busy server: read again next second, never end the watch
                errors.append(repr(exc))
            time.sleep(1)

    errors: list[str] = []
    # the watcher asks the same Prefect API as the pipeline: a new thread starts with an empty context, and the
    # API of this test (the session's, or a module fixture's) lives in context variables
    context = contextvars.copy_context()
    watcher = threading.Thread(target=context.run, args=(poll,), daemon=True)
    watcher.start()
    pipeline(
        preset="tiny-cpu",
        overrides=[*SMALL_CURATE, *SMALL_PRETRAIN, "pretrain.max_steps=240"],
        workspace=str(workspace),
        stages=["pretrain"],
    )
    done.set()
    watcher.join()
    read()  # the finished value, after the last poll
    moving = [v for v in seen if v < 100]
    assert len(moving) >= 2 and moving == sorted(moving) and seen[-1] == 100.0, (seen, errors[-3:])


# -- pictures ---------------------------------------------------------------------------------------------


def test_lineage_graph_and_training_curves_render_as_images(curated: tuple[Path, dict], tmp_path: Path) -> None:
    import matplotlib.image

    from lmforge.curves import panels, render_curves
    from tasks.lineage_graph import layout, render_lineage

    _, manifests = curated
    status = {name: "cached" for name in manifests}
    png = render_lineage(manifests, status, {n: "run test, host h" for n in manifests}, tmp_path / "lineage.png")
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 600 and height > 300
    columns = layout(manifests)
    assert columns.box("curate/ingest")[0] == columns.box("curate/pack")[0]  # one column per stage
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps(
                {
                    "step": s,
                    "loss": 7 - s / 10,
                    "grad_norm": 1.0,
                    "mfu": 0.5,
                    "tokens_per_s": 100,
                    **({"val_loss": 6.5 - s / 10} if s % 5 == 0 else {}),
                }
            )
            + "\n"
            for s in range(1, 21)
        )
    )
    curves = render_curves(metrics, panels("pretrain/train"), "pretrain/train", tmp_path / "curves.png")
    assert (
        curves is not None
        and matplotlib.image.imread(curves).shape[1] > 4 * matplotlib.image.imread(curves).shape[0] / 2
    )


def test_progress_is_read_off_the_step_output(tmp_path: Path) -> None:
    from training.metrics import last_logged_step

    metrics = tmp_path / "metrics.jsonl"
    assert last_logged_step(metrics) == 0
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0, "pad": "x" * 300}) + "\n" for s in range(1, 60)))
    with open(metrics, "a") as handle:
        handle.write('{"step": 60, "lo')  # a line being written
    assert last_logged_step(metrics) == 59

"""One flow per registered stage, made by one factory, and the steps of a stage as Prefect tasks.

Every stage flow has the same shape and plain, typed parameters (preset, overrides,
workspace, upstream manifests), so each one is also a deployment (`lmforge-<stage>/<preset>`):
load the config, run the flows of the stages it needs first when their results were not
handed in, submit its active steps in dependency order (independent steps run concurrently),
publish the generic `<stage>-steps` / `<stage>-card` artifacts and the stage's own, and stop
whatever it launched when it is cancelled or crashes. A GPU stage holds slots of the `gpu`
global concurrency limit (created by `lmforge deployments`), so two GPU stages never share a node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prefect import Flow, flow

from flows.cancel import stop_launched, unwatch, watch_cancellation
from lmforge import tracking
from lmforge.engine.executor import graph, made_by
from lmforge.engine.registry import get_stage, stages
from lmforge.engine.stage import ArtifactSpec, Stage
from lmforge.engine.store import StageStore
from tasks.artifacts import publish, publish_stage
from tasks.logs import set_library_log_level
from tasks.progress import step_images
from tasks.steps import step_task

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

GPU_LIMIT = "gpu"


def run_stage_steps(
    stage: str, config: PipelineBase, manifests: dict[str, dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Submit the stage's active steps; upstream outputs of earlier stages come in `manifests`.

    Returns the manifests and, per step, "cached" (its output was found complete in the
    store) or "computed".
    """
    from prefect.utilities.annotations import opaque

    futures: dict[str, Any] = {}
    for step in graph().active(config, [stage]):
        if step.stage != stage:
            continue
        # opaque: Prefect resolves a future to its manifest but walks into no manifest or config (it
        # would visit every field of every upstream manifest, for each step)
        upstream = {name: opaque(futures.get(name, manifests.get(name))) for name in graph().upstream(step, config)}
        futures[step.name] = step_task(step.name, config).submit(step.name, opaque(config), upstream)
    results = {name: future.result() for name, future in futures.items()}
    status = {name: "cached" if futures[name].state.name == "Cached" else "computed" for name in results}
    store = StageStore.for_config(config)
    for name, manifest in results.items():
        store.record_use(name, manifest)  # what `lmforge explain` compares against next time
    return results, status


def upstream_stages(stage: str, config: PipelineBase) -> list[str]:
    """Other stages whose steps this stage's active steps need, in lifecycle order."""
    needed = {s.stage for s in graph().active(config, [stage])} - {stage}
    return [s.name for s in stages() if s.name in needed]


def _run_context() -> dict[str, Any]:
    """The flow run computing the steps, and where it runs: recorded in every manifest it writes."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None  # as the engine read it when the run began
    if run is None:
        return {"flow_run_id": None, "flow_run_name": None}
    return {
        "flow_run_id": str(run.id),
        "flow_run_name": run.name,
        "work_pool": run.work_pool_name,
        "deployment_id": str(run.deployment_id) if run.deployment_id else None,
    }


def tracking_run(config: PipelineBase) -> contextlib.AbstractContextManager[Any]:
    """Steps computed in this flow run log under the MLflow run of its root flow run (the pipeline's).

    The root flow run (the pipeline, or a stage run on its own) owns that MLflow run and ends it.
    Nothing is asked of the Prefect API when tracking is off; a failure to ask is no failure.
    """
    if not tracking.enabled(config):
        return contextlib.nullcontext()
    try:
        from prefect.runtime import flow_run
        from prefect.settings import PREFECT_UI_URL

        own, root = flow_run.get_id(), flow_run.get_root_flow_run_id()
        ui = PREFECT_UI_URL.value()
    except Exception as exc:  # noqa: BLE001 - the steps still log, under this process's run
        logging.getLogger("lmforge.tracking").debug("no Prefect flow run for tracking: %s", exc)
        return contextlib.nullcontext()
    if not root:
        return contextlib.nullcontext()
    return tracking.pipeline_run(config, str(root), orchestrated=True, owner=str(root) == str(own), ui_url=ui)


def with_tracking_links(specs: list[ArtifactSpec], links: dict[str, str]) -> list[ArtifactSpec]:
    """The stage's summary artifacts, linked to the MLflow runs of the stage's steps logged in this run:
    a markdown artifact ends in an `MLflow run:` line per step, any other names them in its description."""
    if not links:
        return specs
    lines = "\n".join(f"MLflow run ({step}): {link}" for step, link in links.items())
    runs = ", ".join(
        f"[{step}]({link})" if link.startswith("http") else f"{step}: {link}" for step, link in links.items()
    )
    return [
        dataclasses.replace(spec, data=f"{spec.data}\n\n{lines}\n")
        if spec.kind == "markdown"
        else dataclasses.replace(spec, description=f"{spec.description} (MLflow: {runs})")
        for spec in specs
    ]


@contextlib.contextmanager
def gpu_slots(stage: Stage) -> Iterator[None]:
    """Hold the GPUs a stage uses from the `gpu` global concurrency limit (when it exists)."""
    if stage.resources.pool != "gpu":
        yield
        return
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(GPU_LIMIT).limit
    except Exception:  # noqa: BLE001 - no limit configured (laptop, tests): nothing to hold
        yield
        return
    wanted = limit if stage.resources.gpus < 0 else min(max(stage.resources.gpus, 1), limit)
    # a short lease (renewed while held; Prefect's server takes 60 s at least): slots of a holder that
    # was killed come back within a minute, plus the server's sweep (its repossessor service)
    with concurrency(GPU_LIMIT, occupy=wanted, strict=False, lease_duration=60):
        yield


def execute_stage(
    stage: Stage, config: PipelineBase, manifests: dict[str, dict[str, Any]], params: dict[str, Any]
) -> dict[str, Any]:
    """The body of every stage flow."""
    watch_cancellation()
    try:
        with tracking_run(config):
            return _execute_stage(stage, config, manifests, params)
    finally:
        unwatch()


def _execute_stage(
    stage: Stage, config: PipelineBase, manifests: dict[str, dict[str, Any]], params: dict[str, Any]
) -> dict[str, Any]:
    manifests = dict(manifests)
    status: dict[str, str] = {}
    if not stage_inputs(stage.name, config) <= manifests.keys():  # e.g. a stage deployment run on its own
        missing = [
            name
            for name in upstream_stages(stage.name, config)
            if not any(m["stage"] == name for m in manifests.values())
        ]
        for name in missing:  # compute (or reuse) what it reads
            outcome = run_subflow(name, config, params, manifests)
            manifests.update(outcome["manifests"])
            status.update(outcome["status"])
    error: BaseException | None = None
    results: dict[str, dict[str, Any]] = {}
    links: dict[str, str] = {}
    try:
        with gpu_slots(stage), made_by(**_run_context()):
            results, own = run_stage_steps(stage.name, config, manifests)
        status.update(own)
        links = {name: link for name, m in results.items() if (link := tracking.step_link(m))}
        if stage.reconcile is not None:
            stage.reconcile(config, {**manifests, **results})
    except BaseException as exc:
        error = exc
        raise
    finally:
        if stage.artifacts is not None:
            specs = with_tracking_links(stage.artifacts({**manifests, **results}, status, error), links)
            for spec in [*specs, *step_images(stage.name, results)]:
                publish(spec)
    publish_stage(stage.name, results, status, links)
    return {"manifests": {**manifests, **results}, "status": status}


def stage_inputs(stage: str, config: PipelineBase) -> set[str]:
    """The steps of other stages that the stage's active steps read: all its flow needs handed in."""
    return {
        name
        for step in graph().active(config, [stage])
        if step.stage == stage
        for name in graph().upstream(step, config)
        if graph().get(name).stage != stage
    }


def run_subflow(
    name: str, config: PipelineBase, params: dict[str, Any], manifests: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Run stage `name`'s flow as a subflow of the flow run of this process.

    It is handed the manifests its steps read, not every manifest so far: they are the subflow's
    parameters, which Prefect encodes, sends and stores (~0.15 s a stage late in the lifecycle).
    It sends no heartbeats of its own: it runs in its parent's process, whose flow run heartbeats
    for it. (Prefect 3.7 joins a flow's heartbeat thread when the flow ends, and that thread
    sleeps in 1 s steps: half a second per stage, for nothing.)
    """
    from prefect.context import SettingsContext, get_settings_context

    inputs = {step: manifests[step] for step in sorted(stage_inputs(name, config)) if step in manifests}
    context = get_settings_context()
    settings = context.settings  # copied without validation: `temporary_settings` takes ~70 ms a call
    quiet = settings.model_copy(update={"flows": settings.flows.model_copy(update={"heartbeat_frequency": None})})
    with SettingsContext(profile=context.profile, settings=quiet):
        return stage_flow(name)(**params, manifests=inputs)


@functools.cache
def stage_flow(name: str) -> Flow:
    """The Prefect flow of one stage: `lmforge-<stage>`, e.g. `lmforge-pretrain`."""
    stage = get_stage(name)

    @flow(
        name=f"lmforge-{name}",
        flow_run_name=f"{name}-{{preset}}",
        log_prints=True,
        description=stage.description,
        on_cancellation=[stop_launched],
        on_crashed=[stop_launched],
    )
    def run(
        preset: str = "tiny-cpu",
        overrides: list[str] | None = None,
        workspace: str | None = None,
        manifests: dict[str, dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """Run the stage (and, when `manifests` does not hold them, the stages it reads from).

        preset: a preset name or YAML path; overrides: `KEY=VALUE` fields; workspace: where outputs
        live (shared storage when stages run on different machines); manifests: the upstream steps'
        manifests (paths and digests) when a pipeline run hands them in.
        """
        from lmforge.config import load_config

        config = load_config(preset, overrides or [], workspace)
        set_library_log_level(config.runtime.log_level)
        params = {"preset": preset, "overrides": overrides, "workspace": workspace}
        return execute_stage(stage, config, manifests or {}, params)

    return run

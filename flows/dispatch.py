"""Run a stage as its deployment, so it lands on its work pool's worker (`runtime.dispatch: deployments`).

The pipeline hands the child only plain parameters: the preset, the overrides, the workspace and
the upstream manifests (paths and digests, never data). `run_deployment` does not raise when
the child fails, so its final state is checked, and a failure becomes one line naming the
child run and its error. The child's results are not passed back through Prefect either: the
stage's outputs are content-addressed in the (shared) workspace, so the parent plans each step
of the stage again and finds them complete there -- exactly what the next pipeline run does.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from lmforge.engine.executor import graph, plan_step
from lmforge.engine.store import StageStore
from lmforge.errors import LmforgeError

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger("lmforge.dispatch")
CRASH_RETRIES = 2  # a child whose process or machine died is dispatched again this many times


class StageRunFailed(LmforgeError):
    """A stage's deployment run did not complete; the message names the child run."""


def slim(manifests: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Manifests without their per-file lists: what a child needs to key and find its inputs."""
    return {name: {k: v for k, v in m.items() if k != "files"} for name, m in manifests.items()}


def deployment_name(stage: str, config: PipelineBase) -> str:
    return f"lmforge-{stage}/{config.runtime.deployment or config.name}"


def collect(
    stage: str, config: PipelineBase, manifests: dict[str, dict[str, Any]], started: float, child: str
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The manifests of the stage's steps, found in the workspace after its child run."""
    store = StageStore.for_config(config)
    found: dict[str, dict[str, Any]] = {}
    status: dict[str, str] = {}
    for step in graph().active(config, [stage]):
        if step.stage != stage:
            continue
        plan = plan_step(step, config, store, {**manifests, **found})
        if plan.manifest is None:
            raise StageRunFailed(
                f"stage {stage}: child run {child} completed, but {step.name}'s output is not complete "
                f"in {config.workspace} ({plan.reason}); is the workspace on storage both machines share?"
            )
        found[step.name] = plan.manifest
        status[step.name] = "computed" if plan.manifest["timings"]["finished_at"] >= started else "cached"
        store.record_use(step.name, plan.manifest)
    return found, status


def run_stage_deployment(
    stage: str, config: PipelineBase, params: dict[str, Any], manifests: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Run the stage's deployment as a child of this flow run and wait for it; its manifests and status."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment

    name = deployment_name(stage, config)
    started = time.time()
    for attempt in range(1, CRASH_RETRIES + 2):
        log.info("dispatching %s to deployment %s%s", stage, name, f" (attempt {attempt})" if attempt > 1 else "")
        try:
            launched = run_deployment(
                name, parameters={**params, "manifests": slim(manifests)}, timeout=None, as_subflow=True
            )
        except Exception as exc:  # noqa: BLE001 - e.g. no such deployment: one line, with what to do
            raise StageRunFailed(
                f"stage {stage}: could not run deployment {name} ({type(exc).__name__}: {exc}); "
                "create it with `lmforge deployments`"
            ) from None
        # called from a sync flow, so Prefect ran it synchronously (not a coroutine)
        assert isinstance(launched, FlowRun), f"run_deployment returned {type(launched).__name__}, not a FlowRun"
        run = launched
        # a crash is the infrastructure's (the process or machine died): the stage resumes from what
        # it finished, so it is dispatched again; a failure is the stage's own and would repeat
        if run.state is None or not run.state.is_crashed():
            break
        log.warning(
            "stage %s: child run '%s' crashed (%s); dispatching it again, it resumes from its checkpoints",
            stage,
            run.name,
            (run.state.message or "").strip()[:200],
        )
    state = run.state
    child = f"'{run.name}' ({run.id})"
    if state is None or not state.is_completed():
        message = (state.message or "").strip().splitlines()[0] if state is not None and state.message else "no message"
        raise StageRunFailed(
            f"stage {stage}: child run {child} of {name} ended "
            f"{state.name if state is not None else 'without a state'}: {message}"
        )
    found, status = collect(stage, config, manifests, started, child)
    pool = run.work_pool_name or "?"
    log.info(
        "%s: child run %s on work pool %s: %d computed, %d reused",
        stage,
        child,
        pool,
        sum(s == "computed" for s in status.values()),
        sum(s == "cached" for s in status.values()),
    )
    return {
        "manifests": {**manifests, **found},
        "status": status,
        "run": {
            "stage": stage,
            "flow_run": run.name,
            "flow_run_id": str(run.id),
            "work_pool": pool,
            "deployment": name,
        },
    }

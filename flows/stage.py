"""One flow per registered stage, made by one factory, and the steps of a stage as Prefect tasks.

Every stage flow has the same shape: load the config from plain parameters (so it can be
a deployment), run the flows of the stages it needs first when their results were not
handed in, submit its active steps in dependency order (independent steps run
concurrently), publish the generic `<stage>-steps` / `<stage>-card` artifacts and the
stage's own, and stop whatever it launched when it is cancelled or crashes.
"""

from __future__ import annotations

import functools
from typing import Any

from prefect import Flow, flow

from flows.cancel import stop_launched, unwatch, watch_cancellation
from lmforge.executor import graph
from lmforge.registry import get_stage, stages
from lmforge.stage import Stage
from lmforge.store import StageStore
from tasks.artifacts import publish, publish_stage
from tasks.steps import step_task


def run_stage_steps(stage: str, config: Any, manifests: dict[str, dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Submit the stage's active steps; upstream outputs of earlier stages come in `manifests`.

    Returns the manifests and, per step, "cached" (its output was found complete in the
    store) or "computed".
    """
    futures: dict[str, Any] = {}
    for step in graph().active(config, config.stages):
        if step.stage != stage:
            continue
        upstream = {name: futures.get(name, manifests.get(name)) for name in graph().upstream(step, config)}
        futures[step.name] = step_task(step.name, config).submit(step.name, config, upstream)
    results = {name: future.result() for name, future in futures.items()}
    status = {name: "cached" if futures[name].state.name == "Cached" else "computed" for name in results}
    store = StageStore(config.workspace, config.runtime.verify)
    for name, manifest in results.items():
        store.record_use(name, manifest)  # what `lmforge explain` compares against next time
    return results, status


def upstream_stages(stage: str, config: Any) -> list[str]:
    """Other stages whose steps this stage's active steps need, in lifecycle order."""
    needed = {s.stage for s in graph().active(config, [stage])} - {stage}
    return [s.name for s in stages() if s.name in needed]


def execute_stage(stage: Stage, config: Any, manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The body of every stage flow."""
    watch_cancellation()
    try:
        manifests = dict(manifests)
        status: dict[str, str] = {}
        missing = [name for name in upstream_stages(stage.name, config)
                   if not any(m["stage"] == name for m in manifests.values())]
        for name in missing:  # e.g. a stage deployment run on its own: compute (or reuse) what it reads
            outcome = stage_flow(name)(config=config, manifests=manifests)
            manifests.update(outcome["manifests"])
            status.update(outcome["status"])
        error: BaseException | None = None
        results: dict[str, dict[str, Any]] = {}
        try:
            results, own = run_stage_steps(stage.name, config, manifests)
            status.update(own)
            if stage.reconcile is not None:
                stage.reconcile(config, {**manifests, **results})
        except BaseException as exc:
            error = exc
            raise
        finally:
            if stage.artifacts is not None:
                for spec in stage.artifacts({**manifests, **results}, status, error):
                    publish(spec)
        publish_stage(stage.name, results, status)
        return {"manifests": {**manifests, **results}, "status": status}
    finally:
        unwatch()


@functools.lru_cache(maxsize=None)
def stage_flow(name: str) -> Flow:
    """The Prefect flow of one stage: `lmforge-<stage>`, e.g. `lmforge-pretrain`."""
    stage = get_stage(name)

    @flow(name=f"lmforge-{name}", flow_run_name=f"{name}-{{config.name}}", log_prints=True,
          description=stage.description, on_cancellation=[stop_launched], on_crashed=[stop_launched])
    def run(config: Any, manifests: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        return execute_stage(stage, config, manifests or {})

    return run

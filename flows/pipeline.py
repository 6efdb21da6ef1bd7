"""The whole lifecycle of a model, top to bottom.

    raw text --curate-->   kept documents, tokenizer, packed tokens
             --pretrain--> checkpoints, a Hugging Face model
             --align-->    SFT and DPO models            (each stage that is registered,
             --evaluate--> benchmark results, gates        in the order its `after` gives)
             --quantize--> gated INT8 / 4-bit checkpoints
             --serve-->    the chosen model on an OpenAI-compatible endpoint

Every stage is a subflow (`lmforge-<stage>`) whose steps are cached on content addresses,
so rerunning the pipeline recomputes only what a change invalidated, and `lmforge explain`
says why. With `runtime.dispatch: deployments` each stage runs instead as its own deployment
on its work pool (curation on CPU workers, training and serving on GPU workers), with the same
keys and outputs. Parameters are plain values so the flow is a deployment too:
`prefect deployment run 'lmforge-pipeline/tiny-cpu' --param overrides='["pretrain.max_steps=50"]'`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from flows.cancel import stop_launched, unwatch, watch_cancellation
from flows.dispatch import run_stage_deployment
from flows.stage import run_subflow, tracking_run, upstream_stages
from lmforge import tracking
from lmforge.config import PipelineBase, load_config
from lmforge.engine.registry import stages as lifecycle
from tasks.artifacts import publish_lineage
from tasks.logs import set_library_log_level


def wanted_stages(config: PipelineBase) -> list[str]:
    """The configured stages and every stage they read from, in lifecycle order."""
    wanted = set(config.stages)
    for name in config.stages:
        wanted.update(upstream_stages(name, config))
    return [s.name for s in lifecycle() if s.name in wanted]


@flow(name="lmforge-pipeline", flow_run_name="{preset}", on_cancellation=[stop_launched], on_crashed=[stop_launched])
def pipeline(
    preset: str = "tiny-cpu",
    overrides: list[str] | None = None,
    workspace: str | None = None,
    stages: list[str] | None = None,
) -> dict[str, Any]:
    """Run `stages` (default: the config's `stages`) and whatever they need upstream.

    preset: a preset name or YAML path; overrides: `KEY=VALUE` fields (as `--set`); workspace:
    where outputs live; stages: which stages to run (their upstream stages come along).
    """
    config = load_config(preset, overrides or [], workspace)
    set_library_log_level(config.runtime.log_level)
    if stages:
        config.stages = stages
    # each stage's flow loads the config from these: it must see the same `stages` (with a base
    # model they decide whether pretrain and align are part of the lineage)
    stage_overrides = [*(overrides or []), *([f"stages=[{', '.join(stages)}]"] if stages else [])]
    params = {"preset": preset, "overrides": stage_overrides, "workspace": workspace}
    watch_cancellation()
    runs: dict[str, dict[str, Any]] = {}
    mlflow_run: str | None = None
    try:
        manifests: dict[str, dict[str, Any]] = {}
        status: dict[str, str] = {}
        with tracking_run(config) as tracked:  # one MLflow run for the whole pipeline run, when tracking is on
            for stage in wanted_stages(config):  # curate -> pretrain -> align -> evaluate -> quantize -> serve
                if config.runtime.dispatch == "deployments":  # on the stage's own work pool
                    outcome = run_stage_deployment(stage, config, params, manifests)
                    runs[stage] = outcome["run"]
                else:
                    outcome = run_subflow(stage, config, params, manifests)
                manifests.update(outcome["manifests"])
                status.update(outcome["status"])
            if tracked is not None:
                # stage deployments logged in their workers' processes: the MLflow run is found to end it
                tracked.others_logged = bool(runs) and "computed" in status.values()
        mlflow_run = tracking.pipeline_link(tracked) if tracked is not None else None
    finally:
        unwatch()
    publish_lineage(manifests, status, runs, mlflow_run)
    computed = sum(s == "computed" for s in status.values())
    get_run_logger().info("%d steps: %d cache hits, %d computed", len(status), len(status) - computed, computed)
    return {
        "workspace": config.workspace,
        "steps": {
            name: {"key": m["key"], "dir": m["dir"], "url": m.get("url"), "status": status[name], "counts": m["counts"]}
            for name, m in manifests.items()
        },
        "manifests": manifests,
    }

"""The pretraining stage flow: plan, launch DeepSpeed, verify checkpoints, export to HF format."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.stage import run_stage_steps
from lmforge.errors import TrainingDiverged
from tasks.artifacts import publish_anomalies, publish_pretrain, publish_stage


@flow(name="pretrain", flow_run_name="pretrain-{config.name}", log_prints=True)
def pretrain_flow(config: Any, manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    try:
        results, status = run_stage_steps("pretrain", config, manifests)
    except TrainingDiverged as exc:
        publish_anomalies(exc.anomalies, diverged=True)  # the report matters most when the run stopped
        raise
    publish_stage("pretrain", results, status)
    if "pretrain/train" in results:
        publish_pretrain(results["pretrain/train"])
    return {"manifests": results, "status": status}

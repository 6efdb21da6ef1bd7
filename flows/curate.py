"""The curation stage flow: demo/ingest -> attributes -> select -> tokenizer -> pack."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.stage import run_stage_steps
from tasks.artifacts import publish_curation, publish_stage


@flow(name="curate", flow_run_name="curate-{config.name}", log_prints=True)
def curate_flow(config: Any, manifests: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    results, status = run_stage_steps("curate", config, manifests or {})
    publish_stage("curate", results, status)
    publish_curation(results)
    return {"manifests": results, "status": status}

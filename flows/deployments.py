"""What `lmforge deployments` applies: work pools, the `gpu` concurrency limit, and one deployment per flow.

- Work pools: `lmforge-cpu` (process) for curation and the pipeline itself, `lmforge-gpu` for
  the stages whose registration asks for a GPU (pretrain, align, evaluate, quantize, serve).
  The GPU pool's base job template comes from `configs/work_pools/gpu-<type>.json` for the
  process, Docker (`--gpus`-style device requests) and Kubernetes (`nvidia.com/gpu` requests,
  node selector, the shared workspace volume) worker types. Created once; an existing pool is
  left as its owner configured it.
- A global concurrency limit `gpu` with one slot per GPU of a node: a GPU stage holds its GPUs
  (all of them for training), so two GPU stages never share a node.
- Deployments `lmforge-pipeline/<name>` and `lmforge-<stage>/<name>` (name: the preset), each
  with typed parameters (preset, overrides, workspace, manifests), code pulled from this
  checkout's directory (workers need the same path: shared storage, or the same clone).

`prefect.yaml` at the repository root is the same set for the tiny-cpu preset, written by
`lmforge deployments --write-prefect-yaml`; a test keeps the two in agreement.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.engine.registry import stages

REPO_ROOT = Path(__file__).resolve().parent.parent
POOLS = {"cpu": "lmforge-cpu", "gpu": "lmforge-gpu"}
TEMPLATES = REPO_ROOT / "configs" / "work_pools"
GPU_WORKER_TYPES = ("process", "docker", "kubernetes")
GPU_LIMIT = "gpu"


def pool_of(stage_name: str | None) -> str:
    """The work pool a flow belongs on (None: the pipeline, which only orchestrates)."""
    if stage_name is None:
        return POOLS["cpu"]
    stage = next(s for s in stages() if s.name == stage_name)
    return POOLS[stage.resources.pool]


def base_job_template(worker_type: str) -> dict[str, Any] | None:
    """The GPU pool's job template for a worker type (None: Prefect's default for `process` on the CPU pool)."""
    return json.loads((TEMPLATES / f"gpu-{worker_type}.json").read_text())


def deployment_specs(name: str, preset: str, overrides: list[str], workspace: str | None) -> list[dict[str, Any]]:
    """Every deployment as plain data: flow entrypoint, deployment name, pool, default parameters."""
    # a pipeline dispatches to lmforge-<stage>/<runtime.deployment or the preset's name>: name them the same
    wanted = [*overrides, f"runtime.deployment={name}"] if name != preset else list(overrides)

    def parameters() -> dict[str, Any]:
        return {"preset": preset, "overrides": list(wanted), "workspace": workspace}

    specs = [
        {
            "flow": "lmforge-pipeline",
            "entrypoint": "flows/entrypoints.py:pipeline",
            "name": name,
            "work_pool": pool_of(None),
            "parameters": parameters(),
            "description": "The whole lifecycle: curate -> pretrain -> align -> evaluate -> quantize -> serve.",
        }
    ]
    for stage in stages():
        specs.append(
            {
                "flow": f"lmforge-{stage.name}",
                "entrypoint": f"flows/entrypoints.py:{stage.name.replace('-', '_')}",
                "name": name,
                "work_pool": pool_of(stage.name),
                "parameters": parameters(),
                "description": stage.description,
            }
        )
    return specs


def ensure_pools(gpu_worker_type: str = "process") -> dict[str, str]:
    """Create the two work pools if they do not exist; returns {pool: 'created' | 'exists'}."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    outcome = {}
    with get_client(sync_client=True) as client:
        for pool, worker_type, template in (
            (POOLS["cpu"], "process", None),
            (POOLS["gpu"], gpu_worker_type, base_job_template(gpu_worker_type)),
        ):
            create = WorkPoolCreate(
                name=pool,
                type=worker_type,
                description=f"lmforge {pool.split('-')[1].upper()} stages",
                **({"base_job_template": template} if template else {}),
            )
            try:
                client.create_work_pool(work_pool=create)
                outcome[pool] = "created"
            except ObjectAlreadyExists:
                outcome[pool] = "exists"
    return outcome


def ensure_gpu_limit(slots: int) -> str:
    """The `gpu` global concurrency limit with `slots` slots (updated when it exists with another size)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            current = client.read_global_concurrency_limit_by_name(GPU_LIMIT)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=GPU_LIMIT, limit=slots))
            return "created"
        if current.limit != slots:
            client.update_global_concurrency_limit(GPU_LIMIT, GlobalConcurrencyLimitUpdate(limit=slots))
            return f"resized {current.limit} -> {slots}"
    return "exists"


def apply_deployments(specs: list[dict[str, Any]]) -> list[str]:
    """Create or update each deployment; returns their full names."""
    import prefect
    from prefect import Flow
    from prefect.deployments.runner import RunnerDeployment
    from prefect.runner.storage import LocalStorage

    # called outside any flow or event loop, so Prefect's dual sync/async methods run synchronously
    deployments: list[RunnerDeployment] = []
    for spec in specs:
        flow = Flow.from_source(source=LocalStorage(str(REPO_ROOT)), entrypoint=spec["entrypoint"])
        assert isinstance(flow, Flow), f"Flow.from_source returned {type(flow).__name__}, not a Flow"
        deployment = flow.to_deployment(
            name=spec["name"],
            work_pool_name=spec["work_pool"],
            parameters=spec["parameters"],
            description=spec["description"],
            tags=["lmforge", spec["work_pool"]],
        )
        assert isinstance(deployment, RunnerDeployment), f"to_deployment returned {type(deployment).__name__}"
        deployments.append(deployment)
    for pool in sorted({spec["work_pool"] for spec in specs}):  # prefect.deploy takes one pool per call
        prefect.deploy(
            *[d for d, spec in zip(deployments, specs) if spec["work_pool"] == pool],
            work_pool_name=pool,
            build=False,
            push=False,
            print_next_steps_message=False,
            ignore_warnings=True,
        )
    return [f"{spec['flow']}/{spec['name']}" for spec in specs]


def prefect_yaml(specs: list[dict[str, Any]]) -> str:
    """The same deployments as a `prefect.yaml` (`prefect deploy --all` applies it)."""
    import yaml

    document = {
        "name": "lmforge",
        "prefect-version": "3.7.7",
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $LMFORGE_HOME_DIR }}"}}],
        "deployments": [
            {
                "name": s["name"],
                "entrypoint": s["entrypoint"],
                "description": s["description"],
                "tags": ["lmforge", s["work_pool"]],
                "parameters": s["parameters"],
                "work_pool": {"name": s["work_pool"]},
            }
            for s in specs
        ],
    }
    header = (
        "# lmforge's deployments for the tiny-cpu preset (written by `lmforge deployments --write-prefect-yaml`).\n"
        "# `lmforge deployments` applies the same set for any preset; with the Prefect CLI:\n"
        "#   LMFORGE_HOME_DIR=$PWD prefect deploy --all\n"
        "# Workers: `prefect worker start --pool lmforge-cpu` and `--pool lmforge-gpu`, from lmforge's .venv.\n"
    )
    return header + yaml.safe_dump(document, sort_keys=False, width=120)

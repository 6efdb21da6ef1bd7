"""The orchestrator's commands, registered with the core CLI like a stage's own commands.

`pyproject.toml` registers `register` under the `lmforge.commands` entry points; the core CLI
(`lmforge.cli`) never imports this package. What it adds:

- the orchestrated run behind `lmforge run` / `lmforge stage` without `--local`: the pipeline
  flow on a Prefect API (the managed server when one runs, else a temporary one);
- `lmforge deployments`: the work pools, the `gpu` concurrency limit and the deployments (the
  pipeline and one per stage) on a Prefect server, or a `prefect.yaml`, or `--serve` for a laptop.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def register(commands: Any) -> None:
    """Add the orchestrator's commands to `commands` (see `lmforge.cli.Commands`)."""
    commands.set_orchestrator(run_orchestrated)
    deployments = commands.add_parser(
        "deployments",
        aliases=["deploy"],
        help="create the Prefect work pools and deployments (then `prefect deployment run ...`)",
    )
    deployments.add_argument("--name", help="deployment name (default: the preset name)")
    deployments.add_argument(
        "--serve",
        action="store_true",
        help="laptop mode: serve the pipeline deployment from this process (no work pools or workers)",
    )
    deployments.add_argument(
        "--gpu-worker-type",
        choices=["process", "docker", "kubernetes"],
        default="process",
        help="worker type of the lmforge-gpu pool when it is created (default: process)",
    )
    deployments.add_argument(
        "--gpus",
        type=int,
        help="slots of the `gpu` concurrency limit: GPUs per node (default: the GPUs visible here, at least 1)",
    )
    deployments.add_argument(
        "--write-prefect-yaml", metavar="PATH", help="write the deployments as a prefect.yaml and exit"
    )
    deployments.set_defaults(handler=cmd_deployments, needs_config=False)


def run_orchestrated(
    args: argparse.Namespace, config: Any, stages: list[str] | None, terminal: Callable[[], Any]
) -> tuple[dict[str, Any], str | None]:
    """Run the pipeline flow (or the named stages) on a Prefect API; returns its result and the API's URL
    when it is a server with a UI (None for a temporary one).

    With no server to record it (no managed server, no PREFECT_API_URL) and every step's output
    reusable as it is, there is nothing to orchestrate: a temporary server would start, record 37
    runs nobody can browse, and be thrown away, which is most of a cached run's time (about 15 s of
    20 on 2 cores). Then the steps are reused as `--local` reuses them, with the same lines, the same
    `lmforge explain` record and the same check of the served model, and a line says so.
    """
    from lmforge import server

    api_url = server.use_running_server()
    if api_url is None and config.runtime.dispatch != "deployments":
        from lmforge.console import terminal as local_terminal
        from lmforge.engine.executor import reuse_everything

        with local_terminal(args.verbose, level=config.runtime.log_level):
            manifests = reuse_everything(config, stages or config.stages)
        if manifests is not None:
            print(
                "every step was reused as it is: no Prefect run was needed (a temporary server would keep no "
                "record; with `lmforge prefect start` running, cached runs are recorded as well)"
            )
            steps = {n: {"key": m["key"], "dir": m["dir"], "status": "cached"} for n, m in manifests.items()}
            return {"steps": steps, "manifests": manifests, "workspace": config.workspace}, None
    api_url = server.connect_for_run()  # a temporary server, if needed, boots while Prefect is imported
    from prefect import tags

    from flows.pipeline import pipeline
    from lmforge.processes.slurm import main_tags

    server.wait_for_api()
    # a run inside a SLURM job is tagged with its job id in the UI; the terminal shows one line per step
    with tags(*main_tags()), terminal():
        result = pipeline(preset=args.config, overrides=args.overrides, workspace=args.workspace, stages=stages)
    return result, api_url


def cmd_deployments(args: argparse.Namespace, _: Any) -> int:
    from lmforge.config import load_config
    from lmforge.errors import ConfigError
    from lmforge.server import use_running_server

    config = load_config(args.config, args.overrides, args.workspace, check_paths=not args.write_prefect_yaml)
    name = args.name or config.name
    if args.write_prefect_yaml:
        from flows.deployments import deployment_specs, prefect_yaml

        Path(args.write_prefect_yaml).write_text(
            prefect_yaml(deployment_specs(name, args.config, args.overrides, args.workspace))
        )
        print(f"wrote {args.write_prefect_yaml}")
        return 0
    if not use_running_server():
        raise ConfigError(
            "deployments need a Prefect server: run `lmforge prefect start` first (or set PREFECT_API_URL)"
        )
    parameters = {"preset": args.config, "overrides": args.overrides, "workspace": args.workspace}
    if args.serve:
        from flows.pipeline import pipeline

        print(
            f"serving deployment 'lmforge-pipeline/{name}'; trigger it with:\n"
            f"  prefect deployment run 'lmforge-pipeline/{name}'\n(Ctrl-C stops serving)"
        )
        pipeline.serve(name=name, parameters=parameters)
        return 0
    from flows.deployments import apply_deployments, deployment_specs, ensure_gpu_limit, ensure_pools

    for pool, outcome in ensure_pools(args.gpu_worker_type).items():
        print(f"work pool {pool}: {outcome}")
    slots = _gpu_slots(args.gpus)
    print(f"concurrency limit gpu ({slots} slots): {ensure_gpu_limit(slots)}")
    specs = deployment_specs(name, args.config, args.overrides, args.workspace)
    for full_name, spec in zip(apply_deployments(specs), specs):
        print(f"deployment {full_name}  (pool {spec['work_pool']})")
    print(
        "\nstart workers (from this checkout's .venv, with PREFECT_API_URL pointing at this server):\n"
        "  .venv/bin/prefect worker start --pool lmforge-cpu\n"
        "  .venv/bin/prefect worker start --pool lmforge-gpu     # on each GPU machine\n"
        f"then: prefect deployment run 'lmforge-pipeline/{name}'"
        + (
            ""
            if config.runtime.dispatch == "deployments"
            else "\n(stages run inside the pipeline's flow run; create them with --set runtime.dispatch=deployments "
            "to send each stage to its pool)"
        )
    )
    return 0


def _gpu_slots(requested: int | None) -> int:
    if requested:
        return requested
    import torch

    return max(torch.cuda.device_count(), 1)

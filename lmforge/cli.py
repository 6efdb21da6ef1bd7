"""The `lmforge` command line.

    lmforge run                      the full pipeline on the tiny-cpu preset
    lmforge stage STAGE              one stage (and what it needs upstream, reused when cached)
    lmforge explain STAGE|all        would each step be reused? if not, exactly why
    lmforge server start|stop|status a local Prefect UI/API on 127.0.0.1
    lmforge deploy                   work pools and deployments (pipeline + one per stage) on a Prefect server
    lmforge slurm render|submit S    an sbatch script running stage S across a SLURM job's nodes
    lmforge config show|validate     the resolved configuration

Stages add their own commands (e.g. `lmforge plan` from pretraining). All commands that
read a config take --config PRESET|FILE, --set KEY=VALUE (repeatable) and --workspace DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError, LmforgeError

# Prefect's temporary server would try to send telemetry, and fail loudly on machines without
# internet access; set before prefect is imported so its settings see it
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

EPILOG = """examples:
  lmforge run                                     # demo corpus -> tiny model, on CPU
  lmforge run --set pretrain.max_steps=100        # change one field; only what depends on it reruns
  lmforge stage curate --set curate.near_dedup.enabled=false
  lmforge explain pretrain --set pretrain.optim.lr=1e-3
  lmforge run --config gpu-1node --workspace /data/ws
"""


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", "-c", default="tiny-cpu", help="preset name (configs/NAME.yaml) or YAML path (default: tiny-cpu)"
    )
    parser.add_argument(
        "--set",
        "-s",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set pretrain.optim.lr=1e-3 (repeatable)",
    )
    parser.add_argument("--workspace", "-w", help="where stage outputs live (default: from the config, ./workspace)")


class _StageCommands:
    """What a stage's `cli` hook sees: `add_parser` that also adds --config/--set/--workspace."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser = self.sub.add_parser(name, **kwargs)
        _common(parser)
        return parser


def build_parser() -> argparse.ArgumentParser:
    from lmforge.console import add_verbose_flag
    from lmforge.registry import stage_names, stages

    parser = argparse.ArgumentParser(
        prog="lmforge",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run the full pipeline (every stage in the config's `stages`)")
    _common(run)
    run.add_argument("--local", action="store_true", help="run without Prefect (same caching, no UI)")
    add_verbose_flag(run)
    stage = sub.add_parser("stage", help="run one stage and what it needs upstream")
    stage.add_argument("name", choices=stage_names())
    _common(stage)
    stage.add_argument("--local", action="store_true", help="run without Prefect (same caching, no UI)")
    add_verbose_flag(stage)
    explain = sub.add_parser("explain", help="say whether each step would be reused, and why not")
    explain.add_argument("stage", choices=[*stage_names(), "all"])
    _common(explain)
    for registered in stages():
        if registered.cli is not None:
            registered.cli(_StageCommands(sub))
    server = sub.add_parser("server", help="manage a local Prefect server (UI on http://127.0.0.1:4200)")
    server.add_argument("action", choices=["start", "stop", "status"])
    server.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=4200)
    deploy = sub.add_parser("deploy", help="create the work pools and deployments (`prefect deployment run ...`)")
    _common(deploy)
    deploy.add_argument("--name", help="deployment name (default: the preset name)")
    deploy.add_argument(
        "--serve",
        action="store_true",
        help="laptop mode: serve the pipeline deployment from this process (no work pools or workers)",
    )
    deploy.add_argument(
        "--gpu-worker-type",
        choices=["process", "docker", "kubernetes"],
        default="process",
        help="worker type of the lmforge-gpu pool when it is created (default: process)",
    )
    deploy.add_argument(
        "--gpus",
        type=int,
        help="slots of the `gpu` concurrency limit: GPUs per node (default: the GPUs visible here, at least 1)",
    )
    deploy.add_argument("--write-prefect-yaml", metavar="PATH", help="write the deployments as a prefect.yaml and exit")
    slurm = sub.add_parser("slurm", help="run a stage as a SLURM job: render (print) or submit (sbatch) its script")
    slurm.add_argument("action", choices=["render", "submit"])
    slurm.add_argument("stage", choices=stage_names())
    _common(slurm)
    config = sub.add_parser("config", help="show or validate the resolved configuration")
    config.add_argument("action", choices=["show", "validate"])
    _common(config)
    config.add_argument(
        "--skip-path-checks",
        action="store_true",
        help="validate a preset meant for another machine (input files may not exist here)",
    )
    return parser


def _load(args: argparse.Namespace, check_paths: bool = True):  # type: ignore[no-untyped-def]
    from lmforge.config import load_config

    return load_config(args.config, args.overrides, args.workspace, check_paths=check_paths)


def _use_server_if_running() -> str | None:
    from lmforge import server

    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    url = server.running_api_url()
    if url:
        os.environ["PREFECT_API_URL"] = url
    return url


def _print_summary(
    steps: dict[str, dict[str, Any]],
    manifests: dict[str, dict[str, Any]],
    workspace: str,
    seconds: float,
    api_url: str | None,
) -> None:
    from lmforge.registry import stages

    if not steps:
        print("nothing to run: every requested stage is disabled (see `stages` and `<stage>.enabled`)")
        return
    width = max(len(n) for n in steps)
    print(f"\n{'step'.ljust(width)}  {'status':9}  {'key':16}  output")
    for name, info in steps.items():
        print(f"{name.ljust(width)}  {info['status']:9}  {info['key']:16}  {info['dir']}")
    hits = sum(i["status"] != "computed" for i in steps.values())
    print(f"\n{len(steps)} steps, {hits} cache hits, {len(steps) - hits} computed, {seconds:.1f}s")
    print(f"results: {os.path.abspath(workspace)}")
    for stage in stages():
        if stage.summary is not None:
            for line in stage.summary(manifests):
                print(line)
    if api_url:
        print(
            f"Prefect UI: {api_url.removesuffix('/api')}  "
            "(flow runs, artifacts: curation-stats, pretrain-summary, pipeline-lineage)"
        )
    else:
        print("Prefect UI: start `lmforge server start` before running to browse runs, logs and artifacts")


def cmd_run(args: argparse.Namespace, stages: list[str] | None) -> int:
    from lmforge.console import terminal

    config = _load(args)
    started = time.time()
    if args.local:
        from lmforge.executor import run_pipeline_locally

        os.environ["LMFORGE_LOG_LEVEL"] = config.runtime.log_level  # for the training ranks
        with terminal(args.verbose, level=config.runtime.log_level):  # one line per step, progress, warnings
            manifests = run_pipeline_locally(config, stages or config.stages)
        steps = {
            n: {
                "key": m["key"],
                "dir": m["dir"],
                "status": "cached" if m["timings"]["finished_at"] < started else "computed",
            }
            for n, m in manifests.items()
        }
        _print_summary(steps, manifests, config.workspace, time.time() - started, None)
        return 0
    from lmforge import server

    api_url = server.connect_for_run()  # a temporary server, if needed, boots while Prefect is imported
    from prefect import tags

    from flows.pipeline import pipeline
    from lmforge.slurm import main_tags

    server.wait_for_api()
    # a run inside a SLURM job is tagged with its job id in the UI; the terminal shows one line per step
    with tags(*main_tags()), terminal(args.verbose, until_exit=True):
        result = pipeline(preset=args.config, overrides=args.overrides, workspace=args.workspace, stages=stages)
    _print_summary(result["steps"], result["manifests"], result["workspace"], time.time() - started, api_url)
    return 0


def _stop_launched_on_signals() -> None:
    """Ctrl-C and SIGTERM stop every launched command (and wait until it is gone) before the run ends.

    Python runs signal handlers in the main thread, and only when it runs Python code: while it
    waits for a step's future, a SIGTERM (SLURM, systemd, eviction) would sit unhandled until
    training ended by itself. So SIGTERM is blocked in every thread and taken by a thread of its
    own, which stops the launched commands first -- that ends the wait -- and then hands the
    signal to the main thread's handler: Prefect's while a flow runs (the run ends Crashed, its
    hooks run), else `on_terminate` below.
    """
    import _thread
    import signal
    import threading

    from lmforge import launcher

    def on_interrupt(signum: int, frame: Any) -> None:
        launcher.stop_all()
        signal.default_int_handler(signum, frame)

    def on_terminate(signum: int, frame: Any) -> None:
        launcher.stop_all()
        raise SystemExit(128 + signum)

    def take_sigterm() -> None:
        while True:
            signal.sigwait({signal.SIGTERM})
            launcher.stop_all()
            _thread.interrupt_main(signal.SIGTERM)

    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_terminate)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited by every thread started later
    threading.Thread(target=take_sigterm, name="lmforge-sigterm", daemon=True).start()


def cmd_explain(args: argparse.Namespace) -> int:
    from lmforge.explain import explain, format_explanations
    from lmforge.registry import stage_names

    config = _load(args)
    stages = stage_names() if args.stage == "all" else [args.stage]
    config.stages = stages
    print(format_explanations(explain(config, stages)))
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    from lmforge import server

    if args.action == "start":
        url = server.start(args.host, args.port)
        print(f"Prefect server up: UI {url.removesuffix('/api')}  API {url}")
    elif args.action == "stop":
        print("stopped" if server.stop() else "not running")
    else:
        print(server.status())
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    config = _load(args, check_paths=not args.write_prefect_yaml)
    name = args.name or config.name
    if args.write_prefect_yaml:
        from flows.deployments import deployment_specs, prefect_yaml

        Path(args.write_prefect_yaml).write_text(
            prefect_yaml(deployment_specs(name, args.config, args.overrides, args.workspace))
        )
        print(f"wrote {args.write_prefect_yaml}")
        return 0
    if not _use_server_if_running():
        raise ConfigError("deploy needs a Prefect server: run `lmforge server start` first (or set PREFECT_API_URL)")
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
    print(f"concurrency limit gpu ({_gpu_slots(args.gpus)} slots): {ensure_gpu_limit(_gpu_slots(args.gpus))}")
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
            else "\n(stages run inside the pipeline's flow run; deploy with --set runtime.dispatch=deployments to send "
            "each stage to its pool)"
        )
    )
    return 0


def _gpu_slots(requested: int | None) -> int:
    if requested:
        return requested
    import torch

    return max(torch.cuda.device_count(), 1)


def cmd_slurm(args: argparse.Namespace) -> int:
    from lmforge import slurm

    config = _load(args, check_paths=False)
    script = slurm.render(config, args.stage, args.config, args.overrides, args.workspace)
    if args.action == "render":
        print(script, end="")
        return 0
    path, answer = slurm.submit(script, Path(args.workspace or config.workspace).resolve() / "slurm")
    print(f"{answer}  (script: {path})")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    config = _load(args, check_paths=not args.skip_path_checks)
    if args.action == "show":
        print(yaml.safe_dump(json.loads(config.model_dump_json()), sort_keys=False))
    else:
        print(f"{args.config}: valid")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _stop_launched_on_signals()
    try:
        if args.command in ("run", "stage"):
            return cmd_run(args, [args.name] if args.command == "stage" else None)
        if hasattr(args, "handler"):  # a stage's own command
            config = (
                _load(args, check_paths=getattr(args, "check_paths", True))
                if getattr(args, "needs_config", False)
                else None
            )
            return args.handler(args, config)
        handler = {
            "explain": cmd_explain,
            "server": cmd_server,
            "deploy": cmd_deploy,
            "config": cmd_config,
            "slurm": cmd_slurm,
        }[args.command]
        return handler(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except LmforgeError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; completed work is kept and the next run resumes from it", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user; LMFORGE_DEBUG=1 shows the traceback
        if os.environ.get("LMFORGE_DEBUG"):
            raise
        print(
            f"error: {type(exc).__name__}: {exc} (the failed step's logs/step.log and the Prefect run log have "
            "details; -v shows them here, LMFORGE_DEBUG=1 the traceback)",
            file=sys.stderr,
        )
        return 1
    except BaseException as exc:
        if type(exc).__name__ != "TerminationSignal":  # Prefect's: the run was cancelled from the UI or API
            raise
        print(
            "cancelled; launched processes were stopped, completed work and checkpoints are kept "
            "(the next run resumes from them)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())

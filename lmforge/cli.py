"""The `lmforge` command line.

    lmforge run                      the full pipeline on the tiny-cpu preset
    lmforge stage STAGE              one stage (and what it needs upstream, reused when cached)
    lmforge explain STAGE|all        would each step be reused? if not, exactly why
    lmforge stages                   the registered stages, their steps, and the products they consume and produce
    lmforge prefect start|stop|status a local Prefect UI/API on 127.0.0.1
    lmforge deployments              work pools and deployments (pipeline + one per stage) on a Prefect server
    lmforge slurm render|submit S    an sbatch script running stage S across a SLURM job's nodes
    lmforge config show|validate     the resolved configuration
    lmforge config describe FIELD    one field: type, default, allowed values, cache key

Stages add their own commands (e.g. `lmforge plan` from pretraining, `lmforge serve` from
serving), and so does the orchestrator (`flows.cli`: the Prefect run and `deployments`), through
the `lmforge.commands` entry points: this module imports neither. All commands that read a
config take --config PRESET|FILE, --set KEY=VALUE (repeatable) and --workspace DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmforge.engine.remote import is_remote, local_workspace
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


# old spellings that still work for one release, with a one-line notice: old -> new
RENAMED = {"server": "prefect", "deploy": "deployments"}

# (arguments, loaded config, stages, a factory of the terminal context) -> (run result, UI's API URL or None)
Orchestrator = Callable[
    [argparse.Namespace, Any, "list[str] | None", Callable[[], Any]], "tuple[dict[str, Any], str | None]"
]


class Commands:
    """What a stage's `cli` hook and an `lmforge.commands` plugin see.

    `add_parser` adds a command with --config/--set/--workspace; `set_orchestrator` installs what
    runs `lmforge run`/`stage` without `--local` (the orchestrator plugin, `flows.cli`)."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.orchestrator: Orchestrator | None = None

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self.sub.add_parser(name, **kwargs)
        _common(parser)
        return parser

    def set_orchestrator(self, run: Orchestrator) -> None:
        self.orchestrator = run


_commands: Commands | None = None


def build_parser() -> argparse.ArgumentParser:
    global _commands
    from lmforge.console import add_verbose_flag
    from lmforge.engine.registry import command_plugins, stage_names, stages

    parser = argparse.ArgumentParser(
        prog="lmforge",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run the full pipeline (every stage in the config's `stages`)")
    _common(run)
    run.add_argument("--local", action="store_true", help="run without Prefect (same caching and retries, no UI)")
    add_verbose_flag(run)
    stage = sub.add_parser("stage", help="run one stage and what it needs upstream")
    stage.add_argument("name", choices=stage_names())
    _common(stage)
    stage.add_argument("--local", action="store_true", help="run without Prefect (same caching and retries, no UI)")
    add_verbose_flag(stage)
    explain = sub.add_parser("explain", help="say whether each step would be reused, and why not")
    explain.add_argument("stage", choices=[*stage_names(), "all"])
    _common(explain)
    listing = sub.add_parser(
        "stages", help="list the registered stages, their steps and the products each consumes and produces"
    )
    listing.add_argument("stage", nargs="?", choices=stage_names(), help="only this stage")
    listing.add_argument(
        "--update-docs",
        "--update-readme",
        dest="update_docs",
        metavar="PATH",
        help="redraw the stage maps (after each `<!-- lmforge stages S -->`) in a Markdown file, or in every one under a folder",
    )
    _common(listing)
    _commands = Commands(sub)
    for registered in stages():
        if registered.cli is not None:
            registered.cli(_commands)
    for plugin in command_plugins():
        plugin(_commands)
    prefect = sub.add_parser(
        "prefect", aliases=["server"], help="manage a local Prefect server (UI on http://127.0.0.1:4200)"
    )
    prefect.add_argument("action", choices=["start", "stop", "status"])
    prefect.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    prefect.add_argument("--port", type=int, default=4200)
    slurm = sub.add_parser("slurm", help="run a stage as a SLURM job: render (print) or submit (sbatch) its script")
    slurm.add_argument("action", choices=["render", "submit"])
    slurm.add_argument("stage", choices=stage_names())
    _common(slurm)
    config = sub.add_parser(
        "config", help="show or validate the resolved configuration, or describe one field (`describe FIELD`)"
    )
    config.add_argument("action", choices=["show", "validate", "describe"])
    config.add_argument(
        "field", nargs="?", help="describe: a field's dotted path (type, default, allowed values, cache key)"
    )
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


def _print_summary(
    steps: dict[str, dict[str, Any]],
    manifests: dict[str, dict[str, Any]],
    workspace: str,
    seconds: float,
    api_url: str | None,
) -> None:
    from lmforge.engine.registry import stages

    if not steps:
        print("nothing to run: every requested stage is disabled (see `stages` and `<stage>.enabled`)")
        return
    width = max(len(n) for n in steps)
    print(f"\n{'step'.ljust(width)}  {'status':9}  {'key':16}  output")
    for name, info in steps.items():
        print(f"{name.ljust(width)}  {info['status']:9}  {info['key']:16}  {info['dir']}")
    hits = sum(i["status"] != "computed" for i in steps.values())
    print(f"\n{len(steps)} steps, {hits} cache hits, {len(steps) - hits} computed, {seconds:.1f}s")
    print(f"results: {workspace if is_remote(str(workspace)) else os.path.abspath(workspace)}")
    for stage in stages():
        if stage.summary is not None:
            for line in stage.summary(manifests):
                print(line)
    from lmforge.tracking import summary_line

    tracked = summary_line()  # None when nothing was logged to MLflow in this run
    if tracked:
        print(tracked)
    if api_url:
        print(
            f"Prefect UI: {api_url.removesuffix('/api')}  "
            "(flow runs, artifacts: curation-stats, pretrain-summary, pipeline-lineage)"
        )
    else:
        print("Prefect UI: start `lmforge prefect start` before running to browse runs, logs and artifacts")


def cmd_run(args: argparse.Namespace, stages: list[str] | None) -> int:
    from lmforge.console import terminal

    config = _load(args)
    started = time.time()
    if args.local:
        from lmforge.engine.executor import run_pipeline_locally

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
    if _commands is None or _commands.orchestrator is None:
        raise ConfigError(
            "no orchestrator is installed (the `lmforge.commands` entry point of flows.cli): "
            "run with --local, or reinstall lmforge (`bash scripts/setup.sh`)"
        )
    result, api_url = _commands.orchestrator(args, config, stages, lambda: terminal(args.verbose, until_exit=True))
    _print_summary(result["steps"], result["manifests"], result["workspace"], time.time() - started, api_url)
    return 0


_terminated = False  # a SIGTERM arrived: the run ends with 143 and one line, however it unwinds
STOPPED = "launched processes were stopped, completed work and checkpoints are kept (the next run resumes from them)"


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

    from lmforge.processes import launcher

    def on_interrupt(signum: int, frame: Any) -> None:
        launcher.stop_all()
        signal.default_int_handler(signum, frame)

    def on_terminate(signum: int, frame: Any) -> None:
        launcher.stop_all()
        raise SystemExit(128 + signum)

    def take_sigterm() -> None:
        global _terminated
        while True:
            signal.sigwait({signal.SIGTERM})
            _terminated = not launcher.cancelling()  # else: our own hand-over of a cancellation
            launcher.stop_all()
            _thread.interrupt_main(signal.SIGTERM)

    signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGTERM, on_terminate)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # inherited by every thread started later
    threading.Thread(target=take_sigterm, name="lmforge-sigterm", daemon=True).start()


def cmd_explain(args: argparse.Namespace) -> int:
    from lmforge.engine.explain import explain, format_explanations
    from lmforge.engine.registry import stage_names

    config = _load(args)
    stages = stage_names() if args.stage == "all" else [args.stage]
    config.stages = stages
    print(format_explanations(explain(config, stages)))
    return 0


def cmd_prefect(args: argparse.Namespace) -> int:
    from lmforge import server

    if args.action == "start":
        url = server.start(args.host, args.port)
        print(f"Prefect server up: UI {url.removesuffix('/api')}  API {url}")
    elif args.action == "stop":
        print("stopped" if server.stop() else "not running")
    else:
        print(server.status())
    return 0


def cmd_slurm(args: argparse.Namespace) -> int:
    from lmforge.processes import slurm

    config = _load(args, check_paths=False)
    script = slurm.render(config, args.stage, args.config, args.overrides, args.workspace)
    if args.action == "render":
        print(script, end="")
        return 0
    ws = config.model_copy(update={"workspace": args.workspace}) if args.workspace else config
    path, answer = slurm.submit(script, local_workspace(ws).resolve() / "slurm")
    print(f"{answer}  (script: {path})")
    return 0


def cmd_stages(args: argparse.Namespace) -> int:
    from lmforge.engine.stagemap import format_stages

    config = _load(args, check_paths=False)
    if args.update_docs:
        from lmforge.engine.stagemap import readme_with_stage_maps

        root = Path(args.update_docs)
        for path in sorted(root.rglob("*.md")) if root.is_dir() else [root]:
            text = path.read_text()
            redrawn = readme_with_stage_maps(text, config)
            if redrawn != text:
                path.write_text(redrawn)
                print(f"redrew the stage maps in {path}")
        return 0
    print(format_stages(args.stage, config))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    if args.action == "describe":
        from lmforge.fields import describe

        if not args.field:
            raise ConfigError("config describe: name a field, e.g. `lmforge config describe pretrain.optim.lr`")
        print(describe(args.field))
        return 0
    if args.field:
        raise ConfigError(f"config {args.action} takes no field (did you mean `config describe {args.field}`?)")
    config = _load(args, check_paths=not args.skip_path_checks)
    if args.action == "show":
        print(yaml.safe_dump(json.loads(config.model_dump_json()), sort_keys=False))
    else:
        print(f"{args.config}: valid")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in RENAMED:  # an old spelling: works for one more release
        print(
            f"note: `lmforge {args.command}` is now `lmforge {RENAMED[args.command]}`; "
            "the old name goes away in the next release",
            file=sys.stderr,
        )
        args.command = RENAMED[args.command]
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
            "prefect": cmd_prefect,
            "config": cmd_config,
            "slurm": cmd_slurm,
            "stages": cmd_stages,
        }[args.command]
        return handler(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except LmforgeError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if _terminated:
            print(f"terminated (SIGTERM); {STOPPED}", file=sys.stderr)
            return 143
        print("interrupted; completed work is kept and the next run resumes from it", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if _terminated and exc.code == 143:
            print(f"terminated (SIGTERM); {STOPPED}", file=sys.stderr)
        raise
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
        if _terminated:  # Prefect turned our SIGTERM into its termination of the flow run
            print(f"terminated (SIGTERM); {STOPPED}", file=sys.stderr)
            return 143
        print(f"cancelled; {STOPPED}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

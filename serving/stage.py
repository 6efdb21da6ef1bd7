"""The serving stage's registration: the chosen model on vLLM's OpenAI server, and `lmforge serve`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.engine.remote import local_workspace
from lmforge.engine.stage import ArtifactSpec, Resources, Stage
from serving.config import ServeConfig

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger("serving.stage")


def _steps() -> list[Any]:
    from serving.steps import RELEASE_STEPS

    return RELEASE_STEPS


def _here(config: PipelineBase, released: dict[str, Any]) -> dict[str, Any]:
    """The release's record with its model (and distilled draft) where they are on this machine: a
    release reused from another machine or folder names that one's paths (fetched first from a store)."""
    from lmforge.engine.store import StageStore

    store = StageStore.for_config(config)
    model = released.get("lineage", {}).get("model", {})
    if not model.get("step"):
        return released
    here = {**released, "model_dir": str(store.here(model["step"], model["key"], released["model_dir"]))}
    draft, speculative = released.get("lineage", {}).get("draft"), released.get("speculative_config")
    if draft and speculative and speculative.get("draft_model"):
        path = store.here(draft["step"], draft["key"], speculative["draft_model"])
        here["speculative_config"] = {**speculative, "draft_model": str(path)}
    return here


def _reconcile(config: PipelineBase, manifests: dict[str, dict[str, Any]]) -> list[str]:
    """After `serve/release` (computed or cached): the released model is the one running."""
    from serving import release

    manifest = manifests.get("serve/release")
    if manifest is None:
        return []
    outcome, record = release.ensure_running(local_workspace(config), config.serve, _here(config, manifest["extra"]))
    if outcome == "kept":
        log.info(
            "%s is current at %s (pid file %s): kept, not restarted",
            record["served_name"],
            record.get("endpoint", record["url"]),
            record["pid_file"],
        )
    return [outcome]


def _artifacts(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], error: BaseException | None
) -> list[ArtifactSpec]:
    from serving import release

    manifest = manifests.get("serve/release")
    if manifest is None or status.get("serve/release") != "computed":
        return []  # one artifact per promotion: the UI keeps their history
    extra = manifest["extra"]
    record = release.current(manifest["dir"].split("/serve/release/")[0]) or {}
    rows = [
        {"field": k, "value": str(v)}
        for k, v in (
            ("url", f"{extra['url']}/v1"),
            ("served model name", extra["served_name"]),
            ("model dir", extra["model_dir"]),
            ("model lineage key", extra["lineage"]["model"].get("key", "")),
            ("model step", extra["lineage"]["model"].get("step", extra["lineage"]["model"].get("dir", ""))),
            *((f"adapter {role}", name) for role, name in extra.get("adapters", {}).items()),
            ("evaluation", extra["lineage"].get("evaluation", {}).get("report", "not required")),
            ("contamination gate", extra["lineage"].get("evaluation", {}).get("contamination_gate", "n/a")),
            ("API key", record.get("key_fingerprint", "")),
        )
    ]
    specs = [ArtifactSpec("serving-endpoint", "table", rows, f"promoted {extra['served_name']}")]
    if extra["slo"]:
        from serving.slo import table

        specs.append(
            ArtifactSpec("serving-slo", "markdown", table(extra["slo"]), f"SLO benchmark of {extra['served_name']}")
        )
    return specs


def _summary(manifests: dict[str, dict[str, Any]]) -> list[str]:
    manifest = manifests.get("serve/release")
    if manifest is None:
        return []
    from serving import release

    extra = manifest["extra"]
    # where it answers now: a restart after the release (it had died, or its settings changed) moves it
    record = release.current(manifest["dir"].split("/serve/release/")[0]) or {}
    url = record.get("endpoint", record["url"]) if record.get("served_name") == extra["served_name"] else extra["url"]
    return [
        f"served:  {extra['served_name']} at {url}/v1  (lmforge serve status; key: LMFORGE_API_KEY "
        "or <workspace>/serving/api_key)"
    ]


def _cli(commands: Any) -> None:
    serve = commands.add_parser("serve", help="the served model: start | stop | status | logs")
    serve.add_argument("action", choices=["start", "stop", "status", "logs"])
    serve.add_argument("--model", help="start this Hugging Face model directory instead of the promoted one")
    serve.add_argument("--lines", type=int, default=40, help="log lines to show (logs)")
    serve.set_defaults(handler=_cmd_serve, needs_config=True, check_paths=False)


def _cmd_serve(args: argparse.Namespace, config: PipelineBase) -> int:
    from lmforge.engine.store import StageStore
    from lmforge.errors import ConfigError
    from serving import release

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    workspace = local_workspace(config)  # the serving folder is this machine's
    if args.action == "stop":
        print("stopped" if release.stop(workspace) else "not running")
        return 0
    if args.action == "status":
        running, lines = release.status_lines(workspace)
        print("\n".join(lines))
        return 0 if running else 3
    if args.action == "logs":
        record = release.current(workspace)
        if record is None:
            raise ConfigError(f"no server has been started from {workspace}")
        print("\n".join(Path(record["log_file"]).read_text(errors="replace").splitlines()[-args.lines :]))
        return 0
    # start
    if args.model:
        model_dir = Path(args.model).resolve()
        if not (model_dir / "config.json").exists():
            raise ConfigError(f"--model {args.model}: not a Hugging Face model directory (no config.json)")
        from lmforge.hashing import digest

        want = {
            "served_name": f"lmforge-{model_dir.name}@{digest(str(model_dir))[:8]}",
            "model_dir": str(model_dir),
            "lineage": {"model": {"dir": str(model_dir)}},
        }
    else:
        record = release.current(workspace)
        if record is not None:
            want = record
        else:
            latest = StageStore(workspace).latest("serve/release")  # the manifest of the last release step
            if latest is None:
                raise ConfigError(f"nothing released from {workspace} yet: run `lmforge run` (or pass --model DIR)")
            want = latest["extra"]
    outcome, _ = release.ensure_running(workspace, config.serve, want)
    print("already running" if outcome == "kept" else "started")
    print("\n".join(release.status_lines(workspace)[1]))
    return 0


STAGE = Stage(
    name="serve",
    description="Serving: the gated model on vLLM's OpenAI-compatible server, smoke-tested, SLO-checked, promoted.",
    config_model=ServeConfig,
    steps=_steps,
    after=("evaluate", "quantize"),
    artifacts=_artifacts,
    resources=Resources(pool="gpu", gpus=1),
    packages=("serving",),
    summary=_summary,
    cli=_cli,
    reconcile=_reconcile,
)

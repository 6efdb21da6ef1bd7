"""Metric runs: lm-eval on one model and one backend, each task's result cached under its own address.

Used by the evaluation stage's metric steps and by the quantization gate, so a model is always
measured the same way and a result computed once (the DPO model on vLLM, say) is found again by
whichever step asks for it. A task's address covers the model's content digest, the task's
definition digest, the backend, its item limit, seeds, lm-eval's version and, for vLLM, the
engine settings: adding a task computes only that task, and a retry after a crash resumes from
the tasks already written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from evaluation import backends
from lmforge.configbase import ConfigView, has_section, pick
from lmforge.hashing import digest

log = logging.getLogger(__name__)
RESULTS = "evaluate/results"  # the per-task result cache


RUN_READS = ("evaluate.limit", "evaluate.seed", "evaluate.bootstrap_iters", "evaluate.sandbox")


def run_reads(config: BaseModel | ConfigView, backend: str) -> tuple[str, ...]:
    """The config fields a metric run reads: the serving stage's engine settings too when it is
    registered (a model is judged as it will be served; the hf backend uses its context length)."""
    if not has_section(config, "serve"):
        return RUN_READS
    return (*RUN_READS, *backends.backend(backend).reads())


def engine_config(config: ConfigView) -> Any:
    """The serving stage's vLLM settings when it is registered, else vLLM's defaults."""
    from lmforge.inference.vllm_server import EngineConfig

    return config.serve.engine if has_section(config, "serve") else EngineConfig()


def unsafe_code_allowed(name: str, task: dict[str, Any], allowed: list[str]) -> bool:
    """May lm-eval run this task's model-generated code (`confirm_run_unsafe_code`)? Only lmforge's
    sandboxed task runs it (through `evaluation/sandbox.py`); a stock task that executes code in the
    evaluation process itself (humaneval, mbpp) only where `evaluate.allow_unsafe_code` names it."""
    return bool(task.get("sandboxed")) or name in allowed


def run_identity(config: ConfigView, backend: str) -> dict[str, Any]:
    """What a metric run's results depend on besides the model and the tasks: every field it reads
    and the versions of what runs it. The quantization gate computes the same for its runs, so
    both find each other's per-task results."""
    from lmforge.engine.codeprint import library_version

    ident = pick(config, *run_reads(config, backend))
    ident["backend"] = backend
    ident["lm_eval"] = library_version("lm-eval")
    ident.update(backends.backend(backend).identity())
    return ident


def task_key(model_digest: str, task: dict[str, Any], name: str, identity: dict[str, Any]) -> str:
    """One task's result address: the other tasks' limits are not part of it."""
    run = json.loads(json.dumps(identity))
    limit = run["evaluate"].pop("limit").get(name)
    return digest({"model": model_digest, "task": name, "definition": task["digest"], "run": run, "limit": limit}, 16)


def evaluate_model(
    config: ConfigView,
    workspace: Path,
    tasks: dict[str, dict[str, Any]],
    identity: dict[str, Any],
    model_dir: Path,
    model_digest: str,
    backend: str,
    served_name: str,
    work_dir: Path,
) -> dict[str, Path]:
    """Every task of `tasks` on one model, reusing cached per-task results; returns {task: result dir}.

    `identity` is `run_identity(config, backend)` as the calling step recorded it; `work_dir` is
    where the run's spec and the temporary server's files go.
    """
    from lmforge.engine.store import StageStore

    store = StageStore.for_config(config)
    done: dict[str, Path] = {}
    todo: dict[str, Path] = {}
    for name, task in tasks.items():
        key = task_key(model_digest, task, name, identity)
        manifest, _ = store.check(RESULTS, key)
        (done if manifest else todo)[name] = store.step_dir(RESULTS, key)
    if done:
        log.info("%s on %s: %d task result(s) reused: %s", served_name, backend, len(done), ", ".join(done))
    if todo:
        _run_lmeval(
            config, model_dir, backend, served_name, {n: (tasks[n], d) for n, d in todo.items()}, store, work_dir
        )
    return {**done, **todo}


def _run_lmeval(
    config: ConfigView,
    model_dir: Path,
    backend: str,
    served_name: str,
    todo: dict[str, tuple[dict[str, Any], Path]],
    store: Any,
    work_dir: Path,
) -> None:
    from lmforge.processes.launch import SINGLE, run_entry

    cfg = config.evaluate
    context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    engine = engine_config(config)
    max_length = min(engine.max_model_len or context, context)
    runner = backends.backend(backend)
    engine = runner.engine(engine, cfg.batch_size, max_length)
    spec: dict[str, Any] = {
        "model_dir": str(model_dir),
        "backend": backend,
        "served_name": served_name,
        "max_length": max_length,
        "batch_size": cfg.batch_size,
        "device": "cuda" if _cuda() else "cpu",
        "bootstrap_iters": cfg.bootstrap_iters,
        "seed": cfg.seed,
        "num_concurrent": cfg.num_concurrent,
        "sandbox": cfg.sandbox.model_dump(),
        "tasks": [
            {
                "name": n,
                "include_path": t["include_path"],
                "limit": cfg.limit.get(n),
                "out_dir": str(d),
                "unsafe_code": unsafe_code_allowed(n, t, cfg.allow_unsafe_code),
            }
            for n, (t, d) in todo.items()
        ],
    }
    with contextlib.ExitStack() as stack:
        extra, env = runner.start(stack, model_dir, engine, work_dir / "server", served_name)
        spec.update(extra)
        try:
            run_entry(
                "evaluation.lmeval_entry",
                spec,
                work_dir,
                policy=SINGLE,
                spec_name=f"lmeval_spec_{backend}.json",
                logger=logging.getLogger("evaluation.lmeval"),
                env=env,
                what=f"lm-eval on {backend}",
            )
        finally:  # whatever finished is kept under its own key, so a retry resumes from it
            keep_finished({name: directory for name, (_, directory) in todo.items()}, store)


def keep_finished(directories: dict[str, Path], store: Any) -> None:
    """Finish (checksum, manifest) each task result that is complete; remove any other leftovers."""
    for name, directory in directories.items():
        if store.read_manifest(directory) is not None:
            continue
        if complete_result(directory):
            store.finish(directory, {"task": name, "key": directory.name, "step": RESULTS})
        elif directory.exists():  # a killed run's leftovers: never taken as done, computed again
            shutil.rmtree(directory, ignore_errors=True)


def complete_result(directory: Path) -> bool:
    """A task's result folder holds a parseable result.json with metrics and its samples.jsonl."""
    try:
        result = json.loads((directory / "result.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and bool(result.get("results")) and (directory / "samples.jsonl").is_file()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def progress(work_dir: Path) -> tuple[float, float] | None:
    """(tasks done, tasks asked) over the lm-eval runs started under `work_dir` (a step's output)."""
    done = total = 0
    for spec in work_dir.rglob("lmeval_spec_*.json"):
        tasks = json.loads(spec.read_text())["tasks"]
        total += len(tasks)
        done += sum((Path(t["out_dir"]) / "result.json").exists() for t in tasks)
    return (done, total) if total else None

"""Running steps: plan (key + cache check), open, run units, close (finalize + manifest).

These building blocks are shared by the Prefect tasks (`tasks/steps.py`) and by the
orchestrator-free `run_pipeline_locally`, so both follow exactly the same cache, resume
and manifest rules.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import functools
import logging
import multiprocessing
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge import console, tracking
from lmforge.engine import codeprint, steplog
from lmforge.engine.codeprint import code_version
from lmforge.engine.graph import Graph, Step, StepContext, build_graph, key_components, step_key
from lmforge.engine.store import StageStore
from lmforge.processes import launcher

if TYPE_CHECKING:
    from lmforge.pipelinebase import PipelineBase

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    step: Step
    key: str
    components: dict[str, Any]
    upstream_names: tuple[str, ...]
    directory: Path
    manifest: dict[str, Any] | None
    reason: str
    drift: list[str] = field(default_factory=list)  # how the code here differs from the code that made the output
    rerun_for_drift: bool = False

    @property
    def cached(self) -> bool:
        return self.manifest is not None


# who is computing: the orchestrator's run (flow run, work pool) when there is one; host and SLURM job always
_made_by: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("lmforge_made_by", default={})  # noqa: B039 - never mutated: .set() stores a new dict


@contextlib.contextmanager
def made_by(**fields: Any) -> Iterator[None]:
    """Record `fields` (e.g. the flow run computing the steps) in the manifests written inside."""
    token = _made_by.set({**_made_by.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _made_by.reset(token)


def provenance() -> dict[str, Any]:
    record = {"host": socket.gethostname(), "pid": os.getpid(), **_made_by.get()}
    if os.environ.get("SLURM_JOB_ID"):
        record["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return record


@functools.lru_cache(maxsize=1)
def graph() -> Graph:
    return build_graph()


def plan_step(step: Step, config: PipelineBase, store: StageStore, upstream: dict[str, dict[str, Any]]) -> StepPlan:
    """The step's key and whether its output can be reused. Computes nothing; with a shared store it may
    bring the output into the working copy (or commit one made here whose upload failed), unless the store
    is read-only (`fetch=False`: `lmforge explain`), which reads only."""
    names = graph().upstream(step, config)
    components = key_components(step, config, names, upstream)
    key = step_key(components)
    manifest, reason = store.check(step.name, key)
    drift = codeprint.drift(step, manifest.get("code")) if manifest else []
    if drift:  # on a shared store another machine may have computed it again with this code
        current, why = store.current_on_store(step.name, key, lambda m: not codeprint.drift(step, m.get("code")))
        if current is not None:
            manifest, reason, drift = current, why, []
    rerun = bool(drift) and config.runtime.on_code_drift == "rerun"
    if rerun:
        manifest, reason = None, "; ".join(drift) + " (runtime.on_code_drift=rerun)"
    return StepPlan(step, key, components, names, store.step_dir(step.name, key), manifest, reason, drift, rerun)


def report_reuse(plan: StepPlan) -> None:
    """One line when an output is reused although its code changed since (on_code_drift=warn)."""
    if plan.drift:
        log.warning(
            "%s: %s; reusing it (runtime.on_code_drift=warn; set it to rerun to recompute)",
            plan.step.name,
            "; ".join(plan.drift),
        )


def step_timeout(step: Step, config: PipelineBase) -> float | None:
    limits = config.runtime.step_timeout_s
    return limits.get(step.name, limits.get(step.stage, limits.get("*", step.timeout_s)))


def open_step(
    plan: StepPlan, config: PipelineBase, store: StageStore, upstream: dict[str, dict[str, Any]]
) -> StepContext:
    if plan.rerun_for_drift:  # made by other code: nothing of it (units, checkpoints) may be resumed
        log.warning("%s/%s: %s; recomputing from scratch", plan.step.name, plan.key, plan.reason)
        store.invalidate(plan.directory)
        shutil.rmtree(plan.directory, ignore_errors=True)
    elif plan.directory.exists() and store.read_manifest(plan.directory) is not None:
        log.warning("%s/%s: %s; recomputing", plan.step.name, plan.key, plan.reason)
        store.invalidate(plan.directory)
    plan.directory.mkdir(parents=True, exist_ok=True)
    needed = {name: local_copy(store, name, upstream[name]) for name in plan.upstream_names}
    store.hold([plan.directory, *(Path(m["dir"]) for m in needed.values())])
    return StepContext(
        plan.step.name,
        plan.key,
        plan.directory,
        plan.step.view(config),
        needed,
        store.root,
        identity=plan.components["config"],
        products=graph().products(plan.step, config),
    )


def local_copy(store: StageStore, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """An upstream output as this machine holds it. In a remote workspace the manifest may come from
    another machine (a parent flow run's, naming its own folder): the output is taken from this
    machine's working copy, fetched from the store first when it is not there."""
    directory = store.step_dir(name, manifest["key"])
    if not store.store.shared or (Path(manifest["dir"]) == directory and (directory / "manifest.json").exists()):
        return manifest
    here, reason = store.check(name, manifest["key"])
    if here is None:
        from lmforge.errors import RetryableError

        raise RetryableError(f"{name}/{manifest['key']}: not available from {store.store.url}: {reason}")
    return here


def split_units(ctx: StepContext, store: StageStore) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(results of units already complete, units still to run)."""
    step = graph().get(ctx.step)
    done: dict[str, dict[str, Any]] = {}
    todo: list[str] = []
    for unit in step.units(ctx):
        result = store.unit_result(ctx.out_dir, unit)
        if result is None:
            todo.append(unit)
        else:
            done[unit] = result
    return done, todo


def run_unit(ctx: StepContext, unit: str, verify_mode: str = "checksum") -> dict[str, Any]:
    """Compute one unit and leave its completion marker. Runs in worker processes."""
    step = graph().get(ctx.step)
    assert step.run_unit is not None, f"{ctx.step} has no units"
    files, result = step.run_unit(ctx, unit)
    StageStore(ctx.workspace, verify_mode).mark_unit(ctx.out_dir, unit, files, result)  # type: ignore[arg-type]
    return result


def domain_loggers() -> tuple[str, ...]:
    from lmforge.engine.registry import domain_packages

    return domain_packages()


LogRecordTuple = tuple[str, int, str]


class _Collect(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[LogRecordTuple] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def run_unit_with_logs(
    ctx: StepContext, unit: str, verify_mode: str = "checksum", level: int | None = None
) -> tuple[dict[str, Any], list[LogRecordTuple]]:
    """`run_unit` in a worker process, returning what the domain loggers said there.

    Worker processes have none of the parent's log handlers (Prefect's API handler least of
    all); the parent re-emits these records inside the unit's task run, so they reach the UI.
    `level` None means the unit runs in a thread of the parent, whose handlers are here
    already: nothing is collected.
    """
    if level is None:
        return run_unit(ctx, unit, verify_mode), []
    collector = _Collect(level)
    loggers = [logging.getLogger(name) for name in domain_loggers()]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.addHandler(collector)
        lg.setLevel(level)
        lg.propagate = False
    try:
        return run_unit(ctx, unit, verify_mode), collector.records
    except Exception as exc:  # what was logged before the failure travels with it (pickled with the exception)
        exc.lmforge_logs = collector.records  # type: ignore[attr-defined]
        raise
    finally:
        for lg, (lvl, propagate) in zip(loggers, saved):
            lg.removeHandler(collector)
            lg.setLevel(lvl)
            lg.propagate = propagate


def unit_outcome(future: cf.Future) -> tuple[dict[str, Any], list[LogRecordTuple]]:
    """The unit's (result, log records); on failure, replay what it logged, then raise."""
    try:
        return future.result()
    except Exception as exc:
        replay_logs(getattr(exc, "lmforge_logs", []))
        raise


def replay_logs(records: list[LogRecordTuple]) -> None:
    """Emit a worker's log records here (in the caller's run context)."""
    for name, levelno, message in records:
        logging.getLogger(name).log(levelno, "%s", message)


def close_step(
    plan: StepPlan,
    ctx: StepContext,
    results: dict[str, dict[str, Any]],
    store: StageStore,
    started: float,
    units_reused: int = 0,
) -> dict[str, Any]:
    """Run the step's global part, then checksum everything and write the manifest last."""
    outcome = plan.step.finalize(ctx, results)
    finished = time.time()
    manifest = {
        "schema": 1,
        "step": plan.step.name,
        "stage": plan.step.stage,
        "description": plan.step.description,
        "key": plan.key,
        "dir": str(plan.directory),
        "key_components": plan.components,
        "inputs": {name: {k: m[k] for k in ("key", "digest", "dir")} for name, m in ctx.upstream.items()},
        "products": {str(p): sub for p, sub in plan.step.provides.items()},
        "params": plan.components["config"],
        "counts": outcome.get("counts", {}),
        "metrics": outcome.get("metrics", {}),
        "extra": outcome.get("extra", {}),
        "timings": {
            "started_at": started,
            "finished_at": finished,
            "seconds": round(finished - started, 3),
            "units_computed": len(results) - units_reused,
            "units_reused": units_reused,
        },
        "code_version": code_version(),
        "code": codeprint.fingerprint(plan.step),
        "made_by": provenance(),
    }
    # logs/ (launch attempts, per-rank logs) is never an output, whichever step launched something
    bookkeeping = tuple(dict.fromkeys(("logs", *plan.step.bookkeeping)))
    return store.finish(plan.directory, manifest, bookkeeping, plan.step.digest_paths)


def capture_level(pool: cf.Executor) -> int | None:
    """The log level units should collect at: worker processes only (see `run_unit_with_logs`)."""
    return logging.getLogger("lmforge").getEffectiveLevel() if isinstance(pool, cf.ProcessPoolExecutor) else None


def make_pool(workers: int) -> cf.Executor:
    """Worker processes for shard units (spawned: safe next to Prefect's threads)."""
    if workers <= 1:
        return cf.ThreadPoolExecutor(max_workers=1)
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


UnitRunner = Callable[[StepContext, list[str]], dict[str, dict[str, Any]]]


def execute_step(
    step: Step,
    config: PipelineBase,
    store: StageStore,
    upstream: dict[str, dict[str, Any]],
    run_units: UnitRunner,
    on_open: Callable[[StepContext], None] | None = None,
) -> tuple[dict[str, Any], bool]:
    """Plan, and compute when needed; returns (manifest, cache_hit).

    `run_units(ctx, todo)` computes the units still to do (in a process pool, or as Prefect
    tasks) and returns their results. The computation holds the step's lock; the processes
    it launches hold it too, until they are gone (`lmforge.processes.launcher`). What is logged while it
    computes goes to the output's `logs/step.log` too; a terminal the CLI shows gets the step's
    progress and one line when it ends (`lmforge.console`). A computed step that trains, evaluates
    or quantizes is then logged to MLflow when `tracking.mlflow.enabled` (`lmforge.tracking`).
    """
    with console.step_on_screen(step.name) as shown:

        def opened(ctx: StepContext) -> None:
            progress = step.progress
            shown.computing(ctx.out_dir, (lambda: progress(ctx)) if progress is not None else None)
            if on_open is not None:
                on_open(ctx)

        manifest, hit = _plan_and_compute(step, config, store, upstream, run_units, opened)
        shown.ended("cached" if hit else "computed", manifest["dir"])
    if not hit:  # from the finished output, here: never from a rank, never failing the step (lmforge.tracking)
        tracking.step_computed(config, manifest)
    return manifest, hit


def _plan_and_compute(
    step: Step,
    config: PipelineBase,
    store: StageStore,
    upstream: dict[str, dict[str, Any]],
    run_units: UnitRunner,
    on_open: Callable[[StepContext], None],
) -> tuple[dict[str, Any], bool]:
    plan = plan_step(step, config, store, upstream)
    if plan.cached:
        report_reuse(plan)
        return plan.manifest, True  # type: ignore[return-value]
    if plan.rerun_for_drift:  # the store's copy too, or the rerun would adopt it and never converge
        store.retract(step.name, plan.key, lambda m: bool(codeprint.drift(step, m.get("code"))))
    with store.lock(step.name, plan.key) as lock_fd:
        plan = plan_step(step, config, store, upstream)
        if plan.cached:
            report_reuse(plan)
            return plan.manifest, True  # type: ignore[return-value]
        started = time.time()
        ctx = open_step(plan, config, store, upstream)
        with steplog.recording(step.name, plan.directory):
            on_open(ctx)
            done, todo = split_units(ctx, store)
            if done:
                log.info("%s: resuming; %d of %d units already complete", step.name, len(done), len(done) + len(todo))
            # a remote workspace: checkpoints come back from the store before, and go to it during, training
            mirror = store.checkpoint_mirror(step.name, plan.key, step.bookkeeping)
            with launcher.step_scope(step.name, lock_fd, step_timeout(step, config)):
                if mirror is not None:
                    mirror.restore()
                    mirror.start()
                try:  # training runs in units or in the step's finalize
                    results = {**done, **run_units(ctx, todo)}
                    manifest = close_step(plan, ctx, results, store, started, units_reused=len(done))
                except BaseException:
                    if mirror is not None:  # what the failed attempt sealed is durable for the next one, anywhere
                        mirror.stop(final_scan=True)
                    raise
                if mirror is not None:
                    mirror.stop(final_scan=False)  # the output is committed: its checkpoints are no longer needed
    log.info("%s: computed in %.1fs -> %s", step.name, manifest["timings"]["seconds"], manifest["dir"])
    return manifest, False


def pool_unit_runner(pool: cf.Executor, store: StageStore) -> UnitRunner:
    """Units in a local pool of worker processes, their logs replayed here as they finish."""

    def run_units(ctx: StepContext, todo: list[str]) -> dict[str, dict[str, Any]]:
        futures = {
            pool.submit(run_unit_with_logs, ctx, unit, store.verify_mode, capture_level(pool)): unit for unit in todo
        }
        results: dict[str, dict[str, Any]] = {}
        for finished, future in enumerate(cf.as_completed(futures), start=1):
            results[futures[future]], records = unit_outcome(future)
            replay_logs(records)
            log.info("%s: %d/%d units done", ctx.step, finished, len(todo))
            console.step_progress(ctx.step, finished, len(todo))
        return results

    return run_units


def execute_with_retries(
    step: Step,
    config: PipelineBase,
    store: StageStore,
    upstream: dict[str, dict[str, Any]],
    run_units: UnitRunner,
    delay_s: float = 2.0,
) -> tuple[dict[str, Any], bool]:
    """`execute_step`, tried again as Prefect retries a step's task run: up to `step.retries` more
    times when the error says a retry can help (a killed rank, a lost peer, an outside I/O error);
    each retry resumes from what the failed attempt completed. Errors that would repeat fail at once."""
    from lmforge.errors import is_retryable

    attempt = 1
    while True:
        try:
            return execute_step(step, config, store, upstream, run_units)
        except Exception as exc:
            if attempt > step.retries or not is_retryable(exc):
                raise
            log.warning(
                "%s failed with %s: %s -> retry %d of %d (resumes from completed work)",
                step.name,
                type(exc).__name__,
                exc,
                attempt,
                step.retries,
            )
            attempt += 1
            time.sleep(delay_s)


def run_pipeline_locally(config: PipelineBase, stages: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Run the selected stages without Prefect (tests, notebooks, debugging)."""
    store = StageStore.for_config(config)
    manifests: dict[str, dict[str, Any]] = {}
    with tracking.pipeline_run(config), make_pool(config.runtime.workers) as pool:  # one MLflow run, if any
        for step in graph().active(config, list(stages)):
            manifests[step.name], hit = execute_with_retries(
                step, config, store, manifests, pool_unit_runner(pool, store)
            )
            store.record_use(step.name, manifests[step.name])
            log.info("%s: %s (%s)", step.name, "cache hit" if hit else "computed", manifests[step.name]["key"])
    reconcile(config, manifests)
    return manifests


def reuse_everything(config: PipelineBase, stages: Iterable[str]) -> dict[str, dict[str, Any]] | None:
    """Every active step's manifest when each output can be reused as it is; None when any step would compute.

    Planning reads only and stops at the first step that would compute, so a run with work to do
    loses little to it. When everything is reused, it does what a run that reuses everything does:
    one line per step, the record `lmforge explain` compares against, and the live state that
    follows the outputs (a served model that stopped is started again).
    """
    store = StageStore.for_config(config)
    plans: list[StepPlan] = []
    manifests: dict[str, dict[str, Any]] = {}
    for step in graph().active(config, list(stages)):
        plan = plan_step(step, config, store, manifests)
        if plan.manifest is None:
            return None
        plans.append(plan)
        manifests[step.name] = plan.manifest
    for plan in plans:
        with console.step_on_screen(plan.step.name) as shown:
            report_reuse(plan)
            shown.ended("cached", plan.directory)
        store.record_use(plan.step.name, manifests[plan.step.name])
    reconcile(config, manifests)
    return manifests


def reconcile(config: PipelineBase, manifests: dict[str, dict[str, Any]]) -> None:
    """Bring the live state that follows the outputs (a running server) in line with them, stage by stage."""
    from lmforge.engine.registry import stages as registered

    for stage in registered():
        if stage.reconcile is not None and any(m["stage"] == stage.name for m in manifests.values()):
            stage.reconcile(config, manifests)

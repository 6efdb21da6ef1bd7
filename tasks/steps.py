"""The Prefect tasks every step runs through.

`run_step` returns the step's small manifest, retried per the step's policy and limited by
its time limit. Inside it, each unit (shard) of the step is its own `run_unit` task,
retryable on its own and visible in the UI; the units execute in a shared pool of worker
processes. A retry of either skips units whose completion markers verify, so it resumes
instead of restarting. The computing itself is `lmforge.engine.executor.execute_step`, shared with
`--local`.

There is one cache, lmforge's content-addressed store, not two: Prefect's own task cache is
off (`NO_CACHE`). A cache keyed on the step key alone would hand back the manifest of old
bytes after a step was recomputed outside Prefect (`--local`, a non-deterministic rerun),
and downstream keys would be built on the wrong digest; one keyed on the output digest
too would have to verify the output before the task even starts. Instead the task always
starts, the store says whether its output is complete and verified (hashing it once per
run), and a reused output ends the task in a `Cached` state, which the UI shows as such.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import functools
import logging
import threading
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.states import Completed, State

from lmforge.console import step_progress
from lmforge.engine.executor import (
    UnitRunner,
    capture_level,
    execute_step,
    graph,
    make_pool,
    replay_logs,
    run_unit,
    run_unit_with_logs,
    step_timeout,
    unit_outcome,
)
from lmforge.engine.graph import StepContext
from lmforge.engine.store import StageStore
from tasks.progress import ProgressReporter
from tasks.retry import should_retry

if TYPE_CHECKING:
    from lmforge.config import PipelineBase

log = logging.getLogger("lmforge.tasks")
_pools: dict[int, cf.Executor] = {}
_pool_lock = threading.Lock()


def shared_pool(workers: int) -> cf.Executor:
    """One pool of worker processes per size, shared by every unit task of this process."""
    with _pool_lock:
        if workers not in _pools:
            _pools[workers] = make_pool(workers)
            atexit.register(_pools[workers].shutdown, cancel_futures=True)
        return _pools[workers]


def _discard_pool(workers: int) -> None:
    with _pool_lock:
        pool = _pools.pop(workers, None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


@task(
    name="unit",
    task_run_name="{step_name}[{unit}]",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=should_retry,
)
def run_unit_task(
    step_name: str, unit: str, ctx: StepContext, workers: int, verify: str, inline: bool = False
) -> dict[str, Any]:
    if inline:  # on a Dask worker: this process is the worker; its domain loggers are wired here
        from tasks.logs import connect_library_loggers

        connect_library_loggers(ctx.config.runtime.log_level)
        return run_unit(ctx, unit, verify)
    pool = shared_pool(workers)
    try:
        result, records = unit_outcome(pool.submit(run_unit_with_logs, ctx, unit, verify, capture_level(pool)))
    except cf.process.BrokenProcessPool:
        _discard_pool(workers)  # a worker died (e.g. out of memory): the retry gets a fresh pool
        raise
    replay_logs(records)  # inside this task run, so the worker's log lines reach the Prefect UI
    return result


_dask_runners: dict[str, Any] = {}


def dask_runner(address: str | None, workers: int) -> Any:
    """One started DaskTaskRunner per cluster address for this process (a local cluster when None).

    Dask rather than Ray: its workers are plain Python processes started from this environment
    (no separate cluster runtime to install or version-match), a local cluster starts in seconds
    on a laptop, and prefect-dask keeps every unit a Prefect task run, as the process pool does.
    """
    from prefect_dask import DaskTaskRunner

    name = address or f"local:{workers}"
    with _pool_lock:
        if name not in _dask_runners:
            kwargs = (
                {"address": address}
                if address
                else {
                    "cluster_kwargs": {
                        "n_workers": workers,
                        "threads_per_worker": 1,
                        "processes": True,
                        "dashboard_address": None,
                    }
                }
            )
            runner = DaskTaskRunner(**kwargs)
            runner.__enter__()
            atexit.unregister(close_dask_runners)  # registered once, however many clusters
            atexit.register(close_dask_runners)
            _dask_runners[name] = runner
        return _dask_runners[name]


def close_dask_runners() -> None:
    """Stop the clusters this process started: at exit, or sooner by whoever knows no step will use
    them again (a test, so the cluster's threads are gone before the harness closes its streams)."""
    with _pool_lock:
        runners = list(_dask_runners.values())
        _dask_runners.clear()
    for runner in runners:
        runner.__exit__(None, None, None)


def _unit_tasks(config: PipelineBase, progress: ProgressReporter) -> UnitRunner:
    def run_units(ctx: StepContext, todo: list[str]) -> dict[str, dict[str, Any]]:
        runtime = config.runtime
        total = len(graph().get(ctx.step).units(ctx))
        if runtime.task_runner == "dask":
            runner = dask_runner(runtime.dask_address, runtime.workers)
            futures = {
                u: runner.submit(
                    run_unit_task,
                    parameters={
                        "step_name": ctx.step,
                        "unit": u,
                        "ctx": ctx,
                        "workers": runtime.workers,
                        "verify": runtime.verify,
                        "inline": True,
                    },
                )
                for u in todo
            }
        else:
            futures = {u: run_unit_task.submit(ctx.step, u, ctx, runtime.workers, runtime.verify) for u in todo}
        # every unit must have finished before the lock is released: a retry of this step
        # must never compute a shard that a still-running sibling is writing
        for finished, _ in enumerate(as_completed(list(futures.values())), start=1):
            log.info("%s: %d/%d units done", ctx.step, finished, len(todo))
            progress.update(total - len(todo) + finished, total)
            step_progress(ctx.step, total - len(todo) + finished, total)
        return {u: f.result() for u, f in futures.items()}

    return run_units


@task(
    name="step",
    task_run_name="{step_name}",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=should_retry,
)
def run_step(step_name: str, config: PipelineBase, upstream: dict[str, dict[str, Any]]) -> State:
    store = StageStore.for_config(config)
    step = graph().get(step_name)
    progress = ProgressReporter(step_name)

    def on_open(ctx: StepContext) -> None:
        if step.progress is not None:
            progress.watch(lambda: step.progress(ctx))  # type: ignore[misc]

    try:
        manifest, hit = execute_step(step, config, store, upstream, _unit_tasks(config, progress), on_open)
    finally:
        progress.stop(finished=False)
    progress.stop(finished=True)
    if hit:
        return Completed(data=manifest, name="Cached", message=f"reused {manifest['dir']}")
    return Completed(data=manifest, message=f"computed in {manifest['timings']['seconds']:.1f}s")


def step_task(step_name: str, config: PipelineBase):  # type: ignore[no-untyped-def]
    """`run_step` with the step's retry count and time limit."""
    step = graph().get(step_name)
    limit = step_timeout(step, config)
    # Prefect's limit is the backstop for in-process work; launched commands meet the launcher's
    # deadline first (a minute earlier), which stops their whole process tree
    return _run_step_with(step.retries, limit + 60 if limit else None)


@functools.cache
def _run_step_with(retries: int, timeout_seconds: float | None):  # type: ignore[no-untyped-def]
    """One task object per option set: `with_options` builds a new one, reading the task's source, each time."""
    return run_step.with_options(retries=retries, timeout_seconds=timeout_seconds)

"""The Prefect tasks every step runs through.

`run_step` is cached on the step's content address (`StageKeyPolicy`), retried per the
step's policy, and returns the small manifest. Inside it, each unit (shard) of the step is
its own `run_unit` task, retryable on its own and visible in the UI; the units execute
in a shared pool of worker processes. A retry of either skips units whose completion
markers verify, so it resumes instead of restarting.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import concurrent.futures.process
import logging
import threading
import time
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from lmforge.executor import (capture_level, close_step, graph, make_pool, open_step, plan_step, replay_logs,
                              run_unit_with_logs, split_units, unit_outcome)
from lmforge.graph import StepContext
from lmforge.store import StageStore
from tasks.cache import StageKeyPolicy, results_dir
from tasks.retry import should_retry

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


@task(name="unit", task_run_name="{step_name}[{unit}]", cache_policy=NO_CACHE,
      retries=2, retry_delay_seconds=1, retry_condition_fn=should_retry)
def run_unit_task(step_name: str, unit: str, ctx: StepContext, workers: int, verify: str) -> dict[str, Any]:
    pool = shared_pool(workers)
    try:
        result, records = unit_outcome(pool.submit(run_unit_with_logs, ctx, unit, verify, capture_level(pool)))
    except cf.process.BrokenProcessPool:
        _discard_pool(workers)  # a worker died (e.g. out of memory): the retry gets a fresh pool
        raise
    replay_logs(records)  # inside this task run, so the worker's log lines reach the Prefect UI
    return result


@task(name="step", task_run_name="{step_name}", cache_policy=StageKeyPolicy(), result_serializer="json",
      retries=2, retry_delay_seconds=2, retry_condition_fn=should_retry)
def run_step(step_name: str, config: Any, upstream: dict[str, dict[str, Any]]) -> dict[str, Any]:
    step = graph().get(step_name)
    store = StageStore(config.workspace, config.runtime.verify)
    plan = plan_step(step, config, store, upstream)
    if plan.cached:
        store.record_use(step_name, plan.manifest)  # type: ignore[arg-type]
        return plan.manifest  # type: ignore[return-value]
    with store.lock(step_name, plan.key):
        plan = plan_step(step, config, store, upstream)
        if plan.cached:
            return plan.manifest  # type: ignore[return-value]
        started = time.time()
        ctx = open_step(plan, config, store, upstream)
        done, todo = split_units(ctx, store)
        if done:
            log.info("%s: resuming; %d of %d units already complete", step_name, len(done), len(done) + len(todo))
        futures = {u: run_unit_task.submit(step_name, u, ctx, config.runtime.workers, config.runtime.verify) for u in todo}
        # every unit must have finished before the lock is released: a retry of this step
        # must never compute a shard that a still-running sibling is writing
        total = len(done) + len(todo)
        for finished, _ in enumerate(as_completed(list(futures.values())), start=len(done) + 1):
            log.info("%s: %d/%d units done", step_name, finished, total)
        results = {**done, **{u: f.result() for u, f in futures.items()}}
        manifest = close_step(plan, ctx, results, store, started, units_reused=len(done))
    log.info("%s: computed in %.1fs -> %s", step_name, manifest["timings"]["seconds"], manifest["dir"])
    return manifest


def step_task(step_name: str, config: Any):  # type: ignore[no-untyped-def]
    """`run_step` with the step's retry count and the workspace's result storage."""
    return run_step.with_options(retries=graph().get(step_name).retries, result_storage=results_dir(config.workspace))

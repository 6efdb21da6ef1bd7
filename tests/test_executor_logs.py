"""Log records of units that run in worker processes come back to the parent, on failure too; a step run
without Prefect is retried as Prefect retries it."""

from __future__ import annotations

import concurrent.futures as cf
import logging

import pytest

from lmforge.engine.executor import unit_outcome
from lmforge.errors import ConfigError, TrainingInterrupted


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.name, record.levelno, record.getMessage()))


def test_a_failed_unit_still_replays_what_it_logged() -> None:
    keep, logger = _Keep(), logging.getLogger("data_prep")
    logger.addHandler(keep)  # directly: the domain loggers may not propagate to the root
    try:
        future: cf.Future = cf.Future()
        error = OSError("disk went away")
        error.lmforge_logs = [("data_prep.ingest", logging.WARNING, "f0000: quarantined 3 of 10 records")]  # type: ignore[attr-defined]
        future.set_exception(error)
        with pytest.raises(OSError, match="disk went away"):
            unit_outcome(future)
        assert keep.seen == error.lmforge_logs  # type: ignore[attr-defined]

        done: cf.Future = cf.Future()
        done.set_result(({"docs": 10}, [("data_prep.x", logging.INFO, "fine")]))
        assert unit_outcome(done) == ({"docs": 10}, [("data_prep.x", logging.INFO, "fine")])
    finally:
        logger.removeHandler(keep)


@pytest.mark.parametrize(
    "errors, calls, outcome",
    [
        ([TrainingInterrupted("rank 1 died without a record")], 2, "done"),  # retried, resumed, finished
        ([TrainingInterrupted("killed")] * 3, 3, TrainingInterrupted),  # step.retries (2) spent: the last error
        ([ConfigError("align.sft.lr: must be > 0")], 1, ConfigError),  # would fail the same way: not retried
    ],
)
def test_a_local_run_retries_a_step_as_prefect_does(monkeypatch, errors: list[Exception], calls: int, outcome) -> None:
    """Before: `lmforge run --local` (and every test that runs stages without Prefect) failed on the first
    killed or aborted rank, where the Prefect task run retries and resumes; a CI run failed on one SIGABRT."""
    from types import SimpleNamespace

    from lmforge.engine import executor

    seen: list[int] = []

    def execute_step(step, config, store, upstream, run_units):  # type: ignore[no-untyped-def]
        seen.append(1)
        if len(seen) <= len(errors):
            raise errors[len(seen) - 1]
        return {"key": "k"}, False

    monkeypatch.setattr(executor, "execute_step", execute_step)
    step = SimpleNamespace(name="align/dpo", retries=2)
    if outcome == "done":
        assert executor.execute_with_retries(step, None, None, {}, None, delay_s=0) == ({"key": "k"}, False)  # type: ignore[arg-type]
    else:
        with pytest.raises(outcome):
            executor.execute_with_retries(step, None, None, {}, None, delay_s=0)  # type: ignore[arg-type]
    assert len(seen) == calls

"""Log records of units that run in worker processes come back to the parent, on failure too."""

from __future__ import annotations

import concurrent.futures as cf
import logging

import pytest

from lmforge.executor import unit_outcome


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

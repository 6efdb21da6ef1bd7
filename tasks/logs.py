"""Make `logging.getLogger(__name__)` in the domain packages reach the Prefect UI and the console.

Each domain logger gets Prefect's API handler (records emitted inside a flow or task run
are shipped to the run's log, every record at `runtime.log_level`) and a console handler: every
record on stderr, except while the CLI shows a run (`lmforge.console.terminal`), which then
decides what reaches the terminal (warnings and errors; everything with -v). Prefect
configures its own loggers lazily, so copying `prefect.extra`'s handlers at import time
(what PREFECT_LOGGING_EXTRA_LOGGERS does) would find none; explicit handlers work
whenever this runs, in the CLI, in tests and in deployment runners alike.
"""

from __future__ import annotations

import logging

from lmforge.console import ConsoleHandler
from lmforge.engine.executor import domain_loggers

CONSOLE_FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s"


class _InRunOnly(logging.Filter):
    """Records outside any flow or task run have no run to attach to; keep them off the API."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class _NoTracebackForExpectedFailures(logging.Filter):
    """Prefect logs a failed run with its traceback. For lmforge's non-retryable errors
    (configuration, divergence, parity, a rank's own crash) the one-line message is the whole
    story and the traceback only buries it; LMFORGE_DEBUG=1 keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        import os

        from lmforge.errors import LmforgeError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, LmforgeError) and not error.retryable and not os.environ.get("LMFORGE_DEBUG"):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_expected_failures() -> None:
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForExpectedFailures) for f in logger.filters):
            logger.addFilter(_NoTracebackForExpectedFailures())


def connect_library_loggers(level: str = "INFO") -> None:
    from prefect.logging.handlers import APILogHandler

    api = APILogHandler()
    api.addFilter(_InRunOnly())
    console = ConsoleHandler(fmt=CONSOLE_FORMAT, datefmt="%H:%M:%S")
    for name in domain_loggers():
        logger = logging.getLogger(name)
        if any(isinstance(h, APILogHandler) for h in logger.handlers):
            continue
        logger.setLevel(level)
        logger.addHandler(api)
        logger.addHandler(console)
        logger.propagate = False


def set_library_log_level(level: str) -> None:
    """Apply `runtime.log_level` to lmforge's loggers here and in the training ranks it launches."""
    import os

    for name in domain_loggers():
        logging.getLogger(name).setLevel(level)
    os.environ["LMFORGE_LOG_LEVEL"] = level

"""Make `logging.getLogger(__name__)` in the domain packages reach the Prefect UI.

Prefect sends records of the `prefect.extra` logger to the API; giving our loggers the
same handlers (what PREFECT_LOGGING_EXTRA_LOGGERS does at import time) works however and
whenever prefect was imported. Records emitted outside any flow or task run (the
orchestrator-free executor, worker start-up) go to the console only.
"""

from __future__ import annotations

import logging

LIBRARY_LOGGERS = ("lmforge", "data_prep", "training", "evaluation", "serving")


class _InRunOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def connect_library_loggers(level: str = "INFO") -> None:
    from prefect.logging.handlers import APILogHandler

    source = logging.getLogger("prefect.extra")
    for handler in source.handlers:
        if isinstance(handler, APILogHandler) and not any(isinstance(f, _InRunOnly) for f in handler.filters):
            handler.addFilter(_InRunOnly())
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in source.handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = False

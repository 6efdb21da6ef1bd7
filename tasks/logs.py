"""Make `logging.getLogger(__name__)` in the domain packages reach the Prefect UI.

Prefect sends records of the `prefect.extra` logger to the API; giving our loggers the
same handlers (what PREFECT_LOGGING_EXTRA_LOGGERS does at import time) works however and
whenever prefect was imported.
"""

from __future__ import annotations

import logging

LIBRARY_LOGGERS = ("lmforge", "data_prep", "training", "evaluation", "serving")


def connect_library_loggers(level: str = "INFO") -> None:
    source = logging.getLogger("prefect.extra")
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in source.handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = False

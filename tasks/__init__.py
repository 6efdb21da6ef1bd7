"""Thin Prefect wrappers around the domain: cache keys, retries, artifacts and logging.

No domain logic lives here; every task calls into `lmforge`, `data_prep` or `training`.
Importing this package routes the domain packages' loggers to the Prefect UI and keeps
tracebacks out of the log for failures whose one-line message says it all.
"""

from tasks.logs import connect_library_loggers, quiet_expected_failures

connect_library_loggers()
quiet_expected_failures()

"""Thin Prefect wrappers around the domain: cache keys, retries, artifacts and logging.

No domain logic lives here; every task calls into `lmforge`, `data_prep` or `training`.
Importing this package routes the domain packages' loggers to the Prefect UI.
"""

from tasks.logs import connect_library_loggers

connect_library_loggers()

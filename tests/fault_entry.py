"""An entry module for the launcher's tests: the rank `spec["abort_rank"]` dies of SIGABRT, as a C++
library's std::terminate does, inside `tear_down_badly`; the other ranks finish."""

from __future__ import annotations

import os
import sys
from typing import Any

from lmforge.processes.entry import main


def tear_down_badly() -> None:
    os.abort()


def work(spec: dict[str, Any], rank: int) -> None:
    if rank == spec["abort_rank"]:
        tear_down_badly()


if __name__ == "__main__":
    sys.exit(main(work))

"""An entry module for the launcher's tests: the rank `spec["abort_rank"]` dies of SIGABRT, as a C++
library's std::terminate does, inside `tear_down_badly`; the other ranks finish. It aborts only once
the others have recorded their outcome: on a loaded host rank 0 was still importing when rank 1
aborted, and torchrun then stopped it before it could record (2 ranks without a record, not 1)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from lmforge.processes.entry import EXIT_RECORD, main


def tear_down_badly() -> None:
    os.abort()


def work(spec: dict[str, Any], rank: int) -> None:
    if rank == spec["abort_rank"]:
        # the launcher puts both in every spec (lmforge.processes.launch)
        attempt_dir, world = Path(spec["attempt_dir"]), int(spec["world_size"])
        others = [attempt_dir / EXIT_RECORD.format(rank=r) for r in range(world) if r != rank]
        deadline = time.monotonic() + 120
        while not all(p.exists() for p in others) and time.monotonic() < deadline:
            time.sleep(0.05)
        tear_down_badly()


if __name__ == "__main__":
    sys.exit(main(work))

"""The adapter release's parity check, in a process of its own.

    python -m serving.parity_entry --spec <release>/logs/parity_spec.json   (via lmforge.processes.launch.run_entry)

For each adapter of the release: the max |logit difference| between the served base + the stacked
adapter (peft) and the role's merged model, written to `spec["result"]`. A fresh process, because
the answer must depend on the files alone: the flow process that runs the release has run other
steps in threads, and a transformers load interleaved with another there can leave the process
building models with an uninitialized head (issue 57; `lmforge.inference.hf_load`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from lmforge.processes.entry import main


def check(spec: dict[str, Any], rank: int) -> None:
    from lmforge.hashing import atomic_write_json
    from serving.adapters import parity

    gaps = {}
    for item in spec["adapters"]:
        gap = parity(Path(item["root"]), Path(item["adapter"]), Path(item["merged"]))
        gaps[item["role"]] = gap if math.isfinite(gap) else str(gap)  # JSON has no NaN
    atomic_write_json(Path(spec["result"]), gaps)


if __name__ == "__main__":
    sys.exit(main(check, quiet=("transformers", "peft")))

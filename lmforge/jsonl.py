"""JSON Lines files that lmforge writes and reads back itself: one JSON object per line, UTF-8.

`write_jsonl` writes atomically (temp file + rename), so a reader never sees half a file.
`read_jsonl` is strict: a malformed line raises. It reads what lmforge wrote (step outputs,
lm-eval's samples) and small files a user points a setting at; corpora are read by
`lmforge.inputs`, which quarantines malformed records instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lmforge.hashing import atomic_write_text


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Each line's object, in order; blank lines are skipped."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)

"""The document record, its Parquet shard layout, and small helpers to read/write shards.

Every step after ingest reads documents from Parquet shards with these columns, and
writes per-document attributes as Parquet files with the same row order (Dolma style), so
attributes join to documents by shard name and row.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DOC_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("domain", pa.string()),
        ("url", pa.string()),
        ("meta", pa.string()),
        ("text_hash", pa.string()),
        ("url_norm", pa.string()),
        ("n_chars", pa.int64()),
        ("origin", pa.string()),
    ]
)


def write_table(path: Path, table: pa.Table) -> None:
    """Write Parquet atomically (temp + rename) so a crash never leaves half a shard."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)


def write_arrays(path: Path, columns: dict[str, Any]) -> None:
    """Named numpy columns as one `.npz`, written atomically (temp + rename)."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    with open(tmp, "wb") as handle:
        np.savez(handle, **columns)
    tmp.replace(path)


def temp_path(path: Path) -> Path:
    """A hidden sibling no other writer (process or thread) can be using at the same time."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def write_rows(path: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    write_table(path, pa.Table.from_pylist(rows, schema=schema))


def read_columns(path: Path, columns: list[str] | None = None) -> dict[str, list[Any]]:
    return pq.read_table(path, columns=columns).to_pydict()


def iter_rows(path: Path, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
    table = pq.read_table(path, columns=columns)
    yield from table.to_pylist()


def shard_path(directory: Path, shard: str) -> Path:
    return directory / "docs" / f"{shard}.parquet"


def shard_names(manifest: dict[str, Any]) -> list[str]:
    """Shard names recorded by the ingest step, in corpus order."""
    return [s["name"] for s in manifest["extra"]["shards"]]


def dumps_meta(meta: Any) -> str:
    return json.dumps(meta, ensure_ascii=False, sort_keys=True, default=str) if meta else ""

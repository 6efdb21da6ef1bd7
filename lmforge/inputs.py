"""Reading users' input files: which files a list of paths and globs stands for, and their records.

Inputs are JSONL (plain, .gz, .zst), Parquet, folders of .txt files, and Hugging Face
datasets (saved to disk, or `hf:NAME` when a hub is reachable). Curation ingests its documents
through these readers and alignment its SFT and preference records, so both accept the same
forms and fail the same way. A reader never raises for a malformed record: it yields a `Raw`
with a `problem` (bad JSON, invalid UTF-8, a truncated file), which the caller quarantines
with `quarantine_record`.
"""

from __future__ import annotations

import base64
import glob
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from lmforge.errors import ConfigError, DataError, SourceUnavailable

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".ndjson")


DATA_SUFFIXES = (*JSONL_SUFFIXES, ".parquet")
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_hf_dataset(path: str) -> bool:
    return path.startswith("hf:") or (
        os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in HF_MARKERS)
    )


def _expand_folder(folder: str) -> list[str]:
    """A plain folder: every JSONL/Parquet file under it, plus the folder itself if it holds .txt files."""
    root = Path(folder)
    files = sorted(str(p) for p in root.rglob("*") if p.is_file() and p.name.endswith(DATA_SUFFIXES))
    has_text = next(root.rglob("*.txt"), None) is not None
    if not files and not has_text:
        raise ConfigError(
            f"folder {folder} holds no .jsonl(.gz/.zst), .parquet or .txt files and is not a saved Hugging Face dataset"
        )
    return files + ([folder] if has_text else [])


def expand_inputs(patterns: list[str]) -> list[str]:
    """Input files matching the patterns, sorted within each pattern, duplicates dropped.

    A folder that is not a saved Hugging Face dataset stands for the data files under it
    (and, if it has .txt files, for those as one text-folder input).
    """
    found: list[str] = []
    for pattern in patterns:
        if pattern.startswith(("hf:", "builtin:")):  # a hub dataset, a built-in source (data_prep.sources)
            found.append(pattern)
            continue
        for match in sorted(os.path.normpath(m) for m in glob.glob(os.path.expanduser(pattern), recursive=True)):
            paths = _expand_folder(match) if os.path.isdir(match) and not is_hf_dataset(match) else [match]
            found.extend(p for p in paths if p not in found)
    # a text folder is read recursively: a folder inside another one (from "data/**", or listed
    # beside its parent) would read the same .txt files twice
    folders = [p for p in found if os.path.isdir(p) and not is_hf_dataset(p)]
    nested = {p for p in folders if any(p != f and Path(p).is_relative_to(f) for f in folders)}
    return [p for p in found if p not in nested]


@dataclass
class Raw:
    """One input record before validation: where it came from and what was there."""

    origin: str
    line: int
    data: Any = None
    problem: str | None = None
    raw: bytes = b""


class _ZstdReader(io.RawIOBase):
    """Decompressed bytes of a .zst file, frame after frame; EOFError if the last frame breaks off.

    zstandard's `stream_reader` returns a clean end of file for a truncated frame, which would
    lose the rest of the file without a trace; `decompressobj` tells whether a frame ended.
    """

    def __init__(self, path: str) -> None:
        import zstandard

        self._zstd = zstandard
        self._file = open(path, "rb")
        self._decoder = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""
        self._started = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        while not self._pending:
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._started and not self._decoder.eof:
                    raise EOFError("compressed file ended before the end of its zstd frame")
                return 0
            self._started = True
            self._pending = self._decoder.decompress(chunk)
            while self._decoder.eof and self._decoder.unused_data:  # the next frame of a multi-frame file
                rest = self._decoder.unused_data
                self._decoder = self._zstd.ZstdDecompressor().decompressobj()
                self._pending += self._decoder.decompress(rest)
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_binary(path: str) -> BinaryIO:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path))  # type: ignore[return-value]
    return open(path, "rb")


def _read_jsonl(path: str) -> Iterator[Raw]:
    import zstandard

    try:
        yield from _jsonl_lines(path)
    except (EOFError, OSError, ValueError, zstandard.ZstdError) as exc:  # truncated .gz/.zst, corrupt data
        yield Raw(path, -1, problem=f"unreadable_file ({type(exc).__name__}: {exc}); records after this point are lost")


def _jsonl_lines(path: str) -> Iterator[Raw]:
    with _open_binary(path) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield Raw(path, number, problem=f"invalid_utf8 (byte {exc.start})", raw=line)
                continue
            try:
                yield Raw(path, number, data=json.loads(text), raw=line)
            except json.JSONDecodeError as exc:
                yield Raw(path, number, problem=f"invalid_json ({exc.msg} at column {exc.colno})", raw=line)


def _read_parquet(path: str) -> Iterator[Raw]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield Raw(path, number, data=row)
    except (pa.ArrowException, OSError) as exc:  # not Parquet, truncated, corrupt row group
        yield Raw(
            path, -1, problem=f"unreadable_file ({type(exc).__name__}: {exc}); records after row {number} are lost"
        )


def _read_text_folder(path: str) -> Iterator[Raw]:
    root = Path(path)
    for file in sorted(root.rglob("*.txt")):
        data = file.read_bytes()
        rel = str(file.relative_to(root))
        try:
            yield Raw(
                str(file), 1, data={"id": f"{root.name}/{rel}", "text": data.decode("utf-8"), "source": root.name}
            )
        except UnicodeDecodeError as exc:
            yield Raw(str(file), 1, problem=f"invalid_utf8 (byte {exc.start})", raw=data[:4096])


def _read_hf_dataset(path: str) -> Iterator[Raw]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{path}: reading Hugging Face datasets needs the `datasets` package") from None
    try:
        if path.startswith("hf:"):
            name, _, revision = path[3:].partition("@")
            dataset = datasets.load_dataset(name, split="train", revision=revision or None)
        else:
            dataset = datasets.load_from_disk(path)
    except Exception as exc:  # hub unreachable, bad folder: one clear line, no traceback
        message = f"{path}: cannot load Hugging Face dataset ({type(exc).__name__}: {exc})"
        # a hub that does not answer may answer on the next attempt; a damaged local folder will not
        raise (SourceUnavailable if path.startswith("hf:") else DataError)(message) from None
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    for number, row in enumerate(dataset, start=1):
        yield Raw(path, number, data=row)


def hub_revision(path: str) -> str:
    """The commit a `hf:NAME[@REVISION]` input resolves to, for its cache key.

    A pinned revision is used as given; otherwise the hub is asked for the dataset's current
    commit, so a dataset updated upstream gets a new key. An unreachable hub is retryable.
    """
    name, _, revision = path[3:].partition("@")
    if revision:
        return f"hf:{name}@{revision}"
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(name, timeout=20).sha
    except Exception as exc:  # offline, unknown dataset, rate limit: one line, no traceback
        raise SourceUnavailable(
            f"{path}: cannot resolve the dataset's revision for its cache key "
            f"({type(exc).__name__}: {exc}); pin one as hf:{name}@REVISION"
        ) from None
    return f"hf:{name}@{sha}"


def read_input(path: str) -> Iterator[Raw]:
    """Dispatch on the input's form."""
    if is_hf_dataset(path):
        return _read_hf_dataset(path)
    if os.path.isdir(path):
        return _read_text_folder(path)
    if path.endswith(".parquet"):
        return _read_parquet(path)
    if path.endswith(JSONL_SUFFIXES) or path.endswith((".json", ".gz", ".zst")):
        return _read_jsonl(path)
    raise ConfigError(
        f"{path}: unsupported input format (use .jsonl[.gz|.zst], .parquet, a folder of .txt, or a HF dataset)"
    )


def quarantine_record(raw: Raw, reason: str) -> dict[str, Any]:
    """What is kept of a bad record: enough to find it, see it and fix it."""
    record: dict[str, Any] = {"file": raw.origin, "line": raw.line, "reason": reason}
    if raw.raw:
        record["raw"] = raw.raw.decode("utf-8", errors="replace").rstrip("\n")
        record["raw_base64"] = base64.b64encode(raw.raw).decode()
    else:
        record["raw"] = repr(raw.data)[:10_000]
    return record

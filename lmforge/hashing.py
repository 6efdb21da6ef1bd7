"""Canonical JSON, stable digests and file checksums used for cache identity."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the same data always gives the same bytes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def digest(obj: Any, length: int = 16) -> str:
    """Short hex SHA-256 of an object's canonical JSON."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def folder_digest(folder: Path, file_hash: Callable[[Path], str] = file_sha256) -> str:
    """A folder's content (relative paths and bytes, hidden files and caches aside): a user's task
    folder, a judge model's folder. Not where it lies. `file_hash` may be a `FingerprintCache`'s
    `file` (the same SHA-256, remembered), for folders of model weights. It lives here, a leaf, so
    that a step that digests a folder does not take the judge's imports into its code identity."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(folder).parts)
    )
    return digest([(str(p.relative_to(folder)), file_hash(p)) for p in files], 32)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay whole values."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}{key}."))
        if not obj and prefix:
            out[prefix[:-1]] = {}
        return out
    return {prefix[:-1]: obj}


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp file in the same directory, fsync, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


class FingerprintCache:
    """Content fingerprints of input files, re-hashed only when size/mtime/inode change.

    Cache identity should follow content, not paths or timestamps, but re-reading a large
    corpus on every run to prove nothing changed would be slow (DVC does the same).
    """

    def __init__(self, path: Path):
        self.path = path
        try:
            self._entries: dict[str, Any] = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self._entries = {}

    def file(self, file: Path) -> str:
        stat = file.stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        key = str(file.resolve())
        entry = self._entries.get(key)
        if entry and entry["stamp"] == stamp:
            return entry["sha256"]
        sha = file_sha256(file)
        self._entries[key] = {"stamp": stamp, "sha256": sha}
        return sha

    def path_fingerprint(self, path: str) -> str:
        """A file's SHA-256, or for a folder a digest over its files' relative names and SHA-256s."""
        target = Path(path)
        if target.is_dir():
            files = sorted(p for p in target.rglob("*") if p.is_file())
            return digest([(str(p.relative_to(target)), self.file(p)) for p in files], length=64)
        return self.file(target)

    def save(self) -> None:
        atomic_write_json(self.path, self._entries)


_FINGERPRINTS: dict[str, FingerprintCache] = {}


def fingerprints(workspace: str | Path) -> FingerprintCache:
    """The workspace's input-file fingerprints, shared within a process (curation's and alignment's
    inputs alike); saved by the step that reads them."""
    path = Path(workspace).resolve() / ".cache" / "fingerprints.json"
    if str(path) not in _FINGERPRINTS:
        _FINGERPRINTS[str(path)] = FingerprintCache(path)
    return _FINGERPRINTS[str(path)]

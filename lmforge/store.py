"""The content-addressed stage store: `<workspace>/<step>/<key>/` plus its manifest.

A step output is complete when `manifest.json` exists and every file it lists still has
its recorded size and SHA-256. The manifest is written last and atomically, so a crash
leaves either no manifest (recompute) or a whole one. Long steps split their work into
units (shards); each finished unit leaves a marker under `.units/` with checksums of its
files, so an interrupted step resumes with the units it had not finished.

Bookkeeping files start with a dot and are never part of a step's outputs.

Each output is hashed once per run, not once per look: a verified output is remembered
with the size, modification time and inode of its manifest and every file, and is only
hashed again when one of those changes (or when `forget_verified` starts a new run).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Literal

from lmforge.hashing import atomic_write_json, digest, file_sha256

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
UNITS = ".units"
VerifyMode = Literal["checksum", "size"]


def list_outputs(directory: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Relative paths of all output files.

    Hidden files, the manifest and top-level folders named in `exclude` (state that verifies
    itself, such as training checkpoints, or logs that change on every attempt) are left out.
    """
    found = []
    for root, dirs, files in os.walk(directory):
        rel_root = Path(root).relative_to(directory)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                         and not (rel_root == Path(".") and d in exclude))
        for name in sorted(files):
            if name.startswith(".") or (rel_root == Path(".") and name == MANIFEST):
                continue
            found.append(str(rel_root / name) if rel_root != Path(".") else name)
    return found


def describe_files(directory: Path, rel_paths: list[str]) -> dict[str, dict[str, Any]]:
    return {
        rel: {"size": (directory / rel).stat().st_size, "sha256": file_sha256(directory / rel)}
        for rel in rel_paths
    }


def outputs_digest(outputs: dict[str, dict[str, Any]], prefixes: tuple[str, ...] | None = None) -> str:
    """The fingerprint downstream keys use: a digest of file names and contents only.

    `prefixes` limits it to the deliverable (a trained model's weights, not its timing logs),
    so downstream steps are not invalidated by bytes that carry no meaning for them.
    """
    chosen = [(rel, meta["sha256"]) for rel, meta in outputs.items()
              if prefixes is None or rel.startswith(prefixes)]
    return digest(sorted(chosen), length=32)


_verified: dict[str, tuple[Any, ...]] = {}  # output dir -> stat signature at its last verification
_verified_lock = threading.Lock()


def _signature(directory: Path, rel_paths: list[str]) -> tuple[Any, ...] | None:
    """(size, mtime, inode) of the manifest and every listed file; None if one is missing."""
    try:
        stats = [os.stat(directory / rel) for rel in [MANIFEST, *rel_paths]]
    except OSError:
        return None
    return tuple((st.st_size, st.st_mtime_ns, st.st_ino) for st in stats)


def forget_verified() -> None:
    """Start a new run: every output is hashed again the next time it is checked."""
    with _verified_lock:
        _verified.clear()


def verify_files(directory: Path, files: dict[str, dict[str, Any]], mode: VerifyMode) -> str | None:
    """None when every listed file is intact; otherwise a one-line description of the first problem."""
    for rel, meta in files.items():
        path = directory / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return f"missing file {rel}"
        if size != meta["size"]:
            return f"size of {rel} changed ({meta['size']} -> {size} bytes)"
        if mode == "checksum" and file_sha256(path) != meta["sha256"]:
            return f"checksum of {rel} does not match"
    return None


class StageStore:
    """Locates, verifies and records step outputs under one workspace."""

    def __init__(self, workspace: str | os.PathLike[str], verify: VerifyMode = "checksum"):
        self.root = Path(workspace).resolve()
        self.verify_mode: VerifyMode = verify

    def step_dir(self, step: str, key: str) -> Path:
        return self.root / step / key

    def read_manifest(self, directory: Path) -> dict[str, Any] | None:
        try:
            return json.loads((directory / MANIFEST).read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            log.warning("unreadable manifest in %s; treating output as incomplete", directory)
            return None

    def check(self, step: str, key: str) -> tuple[dict[str, Any] | None, str]:
        """(manifest, reason): the manifest when the output is complete and intact, else None and why."""
        directory = self.step_dir(step, key)
        if not directory.exists():
            return None, "no output with this key yet"
        manifest = self.read_manifest(directory)
        if manifest is None:
            return None, "output directory exists but has no manifest (partial run)"
        files = manifest.get("outputs", {})
        signature = _signature(directory, list(files))
        with _verified_lock:
            known = signature is not None and _verified.get(str(directory)) == signature
        if not known:
            problem = verify_files(directory, files, self.verify_mode)
            if problem:
                return None, f"output is damaged: {problem}"
            if signature is not None:
                with _verified_lock:
                    _verified[str(directory)] = signature
        manifest["dir"] = str(directory)  # where it is now, even if the workspace was moved
        return manifest, "complete and verified"

    def finish(self, directory: Path, manifest: dict[str, Any], exclude: tuple[str, ...] = (),
               digest_prefixes: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Checksum every output (the one hashing of this run), add the digest, write the manifest last."""
        outputs = describe_files(directory, list_outputs(directory, exclude))
        manifest = {**manifest, "outputs": outputs, "digest": outputs_digest(outputs, digest_prefixes)}
        atomic_write_json(directory / MANIFEST, manifest)
        signature = _signature(directory, list(outputs))
        if signature is not None:
            with _verified_lock:
                _verified[str(directory)] = signature
        return manifest

    def invalidate(self, directory: Path) -> None:
        """Remove the manifest of a damaged output so it can never be mistaken for complete."""
        with _verified_lock:
            _verified.pop(str(directory), None)
        with contextlib.suppress(FileNotFoundError):
            (directory / MANIFEST).unlink()

    # -- per-unit completion markers (resume mid-step) --------------------------------------

    def unit_result(self, directory: Path, unit: str) -> dict[str, Any] | None:
        marker = directory / UNITS / f"{unit}.json"
        try:
            record = json.loads(marker.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        if verify_files(directory, record["files"], self.verify_mode):
            log.info("unit %s of %s is damaged; recomputing it", unit, directory)
            marker.unlink(missing_ok=True)
            return None
        return record["result"]

    def mark_unit(self, directory: Path, unit: str, files: list[str], result: dict[str, Any]) -> None:
        record = {"files": describe_files(directory, files), "result": result, "at": time.time()}
        atomic_write_json(directory / UNITS / f"{unit}.json", record)

    # -- history, for `lmforge explain` -----------------------------------------------------

    def record_use(self, step: str, manifest: dict[str, Any]) -> None:
        atomic_write_json(self.root / step / ".latest.json", {"key": manifest["key"], "at": time.time()})

    def latest(self, step: str) -> dict[str, Any] | None:
        """The manifest of the step output most recently produced or reused, if still present."""
        try:
            key = json.loads((self.root / step / ".latest.json").read_text())["key"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None
        return self.read_manifest(self.step_dir(step, key))

    def lock_path(self, step: str, key: str) -> Path:
        return self.root / step / f".{key}.lock"

    @contextlib.contextmanager
    def lock(self, step: str, key: str) -> Iterator[int]:
        """An exclusive lock so two runs of the same key do not both compute it; yields its fd.

        The subprocesses a step launches are supervised by a process that holds a duplicate of
        this fd (`lmforge.launcher`), so even if this process dies the lock is only released
        once every process the step started is gone.
        """
        path = self.lock_path(step, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("%s/%s is being computed by another run; waiting for it", step, key)
                fcntl.flock(handle, fcntl.LOCK_EX)
            yield handle.fileno()


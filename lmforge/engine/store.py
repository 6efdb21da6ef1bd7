"""The content-addressed stage store: `<workspace>/<step>/<key>/` plus its manifest.

A step output is complete when `manifest.json` exists and every file it lists still has
its recorded size and SHA-256. The manifest is written last and atomically, so a crash
leaves either no manifest (recompute) or a whole one. Long steps split their work into
units (shards); each finished unit leaves a marker under `.units/` with checksums of its
files, so an interrupted step resumes with the units it had not finished.

Bookkeeping files start with a dot and are never part of a step's outputs.

With `runtime.verify: checksum` a file's SHA-256 is computed once, not on every run: beside
the manifest, `.verified.json` records each file's stat stamp (size, mtime_ns, ctime_ns,
inode, device) with the digest it was verified against, and a file is hashed again whenever
any of those changed -- a write, a truncation, a copy, a replacement, even one that restores
the old mtime (ctime cannot be set back). This is the stat cache of git's index, DVC and
make. A file modified in the last seconds before it was stamped is not trusted ("racily
clean", as git calls it): it is hashed again next time. Deleting an output's
`.verified.json` makes the next run hash all of its files again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.engine.remote import PUBLISHED
from lmforge.engine.workspace import LocalStore, VerifyMode, Workspace
from lmforge.hashing import atomic_write_json, digest, file_sha256

if TYPE_CHECKING:
    from lmforge.engine.remote import CheckpointMirror
    from lmforge.engine.workspace import Store

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
UNITS = ".units"


def list_outputs(directory: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Relative paths of all output files.

    Hidden files, the manifest and top-level folders named in `exclude` (state that verifies
    itself, such as training checkpoints, or logs that change on every attempt) are left out.
    """
    found = []
    for root, dirs, files in os.walk(directory):
        rel_root = Path(root).relative_to(directory)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (rel_root == Path(".") and d in exclude))
        for name in sorted(files):
            if name.startswith(".") or (rel_root == Path(".") and name == MANIFEST):
                continue
            found.append(str(rel_root / name) if rel_root != Path(".") else name)
    return found


VERIFIED = ".verified.json"
IN_USE: set[Path] = set()  # what no store of this process evicts from a working copy (`StageStore.used`)
RACY_NS = 2_000_000_000  # a file modified this close to its stamp may still change within the same timestamp tick


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _read_stamps(directory: Path) -> dict[str, list[Any]]:
    try:
        stamps = json.loads((directory / VERIFIED).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def _write_stamps(directory: Path, stamps: dict[str, list[Any]]) -> None:
    try:
        atomic_write_json(directory / VERIFIED, stamps)
    except OSError as exc:  # a read-only workspace: verification still holds, it is only not remembered
        log.debug("could not record verified files in %s: %s", directory, exc)


def settled(st: os.stat_result, now_ns: int) -> bool:
    """False for a file changed so recently that a later write could keep its stamp ("racily clean")."""
    return now_ns - max(st.st_mtime_ns, st.st_ctime_ns) >= RACY_NS


def describe_files(
    directory: Path, rel_paths: list[str], stamps: dict[str, list[Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each file; `stamps` (when given) receives the stat stamps of those it may trust later."""
    described = {}
    now = time.time_ns()
    for rel in rel_paths:
        st = (directory / rel).stat()  # before hashing: a write during the hash changes the stamp
        described[rel] = {"size": st.st_size, "sha256": file_sha256(directory / rel)}
        if stamps is not None and settled(st, now):
            stamps[rel] = [*_stamp(st), described[rel]["sha256"]]
    return described


def outputs_digest(outputs: dict[str, dict[str, Any]], prefixes: tuple[str, ...] | None = None) -> str:
    """The fingerprint downstream keys use: a digest of file names and contents only.

    `prefixes` limits it to the deliverable (a trained model's weights, not its timing logs),
    so downstream steps are not invalidated by bytes that carry no meaning for them.
    """
    chosen = [(rel, meta["sha256"]) for rel, meta in outputs.items() if prefixes is None or rel.startswith(prefixes)]
    return digest(sorted(chosen), length=32)


def verify_outputs(directory: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """`verify_files` in checksum mode, hashing only files whose stat stamp changed since they were verified."""
    known = _read_stamps(directory)
    fresh: dict[str, list[Any]] = {}
    now = time.time_ns()
    for rel, meta in files.items():
        path = directory / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"missing file {rel}"
        if st.st_size != meta["size"]:
            return f"size of {rel} changed ({meta['size']} -> {st.st_size} bytes)"
        stamp = [*_stamp(st), meta["sha256"]]
        if known.get(rel) != stamp:
            if file_sha256(path) != meta["sha256"]:
                return f"checksum of {rel} does not match"
            if not settled(st, now):
                continue
        fresh[rel] = stamp
    if fresh != known:
        _write_stamps(directory, fresh)
    return None


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


def relocated(recorded: str | os.PathLike[str], key: str, directory: Path) -> Path:
    """A path an output recorded inside itself (`.../<key>/...`, as the machine and folder that made it
    wrote it), under `directory`: where that output is here. A path outside the output is kept."""
    parts = Path(recorded).parts
    if key not in parts:
        return Path(recorded)
    inside = parts[parts.index(key) + 1 :]
    if any(part in ("..", ".") for part in inside):  # a recorded path is data: it never leaves its output
        from lmforge.errors import UntrustedName

        raise UntrustedName(f"{directory}: refused the recorded path {str(recorded)[:200]!r}: it leaves its output")
    return directory.joinpath(*inside)


class StageStore:
    """Locates, verifies and records step outputs in one workspace's folder (a local workspace, or this
    machine's working copy of a shared one), and speaks to the workspace's `store`
    (`lmforge.engine.workspace.Store`) for what the folder lacks or makes: fetched from it, committed to it."""

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        verify: VerifyMode = "checksum",
        store: Store | None = None,
        fetch: bool = True,
    ):
        self.root = Path(workspace).expanduser().resolve()
        self.verify_mode: VerifyMode = verify
        self.store: Store = store if store is not None else LocalStore(self.root)
        # False (explain, planning): read-only. An output on the store counts as there, nothing is
        # downloaded, nothing uploaded (an output made here and not yet published stays so), and the
        # working copy is not bounded (no eviction, no use recorded)
        self.fetch = fetch
        # outputs this process's run reused or made, and the inputs of the step it computes: never evicted
        # from the working copy. One set for every store of the process: the stores the judge, the answer
        # sets and the safety gate open inside a step evict too, and removed that step's inputs
        self.used = IN_USE

    @classmethod
    def for_config(cls, config: Any, fetch: bool = True) -> StageStore:
        """The outputs of `config.workspace`; its shared store, if any, is checked first (`Workspace.check`)."""
        workspace = Workspace.of(config)
        workspace.check(fetch)
        return cls(workspace.root, workspace.verify, workspace.store, fetch)

    @property
    def remote(self) -> Store | None:
        """The shared store behind the working copy, None for a local workspace."""
        return self.store if self.store.shared else None

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
        """(manifest, reason): the manifest when the output is complete and intact, else None and why.
        With a remote workspace, an output the working copy lacks is fetched from the store when it is
        there; one made here that is not on the store yet (its upload failed) is published."""
        manifest, reason = self._check_local(step, key)
        directory = self.step_dir(step, key)
        if manifest is not None:
            if self.fetch and not (directory / PUBLISHED).exists():  # made here, not yet on the store
                manifest = self._publish(step, key, directory, manifest)
        else:
            stored = self.store.manifest(step, key)
            if stored is None:
                return None, reason
            if not self.fetch:
                return self._located({**stored, "dir": str(directory)}, step, key), "on the store"
            problem = self._fetch(step, key, directory, stored)
            if problem:
                return None, f"output on the store is damaged: {problem}"
            # fetch verified every listed file against its digest: hashing them all again here would double it
            manifest, reason = {**stored, "dir": str(directory)}, f"fetched from {self.store.url}"
        if self.fetch:
            self._used(directory, grew=reason.startswith("fetched"))
        return self._located(manifest, step, key), reason

    def _located(self, manifest: dict[str, Any], step: str, key: str) -> dict[str, Any]:
        """A manifest of a shared store names where every machine finds its output (`url`)."""
        if self.store.shared:
            manifest["url"] = self.store.url_of(step, key)
        return manifest

    def current_on_store(
        self, step: str, key: str, current: Callable[[dict[str, Any]], bool]
    ) -> tuple[dict[str, Any] | None, str]:
        """For a working copy whose output of `key` was made by other code (drift): the store's output of
        the key when `current(manifest)` holds for it (another machine computed it again), fetched in place
        of the stale copy (only its manifest when this store does not fetch); else (None, why)."""
        stored = self.store.manifest(step, key)
        if stored is None or not current(stored):
            return None, "the store holds no output of this key made by the current code"
        directory = self.step_dir(step, key)
        if not self.fetch:
            return self._located({**stored, "dir": str(directory)}, step, key), "on the store"
        shutil.rmtree(directory, ignore_errors=True)  # the stale copy: nothing of it is kept
        problem = self._fetch(step, key, directory, stored)
        if problem:
            return None, f"output on the store is damaged: {problem}"
        self._used(directory)
        log.info("%s/%s: the working copy's output was made by other code; the store's, computed again by "
                 "this code, replaces it", step, key)  # fmt: skip
        manifest = self._located({**stored, "dir": str(directory)}, step, key)
        return manifest, f"fetched from {self.store.url} (computed again by the current code)"

    def retract(self, step: str, key: str, stale: Callable[[dict[str, Any]], bool]) -> None:
        """Before computing an output again because its code drifted (`runtime.on_code_drift: rerun`): in a
        remote workspace, withdraw the store's stale output, so the rerun's commit is the one every machine
        finds (it adopted the stale one, and the rerun never converged) and no checkpoint of it is resumed."""
        if self.fetch:
            self.store.retract(step, key, stale)

    def here(self, step: str, key: str, recorded: str | os.PathLike[str]) -> Path:
        """`relocated` into this workspace's copy of `<step>/<key>`, fetched from the store first if need be."""
        if self.store.shared and self.read_manifest(self.step_dir(step, key)) is None:
            manifest, reason = self.check(step, key)
            if manifest is None:
                raise FileNotFoundError(f"{step}/{key}: {reason}")
        return relocated(recorded, key, self.step_dir(step, key))

    def checkpoint_mirror(self, step: str, key: str, bookkeeping: tuple[str, ...]) -> CheckpointMirror | None:
        """For a step that checkpoints (`checkpoints/` in its bookkeeping) in a remote workspace: the
        mirror that restores the store's newest checkpoint before it runs and uploads new ones as it does."""
        from lmforge.engine.remote import CHECKPOINTS

        if CHECKPOINTS not in bookkeeping:
            return None
        return self.store.checkpoints(step, key, self.step_dir(step, key))

    def hold(self, directories: list[Path]) -> None:
        """Outputs a step computing in this process reads or writes: no store of the process evicts them."""
        self.used.update(Path(d) for d in directories)

    def _used(self, directory: Path, grew: bool = True) -> None:
        """Record a use of `directory` (the working copy's LRU order); bound the working copy when it grew
        (an output fetched or made here): a cache hit on what is already here adds nothing, and bounding
        walks every output of the working copy."""
        from lmforge.engine.remote import touch_used

        self.used.add(directory)
        if self.store.shared:  # only a working copy is bounded; a local workspace is the only copy
            touch_used(directory)
        if grew:
            self.store.bound(self.root, self.used)

    def _fetch(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> str | None:
        """`Store.fetch`, then the stat stamps of what it verified: it hashed every file and dated
        them back, so a later write changes their stamps, and the next process hashes none of them."""
        problem = self._inconsistent(step, key, manifest) or self.store.fetch(step, key, directory, manifest)
        if problem is None:
            files = manifest.get("outputs", {})
            _write_stamps(
                directory, {rel: [*_stamp((directory / rel).stat()), m["sha256"]] for rel, m in files.items()}
            )
        return problem

    def _inconsistent(self, step: str, key: str, manifest: dict[str, Any]) -> str | None:
        """Why a manifest from the store does not hold together, or None. Its digest is what downstream keys
        take, so it must be that of the files it lists (a planted one naming other bytes would key a
        downstream step to content it never read). Manifests record the prefixes the digest covers
        (`digest_paths`); one committed before they did is not checked here."""
        where = self.store.url_of(step, key, MANIFEST)
        outputs = manifest.get("outputs", {})
        if not isinstance(outputs, dict) or not all(
            isinstance(m, dict) and isinstance(m.get("sha256"), str) and isinstance(m.get("size"), int)
            for m in outputs.values()
        ):
            return f"{where}: the manifest's outputs are not a table of files with their size and SHA-256"
        if "digest_paths" not in manifest:
            return None
        prefixes = manifest["digest_paths"]
        if prefixes is not None and (not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes)):
            return f"{where}: the manifest's digest_paths are not a list of path prefixes"
        if manifest.get("digest") != outputs_digest(outputs, tuple(prefixes) if prefixes is not None else None):
            return (
                f"{where}: the manifest's digest {str(manifest.get('digest'))[:64]!r} is not that of the files it lists"
            )
        return None

    def _publish(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        committed = self.store.publish(step, key, directory, manifest)
        if committed.get("digest") == manifest.get("digest"):
            return manifest
        # another machine committed this key first (a lease taken over): the store's output is the lineage's
        problem = self._fetch(step, key, directory, committed)
        if problem:
            raise RuntimeError(f"{step}/{key}: {problem}")
        return {**committed, "dir": str(directory)}

    def _check_local(self, step: str, key: str) -> tuple[dict[str, Any] | None, str]:
        directory = self.step_dir(step, key)
        if not directory.exists():
            return None, "no output with this key yet"
        manifest = self.read_manifest(directory)
        if manifest is None:
            return None, "output directory exists but has no manifest (partial run)"
        files = manifest.get("outputs", {})
        if self.verify_mode == "checksum":
            problem = verify_outputs(directory, files)
        else:
            problem = verify_files(directory, files, self.verify_mode)
        if problem:
            return None, f"output is damaged: {problem}"
        manifest["dir"] = str(directory)  # where it is now, even if the workspace was moved
        return manifest, "complete and verified"

    def finish(
        self,
        directory: Path,
        manifest: dict[str, Any],
        exclude: tuple[str, ...] = (),
        digest_prefixes: tuple[str, ...] | None = None,
    ) -> dict[str, Any]:
        """Checksum every output (the one hashing of this run), add the digest, write the manifest last."""
        stamps: dict[str, list[Any]] = {}
        outputs = describe_files(directory, list_outputs(directory, exclude), stamps)
        manifest = {
            **manifest,
            "outputs": outputs,
            "digest": outputs_digest(outputs, digest_prefixes),
            # what the digest covers: a machine fetching the output recomputes it from the files listed
            "digest_paths": list(digest_prefixes) if digest_prefixes is not None else None,
        }
        _write_stamps(directory, stamps)  # before the manifest, which makes the output complete
        atomic_write_json(directory / MANIFEST, manifest)
        step, key = manifest["step"], manifest["key"]
        manifest = self._located(self._publish(step, key, directory, manifest), step, key)
        self._used(directory)
        return manifest

    def invalidate(self, directory: Path) -> None:
        """Remove the manifest of a damaged output so it can never be mistaken for complete."""
        with contextlib.suppress(FileNotFoundError):
            (directory / MANIFEST).unlink()
        with contextlib.suppress(FileNotFoundError):
            (directory / VERIFIED).unlink()

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
        this fd (`lmforge.processes.launcher`), so even if this process dies the lock is only released
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
            # other machines: a lease in the store (held, or released because one of them committed the key)
            with self.store.lease(step, key, lambda: self.store.manifest(step, key) is not None):
                yield handle.fileno()

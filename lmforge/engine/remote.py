"""A workspace on object storage: the content-addressed layout on S3, GCS, Azure (any fsspec URL),
shared by every machine of a pipeline, each working in a local copy of it.

    workspace: s3://bucket/prefix          # runtime.storage: options, local_copy, local_copy_max_gb

`FsspecStore` is such a workspace's `Store` (`lmforge.engine.workspace`): the protocol `StageStore`
speaks to whatever lies beyond the working copy. The layout and its rules are the local store's
(`lmforge.engine.store`): a step output is
`<workspace>/<step>/<key>/` plus `manifest.json`, and the manifest is written last. On a store
with no atomic rename the manifest *is* the commit: it is uploaded after every file it lists, with
a conditional create (S3's `If-None-Match: *`, fsspec's `mode="create"`), so a reader never sees a
half-uploaded output and a second writer never replaces a committed one. Commits are immutable:
each writer uploads its files under a prefix of its own (`<step>/<key>/.a-<random>/`, named by the
manifest's `blobs`), so a machine that loses the race for the manifest never overwrites the
winner's bytes; it removes its own prefix and adopts the winner's output.

A bucket is shared, so what it says is not trusted: every name read from it (a manifest's files,
its `blobs`, a checkpoint listing) must be relative, free of `..` and inside its folder once
resolved, and a manifest must name the step and key it is stored under. Anything else is refused
in one line naming the URL and the entry, before a byte is written (`UntrustedName`).

Steps never read the store directly. They run on this machine's working copy (a folder; training
memory-maps shards and vLLM loads a folder): an output the working copy lacks is downloaded, each
file checked against the manifest's size and SHA-256, and the manifest written locally last; an
output computed here is uploaded when it is finished. The working copy can be bounded: outputs that
are on the store, least recently used first, are removed to stay under `local_copy_max_gb`.

Two machines and one step: whoever creates `<step>/.<key>.lease` first computes it, renewing the
lease while it works; the other waits for the manifest and reuses the output (it downloads it), or
takes over a lease nobody renewed for `lease_s` (a machine that died). Whether a lease was renewed
is judged by whether its content changed while this machine watched it, timed on this machine's
own monotonic clock, never by comparing a timestamp another machine wrote with this one's clock (a
clock running 90 s ahead would steal a live 120 s lease). So the answer to "what if both compute
it" is: one wins, the other reuses; and if both do compute it, the commit rule still keeps one.
A store that refuses conditional creates cannot hold such a lease; the workspace is then refused
with one line before any step runs.

Why by hand: fsspec moves the bytes (its batched, concurrent `put`/`get`); what no library does is
this commit rule over lmforge's manifests, the lease, and the bounded working copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from lmforge.errors import StoreUnreachable, UntrustedName
from lmforge.hashing import atomic_write_json, digest, file_sha256

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PUBLISHED = ".published"  # in a working-copy output: its manifest is on the store (it may be evicted)
USED = ".used"  # touched whenever the output is reused or made: the working copy's LRU order
PROBE = ".lmforge-probe"


def is_remote(workspace: str) -> bool:
    return "://" in workspace


def local_workspace(config: Any) -> Path:
    """The folder steps run in: the workspace itself, or this machine's working copy of a remote one."""
    workspace = str(config.workspace)
    if not is_remote(workspace):
        return Path(workspace)
    storage = config.runtime.storage
    if storage.local_copy:
        return Path(storage.local_copy).expanduser()
    # by endpoint too: one bucket name behind two endpoints is two stores, and a working copy's record of
    # what it published to one says nothing of the other
    endpoint = (storage.options or {}).get("endpoint_url")
    return Path("~/.cache/lmforge/workspaces").expanduser() / digest(
        workspace if not endpoint else f"{workspace} at {endpoint}", length=16
    )


def contained(directory: Path, name: object, where: str) -> Path:
    """`directory / name` for a name read from a shared store: refused (`UntrustedName`, one line naming
    `where` and the entry) unless it is a relative POSIX path with no empty, `.` or `..` part that
    stays inside `directory` once resolved (a symbolic link in the working copy included)."""
    text = name if isinstance(name, str) else repr(name)
    parts = text.split("/")
    if (
        not isinstance(name, str)
        or not name
        or "\\" in name
        or "\x00" in name
        or PurePosixPath(name).is_absolute()
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise UntrustedName(f"{where}: refused the entry {text[:200]!r}: not a plain relative path inside its folder")
    target = directory.joinpath(*parts)
    if not target.resolve().is_relative_to(directory.resolve()):
        raise UntrustedName(f"{where}: refused the entry {text[:200]!r}: it resolves outside {directory}")
    return target


BLOBS_PREFIX = ".a-"  # a writer's own upload prefix under <step>/<key>/ (manifest field `blobs`)


def _checked_manifest(url: str, step: str, key: str, manifest: dict[str, Any]) -> str | None:
    """Why a manifest read from the store cannot be used for `<step>/<key>`, or None."""
    if manifest.get("step", step) != step or manifest.get("key", key) != key:
        return f"{url}: the manifest names {manifest.get('step')}/{manifest.get('key')}, not {step}/{key}"
    blobs = manifest.get("blobs")
    if blobs is not None and (not isinstance(blobs, str) or not blobs.startswith(BLOBS_PREFIX) or "/" in blobs
                              or blobs in (".", "..")):  # fmt: skip
        return f"{url}: refused the entry {str(blobs)[:200]!r} (blobs): not a prefix of this output"
    if not isinstance(manifest.get("outputs", {}), dict):
        return f"{url}: the manifest's outputs are not a table of files"
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class FsspecStore:
    """A shared store on object storage (`lmforge.engine.workspace.Store`): manifests, the files they
    list, leases, checkpoints."""

    shared = True

    def __init__(
        self,
        url: str,
        options: dict[str, Any] | None = None,
        lease_s: float = 120.0,
        budget: int | None = None,
        keep_checkpoints: int = 2,
    ) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(options or {}))
        self.root = self.root.rstrip("/")
        self.lease_s = lease_s
        self.clock = time.time  # what this machine writes into its leases; never compared with another's
        self.budget = budget
        self.keep_checkpoints = keep_checkpoints

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def checkpoints(self, step: str, key: str, directory: Path) -> CheckpointMirror:
        return CheckpointMirror(self, step, key, directory, self.keep_checkpoints)

    # -- reachability ---------------------------------------------------------------------

    def check_readable(self) -> None:
        """What a read-only store (`lmforge explain`, planning) needs: the store answers a listing of the
        workspace. It writes nothing (`check_access` writes and deletes a probe)."""
        try:
            self.fs.exists(self.path(MANIFEST))
        except Exception as exc:  # noqa: BLE001 - every cause is reported as one line naming the URL
            raise StoreUnreachable(f"workspace {self.url}: cannot read the store ({_one_line(exc)})") from exc

    def check_access(self) -> None:
        """Write, conditionally create and delete a probe object: the store is reachable, this machine's
        credentials may write, and it offers the conditional create the commit rule and leases need."""
        probe = self.path(f"{PROBE}-{uuid.uuid4().hex[:12]}")
        try:
            self.fs.pipe_file(probe, b"lmforge", mode="create")
        except Exception as exc:  # noqa: BLE001 - every cause is reported as one line naming the URL
            raise StoreUnreachable(f"workspace {self.url}: cannot write to the store ({_one_line(exc)})") from exc
        try:
            try:
                self.fs.pipe_file(probe, b"lmforge", mode="create")
            except FileExistsError:
                return
            except Exception as exc:  # noqa: BLE001
                raise StoreUnreachable(
                    f"workspace {self.url}: the store refused a conditional create ({_one_line(exc)}); lmforge "
                    "needs it for its commit rule and step leases"
                ) from exc
            raise StoreUnreachable(
                f"workspace {self.url}: the store overwrote an object a conditional create should have refused; "
                "two machines could then both commit one step (no lease can exist on it): use S3, GCS or Azure"
            )
        finally:
            with contextlib.suppress(Exception):
                self.fs.rm_file(probe)

    # -- outputs --------------------------------------------------------------------------

    def manifest(self, step: str, key: str) -> dict[str, Any] | None:
        try:
            data = self.fs.cat_file(self.path(step, key, MANIFEST))
        except FileNotFoundError:
            return None
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            log.warning("%s: unreadable manifest; treating the output as absent", self.url_of(step, key))
            return None

    def fetch(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> str | None:
        """Download the output's files into `directory`, verify each against the manifest, then write the
        manifest there last. None when the working copy now holds it whole; else the first problem."""
        where = self.url_of(step, key, MANIFEST)
        problem = _checked_manifest(where, step, key, manifest)
        if problem:
            return problem
        files: dict[str, dict[str, Any]] = manifest.get("outputs", {})
        try:  # every name before any byte is written: a planted `../../.ssh/...` never lands anywhere
            targets = {rel: contained(directory, rel, where) for rel in files}
            for rel in files:
                if rel == MANIFEST or rel.split("/")[0] in (PUBLISHED, USED):
                    raise UntrustedName(f"{where}: refused the entry {rel!r}: it names lmforge's own bookkeeping")
        except UntrustedName as exc:
            return str(exc)
        blobs = [manifest["blobs"]] if manifest.get("blobs") else []
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)
        missing = [rel for rel, meta in files.items() if not _same_file(targets[rel], meta)]
        if missing:
            for rel in missing:
                targets[rel].parent.mkdir(parents=True, exist_ok=True)
            started = time.time()
            self.fs.get([self.path(step, key, *blobs, rel) for rel in missing], [str(targets[rel]) for rel in missing])
            size = sum(files[rel]["size"] for rel in missing)
            log.info("%s/%s: downloaded %d file(s), %.1f MB in %.1fs from %s", step, key, len(missing),
                     size / 1e6, time.time() - started, self.url)  # fmt: skip
        for rel in missing:
            meta, path = files[rel], targets[rel]
            if path.stat().st_size != meta["size"] or file_sha256(path) != meta["sha256"]:
                return f"{self.url_of(step, key, *blobs, rel)} does not match its manifest"
        # every file was hashed just now (downloaded and checked, or found whole): dated a few seconds back,
        # so any later write changes its stat stamp, and the stamps the store records for them can be trusted
        # at once (otherwise the next process on this machine hashed the whole output again)
        past = time.time_ns() - 3_000_000_000
        for path in targets.values():
            os.utime(path, ns=(past, past))
        atomic_write_json(directory / MANIFEST, manifest)
        (directory / PUBLISHED).touch()
        return None

    def publish(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Upload the output's files, then its manifest with a conditional create: the commit. Returns the
        manifest on the store (another machine's, when it committed this key first)."""
        files = list(manifest.get("outputs", {}))
        committed = self.manifest(step, key)
        if committed is None:
            started = time.time()
            # under a prefix of this writer's own: losing the race below leaves the winner's bytes untouched
            blobs = f"{BLOBS_PREFIX}{uuid.uuid4().hex[:16]}"
            if files:
                self.fs.put([str(directory / rel) for rel in files],
                            [self.path(step, key, blobs, rel) for rel in files])  # fmt: skip
            # where this machine keeps it is no part of the shared record
            shared = {k: v for k, v in manifest.items() if k not in ("dir", "url")}
            body = json.dumps({**shared, "blobs": blobs}, indent=2).encode()
            try:
                self.fs.pipe_file(self.path(step, key, MANIFEST), body, mode="create")
                committed = {**manifest, "blobs": blobs}
                size = sum(m["size"] for m in manifest.get("outputs", {}).values())
                log.info("%s/%s: uploaded %d file(s), %.1f MB in %.1fs to %s", step, key, len(files), size / 1e6,
                         time.time() - started, self.url)  # fmt: skip
            except FileExistsError:
                committed = self.manifest(step, key)
                with contextlib.suppress(FileNotFoundError):  # never part of a commit: nobody reads it
                    self.fs.rm(self.path(step, key, blobs), recursive=True)
        if committed is not None and committed.get("digest") != manifest.get("digest"):
            log.info("%s/%s: another machine committed this key first; its output is the store's", step, key)
        (directory / PUBLISHED).touch()
        return committed or manifest

    def retract(self, step: str, key: str, stale: Callable[[dict[str, Any]], bool]) -> bool:
        """Withdraw the store's output of `key` when `stale(manifest)` still holds for it (made by other
        code, and `runtime.on_code_drift: rerun`): its manifest, and its checkpoints, which no rerun may
        resume. Its files stay where they are (a machine fetching them meanwhile still gets what its
        manifest lists); the rerun commits under a prefix of its own. True when it was withdrawn."""
        stored = self.manifest(step, key)
        if stored is None or not stale(stored):
            return False  # absent, or another machine already committed the current code's output
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(step, key, MANIFEST))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(step, key, CHECKPOINTS), recursive=True)
        self.fs.invalidate_cache(self.path(step, key))
        log.warning("%s/%s: withdrew the store's output made by other code, to compute it again", step, key)
        return True

    # -- leases ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, step: str, key: str, committed: Any) -> Iterator[bool]:
        """Hold `<step>/.<key>.lease` while this machine computes the step; yields True when held, False
        when `committed()` became true while waiting (another machine finished it: reuse it)."""
        path = self.path(step, f".{key}.lease")
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        waited = False
        seen: tuple[str, float] | None = None  # (the lease's content, when this machine first saw it so)
        while True:
            if committed():
                yield False
                return
            body = json.dumps({"owner": owner, "renewed_at": self.clock(), "lease_s": self.lease_s}).encode()
            try:
                self.fs.pipe_file(path, body, mode="create")
                break
            except FileExistsError:
                pass
            raw = self._read_raw(path)
            held = _parse_lease(raw)
            if raw is not None and (seen is None or seen[0] != raw):
                seen = (raw, time.monotonic())  # renewed (or new) since last look: it is alive
            unchanged = time.monotonic() - seen[1] if seen is not None and raw is not None else 0.0
            if held is not None and unchanged > float(held.get("lease_s", self.lease_s)):
                log.warning("%s/%s: the lease of %s did not change for %.0fs; taking the step over", step, key,
                            held.get("owner"), unchanged)  # fmt: skip
                # only the lease that was watched going stale: a waiter that took it over meanwhile keeps its own
                if self._read_raw(path) == raw:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(path)
                seen = None
                continue
            if not waited:
                log.info("%s/%s is being computed on %s; waiting for it", step, key,
                         (held or {}).get("owner", "another machine"))  # fmt: skip
                waited = True
            time.sleep(min(2.0, self.lease_s / 10))
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(path, owner, stop), daemon=True, name="lmforge-lease")
        renewer.start()
        try:
            yield True
        finally:
            stop.set()
            renewer.join(timeout=10)
            held = self._read_lease(path)
            if held is None or held.get("owner") == owner:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(path)

    def _read_raw(self, path: str) -> str | None:
        try:
            self.fs.invalidate_cache(path)
            return self.fs.cat_file(path).decode("utf-8", "replace")
        except FileNotFoundError:
            return None

    def _read_lease(self, path: str) -> dict[str, Any] | None:
        return _parse_lease(self._read_raw(path))

    def _renew(self, path: str, owner: str, stop: threading.Event) -> None:
        renewals = 0
        while not stop.wait(self.lease_s / 3):
            try:
                held = self._read_lease(path)
                if held is not None and held.get("owner") != owner:
                    log.error("%s: another machine took this lease over; this run's output will not be committed "
                              "over theirs", path)  # fmt: skip
                    return
                renewals += 1  # the content changes at every renewal, whatever this machine's clock says
                body = {"owner": owner, "renewed_at": self.clock(), "lease_s": self.lease_s, "renewal": renewals}
                self.fs.pipe_file(path, json.dumps(body).encode())
            except Exception as exc:  # noqa: BLE001 - renewal is retried next period; the lease may lapse
                log.warning("%s: could not renew the lease (%s)", path, _one_line(exc))

    # -- the bounded working copy -----------------------------------------------------------

    def bound(self, local_root: Path, keep: set[Path]) -> list[Path]:
        """Remove published outputs, least recently used first, until the working copy is under budget;
        never one in `keep` (this run's). Returns what was removed."""
        if self.budget is None:
            return []
        outputs = [m.parent for m in local_root.glob(f"*/*/*/{MANIFEST}")]
        sizes = {d: _tree_size(d) for d in outputs}
        total = sum(sizes.values())
        removed: list[Path] = []
        for directory in sorted(outputs, key=_last_used):
            if total <= self.budget:
                break
            if directory in keep or not (directory / PUBLISHED).exists():
                continue
            if not self._still_stored(local_root, directory):
                continue
            shutil.rmtree(directory, ignore_errors=True)
            total -= sizes[directory]
            removed.append(directory)
        if removed:
            log.info("working copy %s: removed %d least recently used output(s) on the store to stay under %.2f GB",
                     local_root, len(removed), self.budget / 2**30)  # fmt: skip
        return removed

    def _still_stored(self, local_root: Path, directory: Path) -> bool:
        """Whether the store still holds the output this working copy published (a lifecycle rule, or a
        bucket of the same name behind another endpoint, may have lost it): only then may the working copy's
        be removed. One that is gone is kept, and published again the next time a run checks it."""
        stage, name, key = directory.relative_to(local_root).parts
        try:
            here = json.loads((directory / MANIFEST).read_text()).get("digest")
        except (OSError, json.JSONDecodeError):
            return True  # no usable manifest: nothing the store could lose
        self.fs.invalidate_cache(self.path(f"{stage}/{name}", key))
        stored = self.manifest(f"{stage}/{name}", key)
        if stored is not None and stored.get("digest") == here:
            return True
        (directory / PUBLISHED).unlink(missing_ok=True)
        log.warning("%s: the store no longer holds this output; the working copy's is kept and will be "
                    "published again", self.url_of(f"{stage}/{name}", key))  # fmt: skip
        return False


CHECKPOINTS = "checkpoints"  # a step's checkpoint folders: <out>/checkpoints/<name>-<step number>/
SEAL = "CHECKSUMS.json"  # written last into a checkpoint folder by its trainer (training.checkpoint.seal)
PROGRESS = "metrics.jsonl"  # the step's per-step rows, uploaded beside each checkpoint (trimmed on restore)


def _parse_lease(raw: str | None) -> dict[str, Any] | None:
    try:
        held = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        return None
    return held if isinstance(held, dict) else None


def _number(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


class CheckpointMirror:
    """A training step's sealed checkpoints, uploaded to the store while it trains, so a run on another
    machine (or this one after its disk is gone) resumes from them.

    A background thread uploads each checkpoint once its trainer sealed it (its `CHECKSUMS.json`
    written, every rank done): the files first, the seal last, so the store's copy is complete exactly
    when its seal is there; only then is it logged as durable. The newest `keep` are kept on the store.
    `restore()`, before the ranks start, downloads the newest sealed checkpoint on the store when the
    working copy has none as new, with the step's progress rows up to it."""

    def __init__(self, remote: FsspecStore, step: str, key: str, directory: Path, keep: int = 2,
                 interval_s: float = 2.0) -> None:  # fmt: skip
        self.remote, self.step, self.key, self.directory = remote, step, key, directory
        self.keep, self.interval_s = keep, interval_s
        self.durable: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _remote(self, *parts: str) -> str:
        return self.remote.path(self.step, self.key, CHECKPOINTS, *parts)

    def _remote_sealed(self) -> list[str]:
        self.remote.fs.invalidate_cache(self._remote())  # listings change under us (other machines, pruning)
        found = self.remote.fs.glob(self._remote("*", SEAL))
        return sorted((p.rstrip("/").split("/")[-2] for p in found), key=_number)

    def _local_sealed(self) -> list[Path]:
        root = self.directory / CHECKPOINTS
        if not root.is_dir():
            return []
        found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / SEAL).exists()]
        return sorted(found, key=lambda p: _number(p.name))

    def restore(self) -> str | None:
        """Download the store's newest sealed checkpoint when it is newer than any here; returns its name."""
        remote = self._remote_sealed()
        local = self._local_sealed()
        if not remote or (local and _number(local[-1].name) >= _number(remote[-1])):
            return None
        name = remote[-1]
        where = self.remote.url_of(self.step, self.key, CHECKPOINTS)
        if "/" in name:
            raise UntrustedName(f"{where}: refused the entry {name[:200]!r}: not a checkpoint folder's name")
        target = contained(self.directory / CHECKPOINTS, name, where)
        partial = target.with_name(f".fetching-{name}")
        self.remote.fs.invalidate_cache(self._remote(name))
        files = [p for p in self.remote.fs.find(self._remote(name)) if not p.endswith("/")]
        prefix = self._remote(name) + "/"
        outside = [p for p in files if not p.startswith(prefix)]
        if outside:
            raise UntrustedName(f"{where}/{name}: refused the entry {outside[0][:200]!r}: listed outside its folder")
        # every listed name before any byte is written (the listing comes from a shared bucket)
        local = [contained(partial, p[len(prefix) :], f"{where}/{name}") for p in files]
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        started = time.time()
        self.remote.fs.get(files, [str(p) for p in local])
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        progress = self.directory / PROGRESS
        with contextlib.suppress(FileNotFoundError):
            rows = self.remote.fs.cat_file(self._remote(f"{name}.{PROGRESS}")).decode("utf-8", "replace")
            kept = [
                r for r in rows.splitlines() if (row := _row(r)) is not None and row.get("step", 0) <= _number(name)
            ]
            progress.write_text("".join(r + "\n" for r in kept))
        log.info("%s/%s: resuming from %s, downloaded from %s in %.1fs", self.step, self.key, name,
                 self.remote.url, time.time() - started)  # fmt: skip
        self.durable.append(name)
        return name

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="lmforge-checkpoint-mirror")
        self._thread.start()

    def stop(self, final_scan: bool = True) -> None:
        """Stop the thread; with `final_scan`, upload what was sealed since its last scan first."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if final_scan:
            self.scan()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.scan()

    def scan(self) -> None:
        try:
            on_store = set(self._remote_sealed())
            for folder in self._local_sealed():
                if folder.name not in on_store and folder.name not in self.durable:
                    self._upload(folder)
            self._prune()
        except Exception as exc:  # noqa: BLE001 - the next scan tries again; training never waits on the network
            log.warning("%s/%s: checkpoint upload to %s failed (%s); retrying", self.step, self.key,
                        self.remote.url, _one_line(exc))  # fmt: skip

    def _upload(self, folder: Path) -> None:
        started = time.time()
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SEAL)
        seal = (folder / SEAL).read_bytes()  # read before uploading: the trainer may prune the folder meanwhile
        if files:
            self.remote.fs.put([str(p) for p in files], [self._remote(folder.name, *p.relative_to(folder).parts)
                                                         for p in files])  # fmt: skip
        progress = self.directory / PROGRESS
        if progress.exists():
            self.remote.fs.pipe_file(self._remote(f"{folder.name}.{PROGRESS}"), progress.read_bytes())
        self.remote.fs.pipe_file(self._remote(folder.name, SEAL), seal)  # last: now it is complete on the store
        self.durable.append(folder.name)
        size = sum(p.stat().st_size for p in files if p.exists())
        log.info("%s/%s: checkpoint %s is durable on %s (%.1f MB in %.1fs)", self.step, self.key, folder.name,
                 self.remote.url, size / 1e6, time.time() - started)  # fmt: skip

    def _prune(self) -> None:
        sealed = self._remote_sealed()
        if sealed:  # an upload cut short (its folder pruned by the trainer meanwhile): never sealed, never used
            for path in self.remote.fs.ls(self._remote(), detail=False):
                name = path.rstrip("/").split("/")[-1]
                if self.remote.fs.isdir(path) and name not in sealed and 0 <= _number(name) < _number(sealed[-1]):
                    with contextlib.suppress(FileNotFoundError):
                        self.remote.fs.rm(path, recursive=True)
        for name in sealed[: max(len(sealed) - self.keep, 0)]:
            self.remote.fs.rm_file(self._remote(name, SEAL))  # first: it is no longer a complete checkpoint
            with contextlib.suppress(FileNotFoundError):
                self.remote.fs.rm(self._remote(name), recursive=True)
            with contextlib.suppress(FileNotFoundError):
                self.remote.fs.rm_file(self._remote(f"{name}.{PROGRESS}"))


def _row(line: str) -> dict[str, Any] | None:
    """A progress row, or None for a blank or torn line (an upload cut mid-line): skipped, not fatal."""
    try:
        row = json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def touch_used(directory: Path) -> None:
    with contextlib.suppress(OSError):
        (directory / USED).touch()


def _last_used(directory: Path) -> float:
    try:
        return (directory / USED).stat().st_mtime
    except OSError:
        return 0.0


def _tree_size(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _same_file(path: Path, meta: dict[str, Any]) -> bool:
    """A working-copy file already holding the listed bytes (a partial download or earlier copy)."""
    try:
        if path.stat().st_size != meta["size"]:
            return False
    except FileNotFoundError:
        return False
    return file_sha256(path) == meta["sha256"]

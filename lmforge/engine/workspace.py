"""A workspace: the folder steps run in, and the store its committed outputs live in.

    workspace: ./workspace                 # a folder: the store is the folder itself (`LocalStore`)
    workspace: s3://bucket/prefix          # object storage: a working copy here, the store there
                                           # (`lmforge.engine.remote.FsspecStore`: S3, GCS, Azure, any fsspec URL)

Steps only ever see the folder (`Workspace.root`: training memory-maps shards, vLLM loads a folder).
What lies beyond it is a `Store`: where a committed output is found when the working copy lacks it,
where one made here is committed, the lease that keeps two machines from computing one key, and the
checkpoints a training step resumes from on another machine. `lmforge.engine.store.StageStore` (the
manifests, verification and unit markers of the working copy) speaks only this protocol, so it has no
branch of its own for "remote": a local workspace's store answers that it holds nothing beyond the
folder, commits by doing nothing and grants every lease (the folder's `flock` already serialises one
machine's runs).

A third kind of store (a shared POSIX filesystem with its own locking, a content-addressed blob store)
is one class implementing `Store`, returned by `Workspace.of` for its URLs; nothing else changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from lmforge.engine.remote import FsspecStore, is_remote, local_workspace

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from lmforge.engine.remote import CheckpointMirror

VerifyMode = Literal["checksum", "size"]


@runtime_checkable
class Store(Protocol):
    """Where a workspace's committed outputs live beyond this machine's working copy.

    `shared`: other machines read and write it (outputs are fetched, published, leased); False for a
    local folder. Every name a shared store returns is untrusted (`lmforge.engine.remote.contained`)."""

    url: str
    shared: bool

    def url_of(self, *parts: str) -> str:
        """The address of `<step>/<key>/...` on the store, as every machine names it."""

    def check_access(self) -> None:
        """Fail in one line naming the URL unless this machine can read, write and conditionally create."""

    def check_readable(self) -> None:
        """Fail in one line naming the URL unless the store answers a read; writes nothing."""

    def manifest(self, step: str, key: str) -> dict[str, Any] | None:
        """The manifest committed for `<step>/<key>`, or None."""

    def fetch(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> str | None:
        """Bring the committed output into `directory`, verified; None when whole, else the first problem."""

    def publish(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Commit the output in `directory`; returns the committed manifest (another machine's, if it won)."""

    def retract(self, step: str, key: str, stale: Callable[[dict[str, Any]], bool]) -> bool:
        """Withdraw the committed output when `stale(manifest)` holds for it; True when withdrawn."""

    def lease(self, step: str, key: str, committed: Callable[[], bool]) -> AbstractContextManager[bool]:
        """Hold the right to compute `<step>/<key>`; yields False when `committed()` became true meanwhile."""

    def checkpoints(self, step: str, key: str, directory: Path) -> CheckpointMirror | None:
        """The mirror of a training step's sealed checkpoints on the store, or None."""

    def bound(self, local_root: Path, keep: set[Path]) -> list[Path]:
        """Remove outputs the store also holds, to keep the working copy in its budget; never one in `keep`."""


class LocalStore:
    """A workspace that is a folder: the folder is the store, so there is nothing beyond it to fetch,
    nothing to commit to and no other machine to lease from."""

    shared = False

    def __init__(self, root: Path) -> None:
        self.url = str(root)

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def check_access(self) -> None:
        return None

    def check_readable(self) -> None:
        return None

    def manifest(self, step: str, key: str) -> dict[str, Any] | None:
        return None  # what the folder holds, the working copy's own check found

    def fetch(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> str | None:
        return f"{self.url_of(step, key)}: a local workspace has no store to fetch from"

    def publish(self, step: str, key: str, directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        return manifest  # the manifest written into the folder was the commit

    def retract(self, step: str, key: str, stale: Callable[[dict[str, Any]], bool]) -> bool:
        return False

    @contextlib.contextmanager
    def lease(self, step: str, key: str, committed: Callable[[], bool]) -> Iterator[bool]:
        yield True  # one machine: the folder's flock (`StageStore.lock`) is the whole lease

    def checkpoints(self, step: str, key: str, directory: Path) -> CheckpointMirror | None:
        return None  # checkpoints stay in the output folder, where the next attempt finds them

    def bound(self, local_root: Path, keep: set[Path]) -> list[Path]:
        return []  # the folder is the only copy: nothing in it may be evicted


_REACHED: set[str] = set()  # shared stores this process has checked (one probe per URL per process)


@dataclass(frozen=True)
class Workspace:
    """One workspace as this machine sees it: where it is configured (`url`: a folder or an fsspec URL),
    the folder steps run in (`root`) and its `store`. The executor, explain and the flows make one from
    the config (`Workspace.of`) and hand steps its folder; a `StageStore` is its outputs
    (`StageStore.for_config`)."""

    url: str
    root: Path
    store: Store
    verify: VerifyMode = "checksum"

    @classmethod
    def of(cls, config: Any) -> Workspace:
        url = str(config.workspace)
        root = local_workspace(config)
        store: Store = LocalStore(root.expanduser().resolve())
        if is_remote(url):
            storage = config.runtime.storage
            budget = int(storage.local_copy_max_gb * 2**30) if storage.local_copy_max_gb else None
            store = FsspecStore(url, storage.options, storage.lease_s, budget, storage.keep_checkpoints)
        return cls(url, root, store, config.runtime.verify)

    def check(self, fetch: bool = True) -> None:
        """A shared store is checked once per process before any step runs (reachable, writable, conditional
        creates; only readable when `fetch` is False: `explain` and planning make no write request, not
        even a probe), failing in one line naming the URL."""
        if self.store.shared and not fetch:
            self.store.check_readable()
        elif self.store.shared and self.store.url not in _REACHED:
            self.store.check_access()
            _REACHED.add(self.store.url)

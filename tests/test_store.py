"""The stage store: manifests written last, verification, unit markers, digests, locks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from lmforge.engine.store import MANIFEST, StageStore, list_outputs, outputs_digest


def _complete(store: StageStore, step: str = "demo/step", key: str = "k1") -> Path:
    directory = store.step_dir(step, key)
    (directory / "sub").mkdir(parents=True)
    (directory / "a.txt").write_text("alpha")
    (directory / "sub" / "b.bin").write_bytes(b"\x00\x01")
    (directory / ".hidden").write_text("bookkeeping")
    store.finish(directory, {"key": key, "step": step, "key_components": {}})
    return directory


def test_finish_lists_outputs_with_checksums_and_writes_manifest_last(tmp_path: Path) -> None:
    store = StageStore(tmp_path)
    directory = _complete(store)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert set(manifest["outputs"]) == {"a.txt", "sub/b.bin"}
    assert manifest["outputs"]["a.txt"]["size"] == 5
    assert len(manifest["digest"]) == 32
    assert store.check("demo/step", "k1")[0] is not None


def test_missing_file_and_changed_bytes_invalidate(tmp_path: Path) -> None:
    store = StageStore(tmp_path)
    directory = _complete(store)
    (directory / "a.txt").write_text("alphA")  # same size, different content
    manifest, reason = store.check("demo/step", "k1")
    assert manifest is None and "checksum of a.txt" in reason
    assert StageStore(tmp_path, verify="size").check("demo/step", "k1")[0] is not None
    (directory / "a.txt").write_text("alpha")
    assert store.check("demo/step", "k1")[0] is not None
    (directory / "sub" / "b.bin").unlink()
    assert "missing file sub/b.bin" in store.check("demo/step", "k1")[1]


def test_directory_without_manifest_is_partial(tmp_path: Path) -> None:
    store = StageStore(tmp_path)
    store.step_dir("demo/step", "k2").mkdir(parents=True)
    manifest, reason = store.check("demo/step", "k2")
    assert manifest is None and "partial" in reason


def test_unit_markers_resume_only_intact_units(tmp_path: Path) -> None:
    store = StageStore(tmp_path)
    directory = tmp_path / "s"
    directory.mkdir()
    for unit in ("u0", "u1"):
        (directory / f"{unit}.txt").write_text(unit)
        store.mark_unit(directory, unit, [f"{unit}.txt"], {"n": 1})
    assert store.unit_result(directory, "u0") == {"n": 1}
    (directory / "u1.txt").write_text("corrupted")
    assert store.unit_result(directory, "u1") is None
    assert not (directory / ".units" / "u1.json").exists()


def test_digest_depends_on_content_only_and_can_be_limited(tmp_path: Path) -> None:
    a = {"hf/model.safetensors": {"sha256": "x", "size": 1}, "metrics.jsonl": {"sha256": "y", "size": 1}}
    b = {"hf/model.safetensors": {"sha256": "x", "size": 1}, "metrics.jsonl": {"sha256": "z", "size": 1}}
    assert outputs_digest(a) != outputs_digest(b)
    assert outputs_digest(a, ("hf/",)) == outputs_digest(b, ("hf/",))


def test_bookkeeping_folders_are_not_outputs(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "x").write_text("1")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "w").write_text("2")
    assert list_outputs(tmp_path, exclude=("checkpoints",)) == ["hf/w"]


def test_lock_makes_a_second_computation_wait(tmp_path: Path) -> None:
    store = StageStore(tmp_path)
    order: list[str] = []

    def hold() -> None:
        with store.lock("demo/step", "k"):
            order.append("first-in")
            time.sleep(0.5)
            order.append("first-out")

    thread = threading.Thread(target=hold)
    thread.start()
    time.sleep(0.1)
    with store.lock("demo/step", "k"):
        order.append("second-in")
    thread.join()
    assert order == ["first-in", "first-out", "second-in"]


def test_latest_points_at_last_used_output(tmp_path: Path) -> None:
    store = StageStore(tmp_path)
    directory = _complete(store)
    manifest = json.loads((directory / MANIFEST).read_text())
    store.record_use("demo/step", manifest)
    assert store.latest("demo/step")["key"] == "k1"


def _count_hashes(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    import lmforge.engine.store

    hashed: list[str] = []
    real = lmforge.engine.store.file_sha256
    monkeypatch.setattr(lmforge.engine.store, "file_sha256", lambda path: hashed.append(Path(path).name) or real(path))
    return hashed


def test_verified_files_are_not_hashed_again_until_they_change(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import os

    import lmforge.engine.store

    monkeypatch.setattr(lmforge.engine.store, "RACY_NS", 50_000_000)  # files older than 50 ms are trusted
    store = StageStore(tmp_path)
    directory = _complete(store)
    time.sleep(0.1)
    hashed = _count_hashes(monkeypatch)
    assert store.check("demo/step", "k1")[0] is not None
    assert sorted(hashed) == ["a.txt", "b.bin"]  # stamped by finish() too early to trust: hashed once more
    hashed.clear()
    assert StageStore(tmp_path).check("demo/step", "k1")[0] is not None  # a new store, as in a later run
    assert hashed == []
    before = os.stat(directory / "a.txt")
    (directory / "a.txt").write_text("alphA")  # same size, and the old mtime put back: only ctime tells
    os.utime(directory / "a.txt", ns=(before.st_atime_ns, before.st_mtime_ns))
    manifest, reason = store.check("demo/step", "k1")
    assert manifest is None and "checksum of a.txt" in reason and hashed == ["a.txt"]


def test_a_file_changed_just_before_its_check_is_hashed_again(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = StageStore(tmp_path)
    _complete(store)
    hashed = _count_hashes(monkeypatch)
    for _ in range(2):  # written within RACY_NS: a later write in the same timestamp tick could keep its stamp
        assert store.check("demo/step", "k1")[0] is not None
    assert sorted(hashed) == ["a.txt", "a.txt", "b.bin", "b.bin"]


def test_invalidate_forgets_what_was_verified(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import lmforge.engine.store

    monkeypatch.setattr(lmforge.engine.store, "RACY_NS", 0)
    store = StageStore(tmp_path)
    directory = _complete(store)
    assert store.check("demo/step", "k1")[0] is not None
    assert (directory / lmforge.engine.store.VERIFIED).exists()
    assert lmforge.engine.store.VERIFIED not in json.loads((directory / MANIFEST).read_text())["outputs"]
    store.invalidate(directory)
    assert not (directory / lmforge.engine.store.VERIFIED).exists()


# -- the Store protocol: a third kind of store is one class ----------------------------------------


class FolderStore:
    """A shared store that is another folder (a mounted share): the whole of what `Store` asks, and nothing
    else; `StageStore` fetches from it, commits to it and leases through it as it does with object storage."""

    shared = True

    def __init__(self, root: Path) -> None:
        self.root, self.url = root, str(root)
        self.commits = 0

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def check_access(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def check_readable(self) -> None:
        return None

    def manifest(self, step: str, key: str) -> dict | None:
        path = self.root / step / key / MANIFEST
        return json.loads(path.read_text()) if path.exists() else None

    def fetch(self, step: str, key: str, directory: Path, manifest: dict) -> str | None:
        import shutil

        from lmforge.engine.remote import contained

        for rel in manifest["outputs"]:
            target = contained(directory, rel, self.url_of(step, key))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.root / step / key / rel, target)
        (directory / MANIFEST).write_text(json.dumps(manifest))
        return None

    def publish(self, step: str, key: str, directory: Path, manifest: dict) -> dict:
        import shutil

        committed = self.manifest(step, key)
        if committed is None:
            for rel in manifest["outputs"]:
                (self.root / step / key / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(directory / rel, self.root / step / key / rel)
            shared = {k: v for k, v in manifest.items() if k not in ("dir", "url")}
            with open(self.root / step / key / MANIFEST, "x") as handle:  # the commit: first one wins
                handle.write(json.dumps(shared))
            self.commits += 1
            committed = manifest
        (directory / ".published").touch()
        return committed

    def retract(self, step: str, key: str, stale) -> bool:  # type: ignore[no-untyped-def]
        return False

    def lease(self, step: str, key: str, committed):  # type: ignore[no-untyped-def]
        import contextlib

        return contextlib.nullcontext(True)

    def checkpoints(self, step: str, key: str, directory: Path) -> None:
        return None

    def bound(self, local_root: Path, keep: set[Path]) -> list[Path]:
        return []


def test_a_third_kind_of_store_is_one_class(tmp_path: Path) -> None:
    """`FolderStore` above implements `lmforge.engine.workspace.Store` and nothing else: an output made on
    one machine is committed to it, a machine with an empty working copy fetches it, and a manifest whose
    digest is not that of the files it lists (what downstream keys would take) is refused in one line."""
    from lmforge.engine.workspace import Store

    shared = FolderStore(tmp_path / "share")
    assert isinstance(shared, Store)
    maker = StageStore(tmp_path / "machine-a", store=shared)
    directory = _complete(maker)
    assert shared.commits == 1 and (tmp_path / "share" / "demo/step/k1/sub/b.bin").read_bytes() == b"\x00\x01"
    assert maker.check("demo/step", "k1")[0]["url"] == f"{shared.url}/demo/step/k1"  # type: ignore[index]

    reader = StageStore(tmp_path / "machine-b", store=shared)
    manifest, reason = reader.check("demo/step", "k1")
    assert manifest is not None and reason.startswith("fetched from") and shared.commits == 1
    assert (tmp_path / "machine-b/demo/step/k1/a.txt").read_text() == "alpha"
    assert manifest["digest"] == json.loads((directory / MANIFEST).read_text())["digest"]

    # a planted manifest: the same files, another digest (and the prefixes it claims to cover checked too)
    planted = json.loads((tmp_path / "share/demo/step/k1" / MANIFEST).read_text())
    for change in ({"digest": "0" * 32}, {"digest_paths": ["sub/"]}, {"digest_paths": "a.txt"}):
        (tmp_path / "share/demo/step/k1" / MANIFEST).write_text(json.dumps({**planted, **change}))
        fresh = StageStore(tmp_path / "machine-c", store=shared)
        manifest, reason = fresh.check("demo/step", "k1")
        assert manifest is None and reason.startswith("output on the store is damaged: ") and "\n" not in reason
        assert "digest" in reason and not (tmp_path / "machine-c/demo/step/k1/a.txt").exists()
    # one committed before manifests recorded what their digest covers is taken as it is
    del planted["digest_paths"]
    (tmp_path / "share/demo/step/k1" / MANIFEST).write_text(json.dumps(planted))
    assert StageStore(tmp_path / "machine-d", store=shared).check("demo/step", "k1")[0] is not None


def test_a_local_workspace_is_its_own_store(tmp_path: Path) -> None:
    """The local store holds nothing beyond the folder, commits by writing the manifest and grants every
    lease: a local workspace's outputs carry no `url` and no bookkeeping of a working copy."""
    from lmforge.engine.workspace import LocalStore, Store

    store = StageStore(tmp_path)
    assert isinstance(store.store, LocalStore) and isinstance(store.store, Store) and store.remote is None
    directory = _complete(store)
    manifest, _ = store.check("demo/step", "k1")
    assert manifest is not None and "url" not in manifest and manifest["digest_paths"] is None
    assert not (directory / ".published").exists() and not (directory / ".used").exists()
    assert store.check("demo/step", "k9") == (None, "no output with this key yet")
    with store.lock("demo/step", "k1") as fd:
        assert fd > 0

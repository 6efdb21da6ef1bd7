"""A workspace on object storage (`lmforge.engine.remote`), against a real S3 server on 127.0.0.1
(moto's, started by the tests): outputs published with the manifest last, fetched and verified on
another machine's working copy, one winner when two machines commit one key, leases, the bounded
working copy, and one-line refusals of an unreachable store or credentials in the config."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lmforge.engine.remote import PUBLISHED, FsspecStore, StoreUnreachable, local_workspace
from lmforge.engine.store import MANIFEST, StageStore
from lmforge.errors import ConfigError
from tests.s3server import S3

ROOT = Path(__file__).resolve().parent.parent


def _machine(s3: S3, local: Path, lease_s: float = 120.0, budget: int | None = None) -> StageStore:
    """One machine's view of the bucket's workspace: its own working copy."""
    return StageStore(local, "checksum", FsspecStore(s3.url(), {"endpoint_url": s3.endpoint}, lease_s, budget))


def _make(store: StageStore, step: str = "demo/step", key: str = "k1", text: str = "alpha") -> dict:
    directory = store.step_dir(step, key)
    (directory / "sub").mkdir(parents=True, exist_ok=True)
    (directory / "a.txt").write_text(text)
    (directory / "sub" / "b.bin").write_bytes(os.urandom(3000))
    (directory / "logs").mkdir(exist_ok=True)
    (directory / "logs" / "step.log").write_text("not an output")
    return store.finish(directory, {"key": key, "step": step, "key_components": {}}, ("logs",))


def test_an_output_made_on_one_machine_is_fetched_and_verified_on_another(s3: S3, tmp_path: Path) -> None:
    one = _machine(s3, tmp_path / "one")
    made = _make(one)
    fs = s3.fs()
    listed = sorted(p.split("/ws/demo/step/k1/")[1] for p in fs.find(f"{s3.bucket}/ws/demo/step/k1"))
    stored = json.loads(fs.cat_file(f"{s3.bucket}/ws/demo/step/k1/{MANIFEST}"))
    blobs = stored["blobs"]  # the writer's own prefix: what it uploaded is never a path another writer uses
    assert listed == [f"{blobs}/a.txt", f"{blobs}/sub/b.bin", MANIFEST]  # the outputs and the manifest, no logs
    assert "dir" not in stored  # a machine's path

    two = _machine(s3, tmp_path / "two")
    manifest, reason = two.check("demo/step", "k1")
    assert manifest is not None and reason == f"fetched from {s3.url()}"
    assert manifest["digest"] == made["digest"] and manifest["dir"] == str(tmp_path / "two" / "demo" / "step" / "k1")
    for rel in ("a.txt", "sub/b.bin"):
        assert (tmp_path / "two/demo/step/k1" / rel).read_bytes() == (tmp_path / "one/demo/step/k1" / rel).read_bytes()
    assert two.check("demo/step", "k1")[1] == "complete and verified"  # the working copy is reused from now on
    # a path an output recorded on the machine that made it (a gate's chosen checkpoint), found here
    recorded = str(tmp_path / "one/demo/step/k1/sub/b.bin")
    fresh = _machine(s3, tmp_path / "fresh")
    assert fresh.here("demo/step", "k1", recorded) == tmp_path / "fresh/demo/step/k1/sub/b.bin"
    assert (tmp_path / "fresh/demo/step/k1/sub/b.bin").stat().st_size == 3000  # fetched to be there
    looking = _machine(s3, tmp_path / "explain")
    looking.fetch = False  # what `lmforge explain` does: the store's record is enough, nothing is downloaded
    assert looking.check("demo/step", "k1")[1] == "on the store" and not (tmp_path / "explain").exists()

    # a damaged object on the store is caught by its digest, never handed to a step
    fs.pipe_file(f"{s3.bucket}/ws/demo/step/k1/{blobs}/a.txt", b"alphA")
    manifest, reason = _machine(s3, tmp_path / "three").check("demo/step", "k1")
    assert (
        manifest is None
        and reason
        == f"output on the store is damaged: {s3.url()}/demo/step/k1/{blobs}/a.txt does not match its manifest"
    )

    # a damaged working copy is repaired from the store (here: the store is whole again first)
    fs.pipe_file(f"{s3.bucket}/ws/demo/step/k1/{blobs}/a.txt", b"alpha")
    (tmp_path / "two/demo/step/k1/sub/b.bin").write_bytes(b"x")
    assert two.check("demo/step", "k1")[0] is not None
    assert (tmp_path / "two/demo/step/k1/sub/b.bin").stat().st_size == 3000


def test_a_fetched_output_is_hashed_once_on_this_machine(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51: an output was hashed when it was downloaded and again by every later process on the
    machine (no stat stamps were recorded for downloaded files). Now the fetch's hashing is the only one."""
    import lmforge.engine.remote as remote_module
    import lmforge.engine.store as store_module
    from lmforge.hashing import file_sha256

    _make(_machine(s3, tmp_path / "one"))
    hashed: list[str] = []

    def counting(path: Path) -> str:
        hashed.append(Path(path).name)
        return file_sha256(path)

    monkeypatch.setattr(remote_module, "file_sha256", counting)
    monkeypatch.setattr(store_module, "file_sha256", counting)
    bounded: list[Path] = []  # bounding walks every output of the working copy: only when it grew
    monkeypatch.setattr(FsspecStore, "bound", lambda self, root, keep: bounded.append(root) or [])
    for _ in range(3):  # the run that fetches it, then two later runs (processes) on this machine
        assert _machine(s3, tmp_path / "two").check("demo/step", "k1")[0] is not None
    assert sorted(hashed) == ["a.txt", "b.bin"] and len(bounded) == 1
    (tmp_path / "two/demo/step/k1/a.txt").write_text("alphA")  # a later write is still caught
    manifest, reason = _machine(s3, tmp_path / "two").check("demo/step", "k1")
    assert manifest is not None and reason.startswith("fetched from")  # repaired from the store
    assert (tmp_path / "two/demo/step/k1/a.txt").read_text() == "alpha"


def test_when_two_machines_commit_one_key_the_first_manifest_wins_and_the_other_takes_its_output(
    s3: S3, tmp_path: Path
) -> None:
    first = _make(_machine(s3, tmp_path / "one"), text="first")
    second_store = _machine(s3, tmp_path / "two")
    second = _make(second_store, text="other")  # made without a lease: the commit rule alone decides
    assert second["digest"] == first["digest"] != "" and second["dir"] == str(tmp_path / "two/demo/step/k1")
    assert (tmp_path / "two/demo/step/k1/a.txt").read_text() == "first"  # its working copy now holds the winner's
    assert second_store.check("demo/step", "k1")[0]["digest"] == first["digest"]


def test_a_machine_that_loses_the_commit_race_never_touches_the_winners_bytes(s3: S3, tmp_path: Path) -> None:
    """Both machines computed one key (a lease taken over, a lease lost): the second looked for a
    manifest before the first committed, so it uploads too. Its files go under its own prefix, the
    conditional create of the manifest refuses it, it removes its prefix and adopts the winner's output;
    the committed bytes are the winner's throughout, and every machine's fetch verifies."""
    first_store = _machine(s3, tmp_path / "one")
    first = _make(first_store, key="k5", text="first")
    loser = _machine(s3, tmp_path / "two")
    looked, calls = loser.remote.manifest, []  # type: ignore[union-attr]

    def not_yet_on_its_first_look(step: str, key: str) -> dict | None:  # the loser looked before the winner committed
        calls.append(key)
        return None if len(calls) == 1 else looked(step, key)

    loser.remote.manifest = not_yet_on_its_first_look  # type: ignore[union-attr,method-assign]
    fs = s3.fs()
    committed = {p: fs.cat_file(p) for p in fs.find(f"{s3.bucket}/ws/demo/step/k5")}
    second = _make(loser, key="k5", text="other")
    assert second["digest"] == first["digest"] and (tmp_path / "two/demo/step/k5/a.txt").read_text() == "first"
    fs.invalidate_cache()
    assert {p: fs.cat_file(p) for p in fs.find(f"{s3.bucket}/ws/demo/step/k5")} == committed  # nothing changed
    fresh = _machine(s3, tmp_path / "three")
    assert fresh.check("demo/step", "k5")[0]["digest"] == first["digest"]


def test_explain_on_a_remote_workspace_writes_nothing_to_the_store(s3: S3, tmp_path: Path) -> None:
    """`lmforge explain` (a store with fetch=False) reads manifests only: an output made on this machine
    whose upload failed is left unpublished, and the store sees no write request at all."""
    store = _machine(s3, tmp_path / "ws")
    directory = store.step_dir("demo/step", "k12")
    made = _make(store, key="k12")
    (directory / PUBLISHED).unlink()  # as if its upload had failed: a normal check would publish it now
    fs = s3.fs()
    fs.rm(f"{s3.bucket}/ws/demo/step/k12", recursive=True)
    looking = _machine(s3, tmp_path / "ws")
    looking.fetch = False
    writes: list[str] = []
    for name in ("pipe_file", "put", "put_file", "rm", "rm_file", "mkdir", "touch"):
        original = getattr(looking.remote.fs, name)  # type: ignore[union-attr]

        def counted(*args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            writes.append(_name)
            return _original(*args, **kwargs)

        setattr(looking.remote.fs, name, counted)  # type: ignore[union-attr]
    manifest, reason = looking.check("demo/step", "k12")
    assert manifest is not None and manifest["digest"] == made["digest"] and reason == "complete and verified"
    assert writes == [] and not (directory / PUBLISHED).exists()
    fs.invalidate_cache()
    assert not fs.exists(f"{s3.bucket}/ws/demo/step/k12/{MANIFEST}")
    assert store.check("demo/step", "k12")[0] is not None and fs.exists(f"{s3.bucket}/ws/demo/step/k12/{MANIFEST}")


def _race(s3: S3, tmp_path: Path, round_: int) -> tuple[str, str, str]:
    """Two machines computing one key at once; in every third round the second has lost its lease
    mid-compute (it computes and commits without it, as after a takeover)."""
    key = f"race{round_}"
    machines = [_machine(s3, tmp_path / f"r{round_}-{side}", lease_s=10) for side in ("a", "b")]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def compute(side: int) -> None:
        store = machines[side]
        try:
            start.wait(10)
            lost_lease = round_ % 3 == 0 and side == 1
            with contextlib.nullcontext() if lost_lease else store.lock("demo/step", key):
                manifest, _ = store.check("demo/step", key)
                if manifest is None or lost_lease:
                    manifest = _make(store, key=key, text=f"made by {'ab'[side]}")
            results[side] = manifest
        except BaseException as exc:  # noqa: BLE001 - reported below, whichever thread it was
            errors.append(exc)

    threads = [threading.Thread(target=compute, args=(side,)) for side in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, (round_, errors)
    fresh, reason = _machine(s3, tmp_path / f"r{round_}-fresh").check("demo/step", key)
    assert fresh is not None, (round_, reason)
    committed = (tmp_path / f"r{round_}-fresh/demo/step/{key}/a.txt").read_text()
    for side in "ab":  # each working copy holds the committed bytes
        assert (tmp_path / f"r{round_}-{side}/demo/step/{key}/a.txt").read_text() == committed, round_
    return results[0]["digest"], results[1]["digest"], fresh["digest"]


def test_two_machines_racing_one_key_20_times_always_commit_one_output_that_verifies(s3: S3, tmp_path: Path) -> None:
    """Twenty rounds: both may upload, the conditional create keeps one, and every round ends with both
    machines holding the committed output and a third machine fetching it whole."""
    for round_ in range(20):
        first, second, fetched = _race(s3, tmp_path, round_)
        assert first == second == fetched, round_  # both machines and a third one hold one committed output


@pytest.mark.parametrize(
    "entry",
    ["../../../escaped.txt", "/tmp/lmforge-escaped-absolute.txt", "sub/../../escaped.txt", "./a.txt", "manifest.json"],
)
def test_a_planted_manifest_entry_is_refused_and_nothing_is_written_outside(s3: S3, tmp_path: Path, entry: str) -> None:
    """Anyone who can write to the bucket can plant a manifest: its names are refused before a byte is
    written, the reason is one line naming the URL and the entry, and the output counts as absent."""
    fs = s3.fs()
    body = {"step": "demo/step", "key": "k6", "digest": "d", "blobs": ".a-planted",
            "outputs": {entry: {"size": 5, "sha256": "0" * 64}}}  # fmt: skip
    fs.pipe_file(f"{s3.bucket}/ws/demo/step/k6/.a-planted/{entry.lstrip('/')}", b"owned")
    fs.pipe_file(f"{s3.bucket}/ws/demo/step/k6/{MANIFEST}", json.dumps(body).encode())
    victim = _machine(s3, tmp_path / "copy" / "ws")
    manifest, reason = victim.check("demo/step", "k6")
    assert manifest is None and "refused the entry" in reason and f"{s3.url()}/demo/step/k6/{MANIFEST}" in reason
    assert "\n" not in reason
    assert not (tmp_path / "copy" / "escaped.txt").exists() and not (tmp_path / "escaped.txt").exists()
    assert not Path("/tmp/lmforge-escaped-absolute.txt").exists()
    fs.rm(f"{s3.bucket}/ws/demo/step/k6", recursive=True)


def test_a_manifest_for_another_step_or_a_blobs_prefix_outside_its_output_is_refused(s3: S3, tmp_path: Path) -> None:
    fs = s3.fs()
    for key, body in (
        ("k7", {"step": "demo/other", "key": "k7", "outputs": {}}),
        ("k8", {"step": "demo/step", "key": "k8", "blobs": "../k1", "outputs": {"a.txt": {"size": 5, "sha256": ""}}}),
    ):
        fs.pipe_file(f"{s3.bucket}/ws/demo/step/{key}/{MANIFEST}", json.dumps(body).encode())
        manifest, reason = _machine(s3, tmp_path / key).check("demo/step", key)
        assert manifest is None and reason.startswith("output on the store is damaged: "), reason
        assert "demo/other/k7, not demo/step/k7" in reason or "refused the entry '../k1' (blobs)" in reason, reason


def test_a_planted_checkpoint_listing_is_refused_before_anything_is_written(s3: S3, tmp_path: Path) -> None:
    from lmforge.engine.remote import CheckpointMirror
    from lmforge.errors import UntrustedName

    fs = s3.fs()
    base = f"{s3.bucket}/ws/demo/step/k9/checkpoints/step-00000010"
    fs.pipe_file(f"{base}/CHECKSUMS.json", b"{}")
    fs.pipe_file(f"{base}/model.bin", b"weights")
    fs.pipe_file(f"{base}/../../../../../escaped-by-listing.txt", b"owned")
    store = _machine(s3, tmp_path / "copy" / "ws")
    mirror = CheckpointMirror(store.remote, "demo/step", "k9", store.step_dir("demo/step", "k9"))  # type: ignore[arg-type]
    with pytest.raises(UntrustedName, match="refused the entry"):
        mirror.restore()
    assert not list(tmp_path.rglob("escaped-by-listing.txt"))
    assert not (store.step_dir("demo/step", "k9") / "checkpoints" / "step-00000010").exists()
    fs.rm(f"{s3.bucket}/ws/demo/step/k9", recursive=True)


def test_a_torn_progress_line_in_an_uploaded_checkpoint_is_skipped_on_restore(s3: S3, tmp_path: Path) -> None:
    from lmforge.engine.remote import CheckpointMirror

    fs = s3.fs()
    base = f"{s3.bucket}/ws/demo/step/k10/checkpoints"
    fs.pipe_file(f"{base}/step-00000020/CHECKSUMS.json", b"{}")
    fs.pipe_file(f"{base}/step-00000020.metrics.jsonl", b'{"step": 10, "loss": 2.0}\n{"step": 20, "lo')
    store = _machine(s3, tmp_path / "ws")
    mirror = CheckpointMirror(store.remote, "demo/step", "k10", store.step_dir("demo/step", "k10"))  # type: ignore[arg-type]
    assert mirror.restore() == "step-00000020"
    rows = (store.step_dir("demo/step", "k10") / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [10]


def test_a_machine_whose_clock_runs_90_s_ahead_does_not_take_a_live_lease(s3: S3, tmp_path: Path) -> None:
    """A live holder last renewed its 120 s lease 35 s ago by its own clock; a waiter whose clock runs
    90 s ahead reads it as 125 s old. It watches the lease change instead, and waits for the holder."""
    path = f"{s3.bucket}/ws/demo/step/.k11.lease"
    fs = s3.fs()
    body = {"owner": "holder:1:x", "renewed_at": time.time() - 35, "lease_s": 120, "renewal": 0}
    fs.pipe_file(path, json.dumps(body).encode())
    stolen: list[int] = []

    def hold_for_8_s() -> None:
        for renewal in range(1, 5):
            time.sleep(2)
            current = s3.fs()
            current.invalidate_cache()
            if not current.exists(path) or json.loads(current.cat_file(path))["owner"] != "holder:1:x":
                stolen.append(renewal)
                return
            current.pipe_file(path, json.dumps({**body, "renewed_at": time.time(), "renewal": renewal}).encode())
        s3.fs().rm_file(path)  # done: the holder releases it

    waiter = _machine(s3, tmp_path / "ahead")
    waiter.remote.clock = lambda: time.time() + 90  # type: ignore[union-attr]
    holder = threading.Thread(target=hold_for_8_s)
    started = time.time()
    holder.start()
    with waiter.lock("demo/step", "k11"):
        waited = time.time() - started
    holder.join()
    assert not stolen and waited >= 7.5, (stolen, waited)


def test_a_lease_makes_a_second_machine_wait_and_reuse_and_a_dead_machines_lease_is_taken_over(
    s3: S3, tmp_path: Path
) -> None:
    one, two = _machine(s3, tmp_path / "one"), _machine(s3, tmp_path / "two", lease_s=10)
    events: list[str] = []
    holding = threading.Event()

    def compute_on_one() -> None:
        with one.lock("demo/step", "k1"):
            events.append("one computes")
            holding.set()
            time.sleep(3)
            _make(one)
            events.append("one committed")

    worker = threading.Thread(target=compute_on_one)
    worker.start()
    holding.wait(30)
    with two.lock("demo/step", "k1"):
        events.append("two has the lock")
        manifest, reason = two.check("demo/step", "k1")
    worker.join()
    assert events == ["one computes", "one committed", "two has the lock"]
    assert manifest is not None and reason.startswith("fetched from")
    assert not s3.fs().exists(f"{s3.bucket}/ws/demo/step/.k1.lease")  # released

    # a machine that died holding a lease: seen unchanged for lease_s (on this machine's own clock), taken over
    stale = {"owner": "gone:1:x", "renewed_at": time.time() - 60, "lease_s": 10}
    s3.fs().pipe_file(f"{s3.bucket}/ws/demo/step/.k2.lease", json.dumps(stale).encode())
    started = time.time()
    with two.lock("demo/step", "k2"):
        held = json.loads(s3.fs().cat_file(f"{s3.bucket}/ws/demo/step/.k2.lease"))
    assert held["owner"] != "gone:1:x" and 10 <= time.time() - started < 20


def test_the_working_copy_stays_under_its_bound_removing_least_recently_used_published_outputs(
    s3: S3, tmp_path: Path
) -> None:
    maker = _machine(s3, tmp_path / "maker")
    for key in ("k1", "k2", "k3"):
        _make(maker, key=key)
    bounded = _machine(s3, tmp_path / "small", budget=8000)  # room for two outputs of ~3 kB (and their manifests)
    for key in ("k1", "k2", "k3"):
        assert bounded.check("demo/step", key)[0] is not None
        time.sleep(0.05)
    bounded.used.clear()  # a later run: nothing of it in use yet
    assert bounded.check("demo/step", "k1")[0] is not None  # reused here (a cache hit bounds nothing)
    assert len(list((tmp_path / "small/demo/step").glob(f"*/{MANIFEST}"))) == 3
    _make(maker, key="k4")
    assert (
        bounded.check("demo/step", "k4")[0] is not None
    )  # fetched: the copy grew, k2 and k3 (least recently used) leave
    kept = sorted(p.parent.name for p in (tmp_path / "small/demo/step").glob(f"*/{MANIFEST}"))
    assert kept == ["k1", "k4"]
    local_only = StageStore(tmp_path / "small")  # an output never published is never evicted
    assert all((tmp_path / "small/demo/step" / k / PUBLISHED).exists() for k in kept)
    assert local_only.check("demo/step", "k4")[0] is not None


def test_an_output_the_store_lost_is_kept_in_the_working_copy_and_published_again(s3: S3, tmp_path: Path) -> None:
    """Issue 51: a working copy trusted its `.published` marker, so an output the store had lost (a lifecycle
    rule, another endpoint with the same bucket name) was evicted: the only copy was gone."""
    maker = _machine(s3, tmp_path / "maker")
    for key in ("k1", "k2", "k3"):
        _make(maker, key=key)
    bounded = _machine(s3, tmp_path / "small", budget=8000)  # room for two outputs of ~3 kB
    bounded.used.clear()
    for key in ("k1", "k2"):
        assert bounded.check("demo/step", key)[0] is not None
        time.sleep(0.05)
    fs = s3.fs()
    fs.rm(f"{s3.bucket}/ws/demo/step/k1", recursive=True)  # the store loses k1
    bounded.used.clear()  # a later run
    assert bounded.check("demo/step", "k3")[0] is not None  # over the bound: k1 is least recently used
    kept = sorted(p.parent.name for p in (tmp_path / "small/demo/step").glob(f"*/{MANIFEST}"))
    assert kept == ["k1", "k3"] and not (tmp_path / "small/demo/step/k1" / PUBLISHED).exists()
    assert bounded.check("demo/step", "k1")[0] is not None  # published again from the working copy
    fs.invalidate_cache()
    assert fs.exists(f"{s3.bucket}/ws/demo/step/k1/{MANIFEST}")
    bounded.used.clear()


def test_a_store_opened_inside_a_step_never_evicts_that_steps_inputs(s3: S3, tmp_path: Path) -> None:
    """Issue 51: the judge's, the answer sets' and the safety gate's stores bound the working copy too, and
    knew only what they used themselves: the running step's input, least recently used, was removed."""
    maker = _machine(s3, tmp_path / "maker")
    for key in ("k1", "k2", "k3"):
        _make(maker, key=key)
    step = _machine(s3, tmp_path / "small", budget=8000)  # room for two outputs of ~3 kB
    step.used.clear()  # a run starting
    step.hold([step.step_dir("demo/step", "k1")])  # what open_step does for the step's inputs
    assert step.check("demo/step", "k1")[0] is not None
    time.sleep(0.05)
    inner = _machine(s3, tmp_path / "small", budget=8000)  # a store the step opens (the judge's)
    for key in ("k2", "k3"):
        assert inner.check("demo/step", key)[0] is not None
        time.sleep(0.05)
    kept = sorted(p.parent.name for p in (tmp_path / "small/demo/step").glob(f"*/{MANIFEST}"))
    assert "k1" in kept  # the step's input stayed; the bound is met as far as what is in use allows
    step.used.clear()


def test_an_unreachable_store_or_credentials_in_the_config_fail_in_one_line(s3: S3, tmp_path: Path) -> None:
    from lmforge.config import load_config

    config = load_config("tiny-cpu", [*s3.overrides()], f"s3://{s3.bucket}-missing/ws")
    with pytest.raises(StoreUnreachable) as missing:
        StageStore.for_config(config)
    assert str(missing.value).startswith(f"workspace s3://{s3.bucket}-missing/ws: cannot write to the store (")
    assert "\n" not in str(missing.value)
    closed = load_config("tiny-cpu", ["runtime.storage.options={endpoint_url: http://127.0.0.1:9}"], s3.url())
    with pytest.raises(StoreUnreachable, match=r"^workspace s3://lmforge-\w+/ws: cannot write to the store"):
        StageStore.for_config(closed)
    with pytest.raises(StoreUnreachable, match=r"^workspace s3://lmforge-\w+/ws: cannot read the store"):
        StageStore.for_config(closed, fetch=False)  # explain: a read, not a probe written
    with pytest.raises(ConfigError, match=r"runtime.storage.options.secret: credentials never go in the config"):
        load_config("tiny-cpu", ["runtime.storage.options={secret: abc}"], s3.url())
    with pytest.raises(ConfigError, match=r"workspace nope://x: no fsspec filesystem for nope://"):
        load_config("tiny-cpu", [], "nope://x")
    ok = load_config("tiny-cpu", [*s3.overrides()], s3.url() + "/")
    assert ok.workspace == s3.url() and StageStore.for_config(ok).root == local_workspace(ok).resolve()
    assert local_workspace(ok).is_relative_to(Path("~/.cache/lmforge/workspaces").expanduser())
    assert load_config("tiny-cpu", [], f"file://{tmp_path}").workspace == str(tmp_path)


RUN = """
import json, logging, sys
from lmforge.config import load_config
from lmforge.engine import codeprint
from lmforge.engine.executor import run_pipeline_locally
from tests.conftest import SMALL_CURATE
logging.basicConfig(level=logging.INFO)
workspace, local, endpoint, *drift = sys.argv[1:]
more = []
if drift:  # as after an upgrade of datasketch (drift: no key changes), with on_code_drift: rerun
    real = codeprint.library_version
    codeprint.library_version = lambda dist: "99.0" if dist == "datasketch" else real(dist)
    more = ["runtime.on_code_drift=rerun"]
config = load_config("tiny-cpu", [*SMALL_CURATE, f"runtime.storage.options={{endpoint_url: {endpoint}}}",
                                  f"runtime.storage.local_copy={local}", "runtime.workers=1", *more], workspace)
manifests = run_pipeline_locally(config, ["curate"])
print(json.dumps({name: m["digest"] for name, m in manifests.items()}))
"""


EXPLAIN = """
import json, sys
import s3fs
writes = []
for name in ("_pipe_file", "_put_file", "_rm", "_rm_file", "_mkdir", "_makedirs", "_touch", "_cp_file"):
    original = getattr(s3fs.S3FileSystem, name)
    async def counted(self, *args, _name=name, _original=original, **kwargs):
        writes.append(_name)
        return await _original(self, *args, **kwargs)
    setattr(s3fs.S3FileSystem, name, counted)
from lmforge.config import load_config
from lmforge.engine.explain import explain
from tests.conftest import SMALL_CURATE
workspace, local, endpoint = sys.argv[1:4]
config = load_config("tiny-cpu", [*SMALL_CURATE, f"runtime.storage.options={{endpoint_url: {endpoint}}}",
                                  f"runtime.storage.local_copy={local}"], workspace)
lines = explain(config, ["curate"])
print(json.dumps({"writes": writes, "reused": all(e.reuse for e in lines), "steps": len(lines)}))
"""


@pytest.mark.slow
def test_two_machines_curating_one_workspace_at_once_compute_each_step_once_and_both_succeed(
    s3: S3, tmp_path: Path
) -> None:
    """Two processes, each with its own working copy and HOME (two machines), run the curation stage
    against one bucket at the same time: every step is computed by one of them and reused by the other."""
    runs = []
    for name in ("one", "two"):
        home = tmp_path / f"home-{name}"
        home.mkdir()
        env = {**s3.env(), "HOME": str(home), "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-c", RUN, s3.url(), str(tmp_path / f"copy-{name}"), s3.endpoint]
        runs.append(subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True))  # fmt: skip
    outputs = [run.communicate(timeout=900) for run in runs]
    for run, (_, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-3000:]
    digests = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert digests[0] == digests[1]  # one lineage
    computed = [err.count(": computed in ") for _, err in outputs]
    assert sum(computed) == len(digests[0]), computed  # each step once, whichever machine got its lease
    fetched = sum(err.count("downloaded") for _, err in outputs)
    assert fetched >= len(digests[0]) - 1  # the other machine took each output from the store
    fs = s3.fs()
    for step, value in digests[0].items():
        (manifest_path,) = fs.glob(f"{s3.bucket}/ws/{step}/*/{MANIFEST}")
        assert json.loads(fs.cat_file(manifest_path))["digest"] == value
    assert not fs.glob(f"{s3.bucket}/ws/**/.*.lease")  # every lease released
    # a third machine reuses everything: nothing computed, nothing but downloads
    env = {**s3.env(), "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    third = subprocess.run([sys.executable, "-c", RUN, s3.url(), str(tmp_path / "copy-three"), s3.endpoint],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert third.returncode == 0, third.stderr[-3000:]
    assert ": computed in " not in third.stderr and json.loads(third.stdout.strip().splitlines()[-1]) == digests[0]

    # Issue 51: with `on_code_drift: rerun`, an output made by other code (a library upgrade) is computed
    # again and its commit replaces the store's. Before, the rerun adopted the store's stale output, so every
    # run recomputed it. The other machine's working copy, stale too, takes the new output from the store.
    def again(name: str) -> str:
        run = subprocess.run([sys.executable, "-c", RUN, s3.url(), str(tmp_path / f"copy-{name}"), s3.endpoint, "drift"],
                             env={**env, "HOME": str(tmp_path / f"home-{name}")}, cwd=tmp_path, capture_output=True,
                             text=True, timeout=900)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert json.loads(run.stdout.strip().splitlines()[-1]) == digests[0]  # the same bytes: same keys after
        return run.stderr

    rerun = again("one")
    assert "curate/minhash: computed in " in rerun and "runtime.on_code_drift=rerun" in rerun
    (manifest_path,) = fs.glob(f"{s3.bucket}/ws/curate/minhash/*/{MANIFEST}")
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(manifest_path))["code"]["libraries"]["datasketch"] == "99.0"
    assert ": computed in " not in again("one")  # converged: the rerun's output is reused
    stale = again("two")  # its working copy still held the old code's output
    assert ": computed in " not in stale and "the store's, computed again by this code, replaces it" in stale

    # `lmforge explain` on a machine that has nothing yet: every step found on the store, and not one write
    # request (s3fs's write methods counted; the reachability probe of a store that computes writes one)
    looked = subprocess.run([sys.executable, "-c", EXPLAIN, s3.url(), str(tmp_path / "copy-explain"), s3.endpoint],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert looked.returncode == 0, looked.stderr[-3000:]
    seen = json.loads(looked.stdout.strip().splitlines()[-1])
    assert seen == {"writes": [], "reused": True, "steps": len(digests[0])}, seen
    assert not (tmp_path / "copy-explain").exists() or not any((tmp_path / "copy-explain").rglob("*.json"))


PRETRAIN = """
import json, logging, sys
from lmforge.config import load_config
from lmforge.engine.executor import run_pipeline_locally
from tests.conftest import SMALL_CURATE, SMALL_PRETRAIN
logging.basicConfig(level=logging.INFO)
workspace, local, endpoint, *more = sys.argv[1:]
config = load_config("tiny-cpu", [*SMALL_CURATE, *SMALL_PRETRAIN, f"runtime.storage.options={{endpoint_url: {endpoint}}}",
                                  f"runtime.storage.local_copy={local}", *more], workspace)
manifest = run_pipeline_locally(config, ["curate", "pretrain"])["pretrain/train"]
print(json.dumps({"dir": manifest["dir"], "metrics": manifest["metrics"]}))
"""


def _kill_everything_of(folder: Path) -> None:
    """SIGKILL every process that names `folder` (the run, its launcher, its ranks), as a machine that dies."""
    import psutil

    for _ in range(50):
        found = [p for p in psutil.process_iter(["cmdline"]) if str(folder) in " ".join(p.info["cmdline"] or [])]
        if not found:
            return
        for proc in found:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        time.sleep(0.2)
    raise AssertionError(f"processes of {folder} outlived SIGKILL")


@pytest.mark.slow
def test_a_machine_lost_mid_pretraining_resumes_on_another_from_the_checkpoint_on_the_store(
    s3: S3, curated: tuple[Path, dict], trained: dict, tmp_path: Path
) -> None:
    """A rank and its whole machine SIGKILLed after a checkpoint reached the store, its disk then gone:
    a run on another machine resumes from the store's checkpoint and ends where an uninterrupted run does."""
    import shutil

    from safetensors.torch import load_file

    first, second = tmp_path / "machine-one", tmp_path / "machine-two"
    shutil.copytree(curated[0], first)  # its curation outputs are published as the run finds them
    env = {**s3.env(), "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    slow = "debug.pretrain.step_delay_s=0.05"  # 8 s of steps: time to see checkpoints reach the store
    lease = "runtime.storage.lease_s=10"  # the dead machine's lease on the step lapses after 10 s, not 120
    command = [sys.executable, "-c", PRETRAIN, s3.url(), str(first), s3.endpoint, slow, lease]
    run = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # fmt: skip
    fs, deadline = s3.fs(), time.time() + 600
    while not fs.glob(f"{s3.bucket}/ws/pretrain/train/*/checkpoints/step-00000040/CHECKSUMS.json"):
        assert run.poll() is None and time.time() < deadline, (run.stdout.read() if run.stdout else "")[-3000:]
        time.sleep(0.2)
    _kill_everything_of(first)
    run.wait(timeout=60)
    log = run.stdout.read() if run.stdout else ""
    assert "checkpoint step-00000020 is durable on" in log and "checkpoint step-00000040 is durable on" in log
    shutil.rmtree(first)  # the machine and its disk are gone

    resumed = subprocess.run([sys.executable, "-c", PRETRAIN, s3.url(), str(second), s3.endpoint, slow, lease], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ": computed in " in resumed.stderr and "downloaded from" in resumed.stderr
    assert "did not change for" in resumed.stderr  # the dead machine's lease, taken over
    result = json.loads(resumed.stdout.strip().splitlines()[-1])
    rank0 = (Path(result["dir"]) / "logs" / "rank-0.log").read_text()
    assert "resumed from step-000000" in rank0 and "resumed from step-00000000 " not in rank0
    assert abs(result["metrics"]["final_val_loss"] - trained["metrics"]["final_val_loss"]) < 1e-4
    ours, reference = (load_file(str(Path(d) / "hf" / "model.safetensors")) for d in (result["dir"], trained["dir"]))
    assert max(float((ours[n] - reference[n]).abs().max()) for n in reference) < 1e-4
    kept = sorted(p.split("/")[-2] for p in fs.glob(f"{s3.bucket}/ws/pretrain/train/*/checkpoints/*/CHECKSUMS.json"))
    # the newest runtime.storage.keep_checkpoints (2) of those uploaded while the run lasted: the mirror scans
    # every 2 s, and once the output is committed its last checkpoint is not uploaded (step 160 made it or not,
    # by how soon the ranks exported after it)
    numbers = [int(name.split("-")[1]) for name in kept]
    assert len(numbers) == 2 and numbers[1] - numbers[0] == 20 and numbers[1] >= 140, kept


@pytest.mark.slow
def test_a_deployment_run_over_two_workers_that_share_no_folder(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prefect deployment run` of the pipeline with curation on the CPU pool's worker and training on
    the GPU pool's, each with its own HOME and working copy: the bucket is all they share."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.deployments import apply_deployments, deployment_specs, ensure_gpu_limit, ensure_pools
    from lmforge import server
    from lmforge.processes.launch import free_port
    from tests.conftest import SMALL_CURATE, SMALL_PRETRAIN
    from tests.s3server import FAKE_CREDENTIALS
    from tests.test_orchestration import _child_runs, _start_worker, _stop

    overrides = [
        *SMALL_CURATE,
        *SMALL_PRETRAIN,
        *s3.overrides(),
        "runtime.dispatch=deployments",
        "stages=[curate, pretrain]",
        "runtime.deployment=object-store-test",
    ]
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "prefect-home"))
    url = server.start("127.0.0.1", free_port())
    machines = {pool: tmp_path / f"machine-{pool}" for pool in ("lmforge-cpu", "lmforge-gpu")}
    workers: list[subprocess.Popen] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            ensure_pools("process")
            ensure_gpu_limit(1)
            apply_deployments(deployment_specs("object-store-test", "tiny-cpu", overrides, s3.url()))
            for pool, home in machines.items():
                home.mkdir()
                env = {"HOME": str(home), **FAKE_CREDENTIALS}
                workers.append(_start_worker(pool, tmp_path / f"{pool}.log", env))
            run = run_deployment("lmforge-pipeline/object-store-test", timeout=900)
            logs = (tmp_path / "lmforge-gpu.log").read_text()[-3000:]
            assert run.state.is_completed(), (run.state, logs)
            children = _child_runs(run.id)
            assert children["lmforge-curate"].work_pool_name == "lmforge-cpu"
            assert children["lmforge-pretrain"].work_pool_name == "lmforge-gpu"
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                artifacts = client.read_artifacts()
                pretrain_steps = [a for a in artifacts if a.key == "pretrain-steps"][-1]
                lineage = [a for a in artifacts if a.key == "pipeline-lineage"][-1]
    finally:
        _stop(*workers)
        server.stop()
    fs = s3.fs()
    (trained,) = fs.glob(f"{s3.bucket}/ws/pretrain/train/*/manifest.json")
    manifest = json.loads(fs.cat_file(trained))
    assert manifest["made_by"]["work_pool"] == "lmforge-gpu"
    assert f"{s3.url()}/pretrain/train/{manifest['key']}" in str(pretrain_steps.data)  # artifacts name the store
    assert f"Workspace: `{s3.url()}`" in str(lineage.data)
    # each machine holds what it computed or needed, in its own HOME; nothing else was shared
    copies = {pool: next((home / ".cache/lmforge/workspaces").iterdir()) for pool, home in machines.items()}
    gpu_steps = {p.parent.parent.name + "/" + p.parent.name for p in copies["lmforge-gpu"].glob("*/*/*/manifest.json")}
    assert f"train/{manifest['key']}" in gpu_steps and any(s.startswith("pack/") for s in gpu_steps)
    (ingest,) = fs.glob(f"{s3.bucket}/ws/curate/ingest/*/manifest.json")
    assert json.loads(fs.cat_file(ingest))["made_by"]["work_pool"] == "lmforge-cpu"
    assert list(copies["lmforge-cpu"].glob("curate/ingest/*/manifest.json"))


@pytest.mark.slow
def test_the_lifecycle_in_a_bucket_is_served_from_another_machine_that_recomputes_nothing(
    s3: S3, quantized: dict, tmp_path: Path
) -> None:
    """The session's lineage (curation to quantization) published from one machine's working copy;
    `lmforge run` on a second machine (its own HOME, an empty working copy) reuses every output from
    the bucket, releases the model from what it downloaded, and it answers through the official client."""
    import shutil

    from openai import OpenAI

    from tests.test_cli_end_to_end import small, statuses

    first, second = tmp_path / "machine-one", tmp_path / "machine-two"
    shutil.copytree(Path(quantized["quantize/gate"]["dir"]).parents[2], first / "copy")
    # the release's SLO measurement is tested elsewhere (test_cli_end_to_end); here it would only cost time
    storage = ["--set", f"runtime.storage.options={{endpoint_url: {s3.endpoint}}}", "--set", "serve.slo.enabled=false"]

    def lmforge(home: Path, *args: str) -> subprocess.CompletedProcess:
        home.mkdir(exist_ok=True)
        env = {**s3.env(), "HOME": str(home), "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "lmforge.cli", *args, "--workspace", s3.url(), *small(), *storage]
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)

    published = lmforge(first, "run", "--local", "--set", f"runtime.storage.local_copy={first / 'copy'}",
                        "--set", "stages=[curate,pretrain,align,evaluate,quantize]")  # fmt: skip
    assert published.returncode == 0, published.stderr[-3000:]
    assert set(statuses(published.stdout).values()) == {"cached"}  # nothing computed: only uploaded
    try:
        run = lmforge(second, "run", "--local")
        assert run.returncode == 0, run.stderr[-3000:]
        rows = statuses(run.stdout)
        assert rows.pop("serve/release") == "computed" and set(rows.values()) == {"cached"}, rows
        copy = next((second / ".cache/lmforge/workspaces").iterdir())
        record = json.loads((copy / "serving" / "current.json").read_text())
        assert record["model_dir"].startswith(str(copy))  # served from this machine's working copy
        key = (copy / "serving" / "api_key").read_text().strip()
        client = OpenAI(base_url=f"{record['endpoint']}/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(model=record["served_name"], max_tokens=16, temperature=0,
                                               messages=[{"role": "user", "content": "What is 4 + 5?"}])  # fmt: skip
        assert reply.choices[0].message.content
        assert key not in run.stdout + run.stderr
        again = lmforge(second, "run", "--local")  # a rerun: every output reused, the server kept
        assert again.returncode == 0 and set(statuses(again.stdout).values()) == {"cached"}, again.stderr[-2000:]
    finally:
        lmforge(second, "serve", "stop")
    (release,) = s3.fs().glob(f"{s3.bucket}/ws/serve/release/*/manifest.json")
    assert json.loads(s3.fs().cat_file(release))["made_by"]["host"]  # the release is in the bucket too

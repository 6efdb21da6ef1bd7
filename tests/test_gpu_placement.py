"""GPU co-tenancy, the assignment logic (no GPU here): a candidate server goes beside the running one on
other GPUs when there are enough, replaces it (stop, start, start the old one again on failure) when
there are not, and the GPUs a served model holds are kept out of every launch until it stops or dies.

Before: the candidate started on the same GPUs as the running server, both asking for 90% of their
memory, and the served model kept its GPUs after the flow released the `gpu` slot."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lmforge.inference.vllm_server import ServerFailed
from lmforge.processes import devices
from serving.release import placement


def test_placement_goes_beside_when_there_is_room_and_replaces_when_there_is_not() -> None:
    assert placement([], [], 1) == ("cpu", [])
    assert placement(["0", "1", "2", "3"], ["0"], 1) == ("beside", ["1"])  # 8-GPU node: side by side
    assert placement(["0", "1", "2", "3"], ["0", "1"], 2) == ("beside", ["2", "3"])
    assert placement(["0"], ["0"], 1) == ("replace", ["0"])  # one GPU: no room for two
    assert placement(["0", "1", "2"], ["0", "1"], 2) == ("replace", ["0", "1"])
    assert placement(["3"], [], 1) == ("beside", ["3"])  # GPUs 0-2 held by another workspace's server
    with pytest.raises(ServerFailed, match="needs 2 GPU"):
        placement(["0"], [], 2)


@pytest.fixture
def four_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMFORGE_DEVICE_REGISTRY", str(tmp_path / "devices"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    real = devices.visible_gpus
    monkeypatch.setattr(
        devices,
        "visible_gpus",
        lambda env=None: ["0", "1", "2", "3"] if env is None or "CUDA_VISIBLE_DEVICES" not in env else real(env),
    )


def test_held_gpus_are_left_out_of_launches_until_their_holder_is_gone(four_gpus: None) -> None:
    env, note = devices.launch_env({"X": "1"})
    assert "CUDA_VISIBLE_DEVICES" not in env and note is None  # nothing held: nothing changes
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        devices.hold("/ws/serving/servers/a/server.pid", ["0"], server.pid, "served model m@1")
        env, note = devices.launch_env({"X": "1"})
        assert env == {"X": "1", "CUDA_VISIBLE_DEVICES": "1,2,3"}
        assert note is not None and "GPU 0 by served model m@1" in note
        # a user's own choice of devices is theirs
        assert devices.launch_env({"CUDA_VISIBLE_DEVICES": "0"})[0] == {"CUDA_VISIBLE_DEVICES": "0"}
        devices.hold("/ws2/serving/servers/b/server.pid", ["1", "2", "3"], server.pid, "served model n@2")
        with pytest.raises(devices.NoFreeGpu, match="every GPU of this host is held"):
            devices.launch_env({})
        assert devices.free(exclude="/ws/serving/servers/a/server.pid") == ["0"]  # what a's promotion may use
    finally:
        server.kill()
        server.wait()
    # the holder died (a killed server): its GPUs are free again without anyone cleaning up
    assert devices.held() == {} and devices.free() == ["0", "1", "2", "3"]


def test_release_frees_the_gpus(four_gpus: None) -> None:
    import os

    devices.hold("holder", ["2"], os.getpid(), "served model")
    assert devices.free() == ["0", "1", "3"]
    devices.release("holder")
    assert devices.free() == ["0", "1", "2", "3"]


def test_a_reused_pid_does_not_keep_gpus_held(four_gpus: None) -> None:
    """Before, liveness was `kill(pid, 0)`: a pid the kernel gave to another process kept the GPUs forever."""
    import os

    devices.hold("holder", ["1"], os.getpid(), "served model")
    assert devices.free() == ["0", "2", "3"]
    state_file = devices._file()
    state = json.loads(state_file.read_text())
    state["holder"]["start"] -= 1  # the same pid, another process: the one that held it has gone
    state_file.write_text(json.dumps(state))
    assert devices.free() == ["0", "1", "2", "3"] and devices.held() == {}


def test_the_registry_is_host_wide_not_per_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, it lived in ~/.lmforge: two users' servers could take the same GPU."""
    import os

    monkeypatch.delenv("LMFORGE_DEVICE_REGISTRY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "alice"))
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "alice" / ".lmforge"))
    first = devices._file()
    monkeypatch.setenv("HOME", str(tmp_path / "bob"))
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "bob" / ".lmforge"))
    assert devices._file() == first and not str(first).startswith(str(tmp_path))
    assert os.stat(first.parent).st_mode & 0o1777 == 0o1777


def _promote_concurrently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: list[str], server_s: float
) -> list[dict[str, Any]]:
    """Two workspaces promote a model at the same moment on a host with `gpus` (a fake inventory): the real
    release code, with a sleeping process for a server (it exits after `server_s`) and readiness and the
    smoke test answered at once."""
    from serving import release
    from serving.backends.vllm import VLLM
    from serving.config import ServeConfig

    monkeypatch.setenv("LMFORGE_DEVICE_REGISTRY", str(tmp_path / "devices"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "visible_gpus", lambda env=None: list(gpus))
    command = [sys.executable, "-c", f"import time; time.sleep({server_s})"]
    monkeypatch.setattr(VLLM, "command", lambda self, *a, **k: command)

    def ready(*args: Any, **kwargs: Any) -> float:
        time.sleep(0.5)  # both candidates are starting at once
        return 0.5

    monkeypatch.setattr(release, "wait_ready", ready)
    monkeypatch.setattr(release, "smoke_each", lambda record, cfg, ws: {})
    cfg = ServeConfig.model_validate({"front": False, "gpu_wait_s": 30})
    barrier = threading.Barrier(2)
    records: list[dict[str, Any]] = [{}, {}]

    def promote(i: int) -> None:
        workspace = tmp_path / f"ws{i}"
        barrier.wait()
        records[i] = release.start_and_promote(tmp_path / "model", f"m{i}", cfg, workspace)
        records[i]["promoted_at"] = time.time()

    threads = [threading.Thread(target=promote, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for i in range(2):
        release.stop(tmp_path / f"ws{i}")
    return records


def test_two_promotions_from_two_workspaces_at_once_get_distinct_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, both read the free GPUs, released the lock, started, and only then held: both got GPU 0."""
    records = _promote_concurrently(tmp_path, monkeypatch, ["0", "1"], server_s=30)
    assert sorted(g for r in records for g in r["gpus"]) == ["0", "1"]


def test_with_one_gpu_the_second_promotion_waits_for_the_first_server_to_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the second found no free GPU and started anyway (placement read that as a host without GPUs)."""
    records = _promote_concurrently(tmp_path, monkeypatch, ["0"], server_s=3)
    assert [r["gpus"] for r in records] == [["0"], ["0"]]
    first, second = sorted(records, key=lambda r: r["started_at"])
    assert second["started_at"] >= first["started_at"] + 2.5  # it waited for the first server to exit

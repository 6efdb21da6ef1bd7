"""GPU co-tenancy, the assignment logic (no GPU here): a candidate server goes beside the running one on
other GPUs when there are enough, replaces it (stop, start, start the old one again on failure) when
there are not, and the GPUs a served model holds are kept out of every launch until it stops or dies.

Before: the candidate started on the same GPUs as the running server, both asking for 90% of their
memory, and the served model kept its GPUs after the flow released the `gpu` slot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge import devices
from lmforge.vllm_server import ServerFailed
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
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path))
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

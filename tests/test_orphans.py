"""Detached services: what they inherit, and what is left when their supervisor is killed.

A killed supervisor leaves no orphan: its command gets a parent-death SIGTERM, and whatever
ignores that is found by the supervisor's session by `serve status`/`stop` and by the launcher.

Before: the command of a SIGKILLed supervisor kept running with ppid 1, `serve status` said NOT
RUNNING and `serve stop` deleted the pid file; a watched launch blocked forever on its pipe.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil

# a command that ignores SIGTERM and starts a grandchild that ignores it too; both hold stdout
STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    print("ready", child.pid, flush=True)
    time.sleep(300)
    """
)


def _supervisor_of(pid_file: Path) -> int:
    from lmforge.processes.launcher import read_pid_file

    record = read_pid_file(pid_file)
    assert record is not None
    return int(record["pid"])


def _wait_for(predicate, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def _living(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _tree(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def test_a_well_behaved_service_goes_with_its_killed_supervisor(tmp_path: Path) -> None:
    from lmforge.processes.launcher import start_detached, survivors

    pid_file = tmp_path / "svc.pid"
    start_detached([sys.executable, "-c", "import time; time.sleep(300)", "svc"], tmp_path / "svc.log", pid_file)
    supervisor = _supervisor_of(pid_file)
    assert _wait_for(lambda: len(_tree(supervisor)) == 1, 10)
    command = _tree(supervisor)
    os.kill(supervisor, signal.SIGKILL)
    # the parent-death signal: the command is gone within seconds, nobody has to find it
    assert _wait_for(lambda: not _living(command), 10), "the command outlived its killed supervisor"
    from lmforge.processes.launcher import read_pid_file

    assert survivors(read_pid_file(pid_file)) == []


def test_status_names_the_survivors_of_a_killed_supervisor_and_stop_ends_them(tmp_path: Path) -> None:
    from lmforge.processes.launcher import detached_alive, read_pid_file, start_detached, stop_detached, survivors

    pid_file = tmp_path / "svc.pid"
    start_detached([sys.executable, "-c", STUBBORN, "stubborn"], tmp_path / "svc.log", pid_file)
    supervisor = _supervisor_of(pid_file)
    assert _wait_for(lambda: "ready" in (tmp_path / "svc.log").read_text(), 30)
    tree = _tree(supervisor)
    assert len(tree) == 2
    os.kill(supervisor, signal.SIGKILL)
    assert _wait_for(lambda: not _living([supervisor]), 5)
    time.sleep(1.0)  # the parent-death SIGTERM was delivered, and ignored
    record = read_pid_file(pid_file)
    assert not detached_alive(record)
    assert sorted(survivors(record)) == sorted(tree)  # status can name them
    started = time.monotonic()
    assert stop_detached(pid_file, wait_s=3)  # "it was running": stop found and ended it
    assert time.monotonic() - started < 15
    assert not _living(tree)
    assert not pid_file.exists()


def test_serve_status_says_unsupervised_and_names_the_pids(tmp_path: Path) -> None:
    import json

    from lmforge.processes.launcher import start_detached, stop_detached
    from serving.release import status_lines

    serving = tmp_path / "serving"
    pid_file = serving / "servers" / "x" / "server.pid"
    start_detached([sys.executable, "-c", STUBBORN, "stubborn"], serving / "servers" / "x" / "server.log", pid_file)
    assert _wait_for(lambda: "ready" in (serving / "servers" / "x" / "server.log").read_text(), 30)
    (serving / "current.json").write_text(
        json.dumps(
            {
                "served_name": "m",
                "model_dir": "/m",
                "url": "http://127.0.0.1:1",
                "pid_file": str(pid_file),
                "log_file": str(serving / "servers" / "x" / "server.log"),
                "key_fingerprint": "sha256:0",
            }
        )
    )
    supervisor = _supervisor_of(pid_file)
    tree = _tree(supervisor)
    os.kill(supervisor, signal.SIGKILL)
    assert _wait_for(lambda: not _living([supervisor]), 5)
    running, lines = status_lines(tmp_path)
    state = next(line for line in lines if line.startswith("state:"))
    assert not running and "UNSUPERVISED" in state and all(str(p) in state for p in tree), state
    assert stop_detached(pid_file, wait_s=3) and not _living(tree)


def test_a_launch_whose_supervisor_is_killed_returns_and_leaves_nothing(tmp_path: Path) -> None:
    """Before: the reader blocked forever on the pipe the orphaned command still held."""
    from lmforge.processes import launcher

    seen: list[int] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("ready"):
                seen.append(int(message.split()[1]))

    log = logging.getLogger("test.orphans")
    log.setLevel(logging.INFO)
    log.addHandler(Grab())

    def kill_supervisor() -> None:
        _wait_for(lambda: bool(seen) and bool(launcher._live.processes), 30)
        (supervisor,) = list(launcher._live.processes)
        seen.extend(_tree(supervisor))
        os.kill(supervisor, signal.SIGKILL)

    killer = threading.Thread(target=kill_supervisor)
    killer.start()
    started = time.monotonic()
    code, _ = launcher.run([sys.executable, "-c", STUBBORN], log, grace=2)
    killer.join()
    assert time.monotonic() - started < 40
    assert code != 0  # killed by a signal: the caller's policy calls that retryable
    assert len(seen) >= 3 and _wait_for(lambda: not _living(seen), 10), _living(seen)


def test_a_detached_service_inherits_only_the_allow_list_and_what_it_is_told(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The served model answers clients: cloud credentials and tokens of the shell that started it stay out."""
    from lmforge.processes.launcher import start_detached, stop_detached

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("HF_HOME", "/somewhere/hf")
    monkeypatch.setenv("MY_SETTING", "wanted")
    script = "import json, os, time; print(json.dumps(dict(os.environ)), flush=True); time.sleep(60)"
    log_file, pid_file = tmp_path / "svc.log", tmp_path / "svc.pid"
    start_detached(
        [sys.executable, "-c", script, "env"], log_file, pid_file, env={"X_SET": "1"}, inherit=["MY_SETTING"]
    )
    try:
        assert _wait_for(lambda: log_file.exists() and log_file.read_text().strip(), 20)
        import json

        seen = json.loads(log_file.read_text().splitlines()[0])
    finally:
        stop_detached(pid_file, wait_s=5)
    assert "AWS_SECRET_ACCESS_KEY" not in seen and "HF_TOKEN" not in seen
    assert seen["HF_HOME"] == "/somewhere/hf" and seen["MY_SETTING"] == "wanted" and seen["X_SET"] == "1"
    assert seen["PATH"] == os.environ["PATH"]

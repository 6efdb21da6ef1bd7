"""`lmforge prefect start|status|stop`: a real Prefect server on 127.0.0.1 that runs are sent to."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmforge.processes.launch import free_port

pytestmark = pytest.mark.slow


def test_server_lifecycle_and_runs_land_in_it(tmp_path: Path, curated_copy: Path) -> None:
    env = {**os.environ, "LMFORGE_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    port = str(free_port())
    cli = [sys.executable, "-m", "lmforge.cli"]

    def lmforge(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=300)

    try:
        started = lmforge("prefect", "start", "--port", port)
        assert started.returncode == 0, started.stderr
        assert f"http://127.0.0.1:{port}/api" in started.stdout
        assert lmforge("prefect", "status").stdout.startswith("running")
        assert (tmp_path / "home" / "server" / "prefect" / "prefect.db").is_file()  # SQLite, in lmforge's home
        with socket.create_connection(("127.0.0.1", int(port)), timeout=2):
            pass
        from tests.conftest import SMALL_CURATE

        overrides = [a for o in SMALL_CURATE for a in ("--set", o)]
        run = lmforge("stage", "curate", "--workspace", str(curated_copy), *overrides)
        assert run.returncode == 0, run.stderr[-2000:]
        assert f"Prefect UI: http://127.0.0.1:{port}" in run.stdout

        from prefect.client.orchestration import PrefectClient

        async def flow_run_names() -> list[str]:
            async with PrefectClient(f"http://127.0.0.1:{port}/api") as client:
                return [r.name for r in await client.read_flow_runs()]

        assert "tiny-cpu" in asyncio.run(flow_run_names())

        # the same pipeline as a deployment, triggered the way users do: `prefect deployment run`
        served = subprocess.Popen(
            [*cli, "deployments", "--serve", "--workspace", str(curated_copy), "--set", "stages=[curate]", *overrides],
            env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            triggered = None
            for _ in range(30):  # the deployment is registered a few seconds after serving starts
                triggered = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "prefect",
                        "deployment",
                        "run",
                        "lmforge-pipeline/tiny-cpu",
                        "--watch",
                        "--watch-timeout",
                        "240",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    env={**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
                )
                if triggered.returncode == 0 or "not found" not in (triggered.stdout + triggered.stderr).lower():
                    break
                time.sleep(2)
            assert triggered is not None and triggered.returncode == 0, triggered.stdout[-2000:]
            assert "Completed" in triggered.stdout
        finally:
            os.killpg(served.pid, signal.SIGTERM)
            served.wait(timeout=30)
        exposed = lmforge("prefect", "start", "--host", "0.0.0.0", "--port", str(free_port()))
        assert exposed.returncode == 0  # already running: the existing local server is reused
    finally:
        began = time.time()
        stopped = lmforge("prefect", "stop")
        stop_s = time.time() - began
    assert stopped.stdout.strip() == "stopped"
    assert stop_s < 3 + 2, stop_s  # SIGTERM is delivered (not blocked, then SIGKILL after 15 s); +2 s CLI start
    assert lmforge("prefect", "status").stdout.startswith("not running")


def test_a_sigkilled_run_leaves_no_temporary_prefect_server(tmp_path: Path) -> None:
    """The temporary API a run without a managed server starts is supervised: SIGKILL of the run stops it."""
    script = (
        "import os, sys, time\n"
        "os.environ.pop('PREFECT_API_URL', None)\n"
        "from lmforge import server\n"
        "server.connect_for_run(); server.wait_for_api()\n"
        "print(server._temporary.port, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "LMFORGE_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    port = int(run.stdout.readline())  # type: ignore[union-attr]
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    run.kill()
    run.wait()
    deadline, closed = time.time() + 10, False
    while time.time() < deadline and not closed:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.25)
        except OSError:
            closed = True
    assert closed, f"the temporary Prefect server on port {port} outlived the SIGKILLed run by 10 s"


def test_exposing_the_server_requires_an_auth_string(tmp_path: Path) -> None:
    env = {**os.environ, "LMFORGE_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_SERVER_API_AUTH_STRING", None)
    result = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "prefect", "start", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2 and "PREFECT_SERVER_API_AUTH_STRING" in result.stderr


def test_a_stale_pid_file_never_signals_an_unrelated_process(tmp_path: Path, monkeypatch) -> None:
    import json

    from lmforge import server

    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path))
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        server.home().mkdir(parents=True)
        (server.home() / "server.json").write_text(
            json.dumps({"pid": bystander.pid, "api_url": "http://[::1]:1/api", "ui_url": "http://[::1]:1"})
        )
        assert server.status().startswith("not running")
        assert server.running_api_url() is None
        assert server.stop() is False
        assert bystander.poll() is None, "stop() signalled a process that is not a Prefect server"
        assert not (server.home() / "server.json").exists()
    finally:
        bystander.kill()
        bystander.wait()

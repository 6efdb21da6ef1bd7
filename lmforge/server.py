"""`lmforge server start|stop|status`: a local Prefect server (UI + API) on SQLite.

The server binds to 127.0.0.1 unless told otherwise, keeps its database under
`~/.lmforge/server` (or $LMFORGE_HOME), and is found again by pid file. While it runs,
`lmforge run` sends runs to it so they stay browsable in the UI; without it Prefect
starts a temporary server for the duration of the run.

Why not just `prefect server start --background` / `prefect server stop`: in Prefect 3.7 the
background server's output goes to pipes of the CLI process that started it, which exits at
once, so its logs are lost (and writes to a closed pipe); it does not wait until the API
answers, and `stop` does not wait until the server is gone. This module starts the same
server (`prefect server start`) with its log in `server.log`, waits for `/health`, refuses to
expose the API without auth, and writes Prefect's own pid file too, so `PREFECT_HOME=...
prefect server stop` works on it as well.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from lmforge.errors import ConfigError


def home() -> Path:
    return Path(os.environ.get("LMFORGE_HOME", Path.home() / ".lmforge")) / "server"


def _state() -> dict | None:
    try:
        return json.loads((home() / "server.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _alive(pid: int) -> bool:
    try:  # reap it first if we started it in this process, or a zombie would look alive
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _is_our_server(pid: int) -> bool:
    """The pid file can outlive the server and the pid be reused: only ever signal a Prefect server."""
    if not _alive(pid):
        return False
    from lmforge.launcher import process_arguments

    if not Path("/proc/self").exists():  # no /proc (macOS): fall back to trusting the pid file
        return True
    cmdline = process_arguments(pid)
    return cmdline is not None and b"prefect" in cmdline and b"server" in cmdline


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as response:
            return response.status == 200
    except OSError:
        return False


def running_api_url() -> str | None:
    """The API URL of the lmforge-managed server, if it is up."""
    state = _state()
    if state and _is_our_server(state["pid"]) and healthy(state["api_url"]):
        return state["api_url"]
    return None


def start(host: str = "127.0.0.1", port: int = 4200, wait_s: float = 90.0) -> str:
    if (url := running_api_url()) is not None:
        return url
    if host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get("PREFECT_SERVER_API_AUTH_STRING"):
        raise ConfigError(f"server host {host}: exposing the API beyond this machine needs "
                          "PREFECT_SERVER_API_AUTH_STRING (user:password) to be set")
    directory = home()
    (directory / "prefect").mkdir(parents=True, exist_ok=True)
    # SQLite in lmforge's home, whatever database an inherited profile names (Prefect 3 reads the
    # SERVER_ name first and still honours the older API_ one)
    database = f"sqlite+aiosqlite:///{directory / 'prefect' / 'prefect.db'}"
    env = {**os.environ, "PREFECT_HOME": str(directory / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_DATABASE_CONNECTION_URL": database, "PREFECT_API_DATABASE_CONNECTION_URL": database}
    with open(directory / "server.log", "ab") as log:  # the child keeps its own copy of the handle
        process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    base = f"http://{_url_host(host)}:{port}"
    api_url = f"{base}/api"
    (directory / "server.json").write_text(json.dumps({"pid": process.pid, "api_url": api_url, "ui_url": base}))
    (directory / "prefect" / "server.pid").write_text(str(process.pid))  # where `prefect server stop` looks
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if healthy(api_url):
            return api_url
        if process.poll() is not None:
            raise RuntimeError(f"prefect server exited with {process.returncode}; see {directory / 'server.log'}")
        time.sleep(1)
    raise RuntimeError(f"prefect server did not answer within {wait_s:.0f}s; see {directory / 'server.log'}")


def stop(wait_s: float = 15.0) -> bool:
    """Stop the managed server (SIGTERM to its process group, SIGKILL if it lingers)."""
    state = _state()
    if not state or not _is_our_server(state["pid"]):
        (home() / "server.json").unlink(missing_ok=True)  # stale: the server is already gone
        return False
    group = os.getpgid(state["pid"])
    os.killpg(group, signal.SIGTERM)
    deadline = time.time() + wait_s
    while _alive(state["pid"]) and time.time() < deadline:
        time.sleep(0.2)
    if _alive(state["pid"]):
        os.killpg(group, signal.SIGKILL)
    (home() / "server.json").unlink(missing_ok=True)
    (home() / "prefect" / "server.pid").unlink(missing_ok=True)
    return True


def status() -> str:
    state = _state()
    if state and _is_our_server(state["pid"]):
        health = "healthy" if healthy(state["api_url"]) else "starting or unhealthy"
        return f"running (pid {state['pid']}, {health}): UI {state['ui_url']}  API {state['api_url']}"
    return "not running (start it with: lmforge server start)"

"""`lmforge prefect start|stop|status`: a local Prefect server (UI + API) on SQLite.

The server binds to 127.0.0.1 unless told otherwise, keeps its database under
`~/.lmforge/server` (or $LMFORGE_HOME), and is found again by pid file. While it runs,
`lmforge run` sends runs to it so they stay browsable in the UI; without it Prefect
starts a temporary server for the duration of the run.

Without a managed server, `lmforge run` gets a temporary API for the run from `connect_for_run`
rather than letting Prefect start one when the first flow begins (see `TemporaryServer`).

Why not just `prefect server start --background` / `prefect server stop`: in Prefect 3.7 the
background server's output goes to pipes of the CLI process that started it, which exits at
once, so its logs are lost (and writes to a closed pipe); it does not wait until the API
answers, and `stop` does not wait until the server is gone. This module starts the same
server (`prefect server start`) with its log in `server.log`, waits for `/health`, refuses to
expose the API without auth, and writes Prefect's own pid file too, so `PREFECT_HOME=...
prefect server stop` works on it as well.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
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
    from lmforge.processes.launcher import process_arguments

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
        raise ConfigError(
            f"server host {host}: exposing the API beyond this machine needs "
            "PREFECT_SERVER_API_AUTH_STRING (user:password) to be set"
        )
    directory = home()
    (directory / "prefect").mkdir(parents=True, exist_ok=True)
    # SQLite in lmforge's home, whatever database an inherited profile names (Prefect 3 reads the
    # SERVER_ name first and still honours the older API_ one)
    database = f"sqlite+aiosqlite:///{directory / 'prefect' / 'prefect.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(directory / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": database,
        "PREFECT_API_DATABASE_CONNECTION_URL": database,
    }
    with (
        open(directory / "server.log", "ab") as log,
        sigterm_deliverable(),
    ):  # the child keeps its own copy of the handle
        process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
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
    return "not running (start it with: lmforge prefect start)"


@contextlib.contextmanager
def sigterm_deliverable() -> Iterator[None]:
    """Processes started inside receive SIGTERM.

    The CLI blocks SIGTERM in its threads (one thread of its own takes it), and a child inherits
    the blocked mask across exec: a server started with it ignores `stop`'s SIGTERM until SIGKILL.
    """
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class TemporaryServer:
    """Prefect's temporary API server for one run, started before Prefect is imported.

    It is the server Prefect starts by itself when no API is configured (the same uvicorn command,
    environment and database), started differently. Prefect's own costs a cached `lmforge run`
    about 13 s on 2 cores: it imports the server's code into the client (~3 s), starts the server
    only when the first flow begins (~5 s with nothing else to do meanwhile), and at exit waits 5 s
    for a server that inherited the CLI's blocked SIGTERM, then kills it. This one starts as soon as
    the CLI knows it needs an API, so it boots while the CLI imports, and it stops on SIGTERM.
    """

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent  # type: ignore[union-attr, arg-type]
        # no block types registered on start: a run stores no blocks, and checking whether the registry
        # changed imports every installed Prefect integration (prefect-dask pulls in distributed: ~1 s)
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_BLOCKS_REGISTER_ON_START": "false",
            "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false",
        }
        # under lmforge.processes.supervise watching this process: a run that is SIGKILLed (no atexit) leaves no
        # server behind, its supervisor stops it within about a second
        supervisor = [
            sys.executable,
            "-m",
            "lmforge.processes.supervise",
            "--grace",
            "5",
            "--quiet",
            "--watch",
            str(os.getpid()),
            "--",
        ]
        with sigterm_deliverable():
            self.process = subprocess.Popen(
                [
                    *supervisor,
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "--app-dir",
                    str(prefect_dir.parent),
                    "--factory",
                    "prefect.server.api.server:create_app",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--log-level",
                    "error",
                    "--lifespan",
                    "on",
                ],
                env=env,
            )
        atexit.register(self.stop)

    def wait(self, wait_s: float = 120.0) -> None:
        """Return once the API answers (Prefect's own gives up after 20 s, too soon on a busy machine)."""
        deadline = time.time() + wait_s
        while not healthy(self.api_url, timeout=1.0):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the temporary Prefect server on port {self.port} exited with "
                    f"{self.process.returncode} (its output is above)"
                )
            if time.time() > deadline:
                raise RuntimeError(f"the temporary Prefect server did not answer within {wait_s:.0f}s")
            time.sleep(0.1)

    def stop(self, wait_s: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_temporary: TemporaryServer | None = None


def connect_for_run() -> str | None:
    """Give this process a Prefect API before Prefect is imported; call `wait_for_api` before the first flow.

    An inherited PREFECT_API_URL or the managed server (`lmforge prefect start`) is used as is and
    returned (there is a UI to browse); otherwise a temporary server is started for the run, and
    None is returned.
    """
    global _temporary
    url = use_running_server()
    if url is None:
        _temporary = TemporaryServer()
        os.environ["PREFECT_API_URL"] = _temporary.api_url
    return url


def wait_for_api() -> None:
    """Return once the temporary server started by `connect_for_run` answers (at once for any other API)."""
    if _temporary is not None:
        _temporary.wait()


def use_running_server() -> str | None:
    """Point this process's Prefect client at an inherited PREFECT_API_URL or the managed server; its API URL, or None."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    url = running_api_url()
    if url:
        os.environ["PREFECT_API_URL"] = url
    return url

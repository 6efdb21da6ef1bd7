"""A server's key goes only to the server we started: the port `free_port` chose was free, not reserved,
and a process that takes it before vLLM binds would answer /health and be sent the key.

The "servers" here are plain HTTP servers in child processes that record every Authorization header
they receive; the foreign one is started beside ours, ours (like the supervisor whose child is vLLM)
listens through a child of its own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmforge.inference.vllm_server import ServerFailed, wait_ready
from lmforge.processes.launch import free_port, listening_pids, listening_sockets, owns_port

KEY = "sk-lmforge-0123456789abcdef0123"
# an HTTP server on 127.0.0.1:PORT answering 200 to everything, with a completion's shape, and
# writing each request's path and Authorization header to RECORD (one JSON line each)
ANSWERING = r"""
import http.server, json, sys
record = open(sys.argv[2], "a")
class Handler(http.server.BaseHTTPRequestHandler):
    def answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        record.write(json.dumps({"path": self.path, "authorization": self.headers.get("Authorization")}) + "\n")
        record.flush()
        body = b'{"choices": [{"text": " world"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""
# a supervisor's stand-in: the server is its child, as vLLM is `lmforge.processes.supervise`'s
THROUGH_A_CHILD = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], *sys.argv[2:]])"


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        os.killpg(process.pid, 9)
        process.wait(timeout=10)


def _start(processes: list[subprocess.Popen], *args: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", *args], start_new_session=True)
    processes.append(process)
    return process


def _listening(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def _received(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_a_port_taken_by_another_process_fails_the_start_and_the_key_is_never_sent(
    tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    port, record = free_port(), tmp_path / "foreign.jsonl"
    foreign = _start(processes, ANSWERING, str(port), str(record))  # took the port before our server bound it
    _listening(port)
    ours = _start(processes, "import time; time.sleep(120)")  # alive, still loading (it never gets the port)
    assert not owns_port(ours.pid, port) and foreign.pid in listening_pids(port)
    with pytest.raises(ServerFailed) as failed:
        wait_ready(f"http://127.0.0.1:{port}", KEY, "model", 20, lambda: ours.poll() is None, lambda: [], pid=ours.pid)
    message = str(failed.value)
    assert "\n" not in message
    assert f"port {port} of 127.0.0.1 was taken by another process (pid {foreign.pid})" in message
    assert "the API key was not sent" in message
    received = _received(record)
    assert received and all(r["path"] == "/health" and r["authorization"] is None for r in received), received
    assert KEY not in record.read_text()


def test_our_own_server_listening_through_a_child_gets_the_key(
    tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    port, record = free_port(), tmp_path / "ours.jsonl"
    ours = _start(processes, THROUGH_A_CHILD, ANSWERING, str(port), str(record))
    _listening(port)
    assert owns_port(ours.pid, port)
    assert ours.pid not in listening_pids(port)  # its child listens, not itself
    wait_ready(f"http://127.0.0.1:{port}", KEY, "model", 20, lambda: ours.poll() is None, lambda: [], pid=ours.pid)
    assert {"path": "/v1/completions", "authorization": f"Bearer {KEY}"} in _received(record)


def test_the_listening_sockets_of_a_port_are_those_a_connection_to_the_host_can_reach() -> None:
    with socket.socket() as loopback, socket.socket() as other, socket.socket() as everywhere:
        loopback.bind(("127.0.0.1", 0))
        port = loopback.getsockname()[1]
        loopback.listen()
        other.bind(("127.0.0.2", 0))  # another address: a connection to 127.0.0.1 does not reach it
        other.listen()
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        assert listening_sockets(port) == listening_sockets(port, "127.0.0.1") and len(listening_sockets(port)) == 1
        assert listening_sockets(other.getsockname()[1]) == set()
        assert len(listening_sockets(other.getsockname()[1], "127.0.0.2")) == 1
        assert len(listening_sockets(everywhere.getsockname()[1])) == 1
        assert owns_port(os.getpid(), port) and os.getpid() in listening_pids(port)
    assert listening_sockets(port) == set() and not owns_port(os.getpid(), port)

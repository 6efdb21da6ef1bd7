"""The endpoint's front: one address across promotions, new connections to the current server, a clean
503 when none answers; its limits (connections, idle time) and a server dying under a connection.
Backends here are plain HTTP servers or sockets; the end-to-end test runs it before vLLM."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from serving.config import ServeConfig

REPO = Path(__file__).resolve().parent.parent


def _backend(answer: str) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = answer.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers["Content-Length"])
            body = self.rfile.read(length)[::-1]  # the request body, reversed: proves it went through whole
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def workspace(tmp_path: Path) -> Iterator[Path]:
    from serving import release

    yield tmp_path
    release.stop(tmp_path)


def test_the_endpoint_keeps_its_port_while_the_server_behind_it_changes(workspace: Path) -> None:
    from serving import release

    cfg = ServeConfig()
    a, port_a = _backend("A")
    b, port_b = _backend("B")
    try:
        endpoint = release.point_front(workspace, cfg, {"host": "127.0.0.1", "port": port_a, "served_name": "a"})
        assert _get(endpoint) == (200, "A")
        payload = bytes(range(256)) * 4096  # 1 MiB through the pipe, both ways
        request = urllib.request.Request(endpoint, data=payload, method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.read() == payload[::-1]
        # a promotion: one write, the same endpoint
        assert (
            release.point_front(workspace, cfg, {"host": "127.0.0.1", "port": port_b, "served_name": "b"}) == endpoint
        )
        assert _get(endpoint) == (200, "B")
        b.shutdown()
        b.server_close()
        status, body = _get(endpoint)  # nobody answers: a clean 503 saying why, not a reset connection
        assert status == 503 and "does not answer" in json.loads(body)["error"]["message"]
        # the front itself dies: the next reconcile starts it on the same port
        assert release.stop_detached(release.front_dir(workspace) / "front.pid", wait_s=5)
        assert (
            release.point_front(workspace, cfg, {"host": "127.0.0.1", "port": port_a, "served_name": "a"}) == endpoint
        )
        assert _get(endpoint) == (200, "A")
    finally:
        a.shutdown()
        a.server_close()


def test_a_configured_port_is_the_endpoint_and_a_changed_one_moves_it(workspace: Path) -> None:
    from lmforge.processes.launch import free_port
    from serving import release

    a, port_a = _backend("A")
    wanted = free_port()
    try:
        target = {"host": "127.0.0.1", "port": port_a, "served_name": "a"}
        assert release.point_front(workspace, ServeConfig(port=wanted), target) == f"http://127.0.0.1:{wanted}"
        moved = free_port()
        assert release.point_front(workspace, ServeConfig(port=moved), target) == f"http://127.0.0.1:{moved}"
        assert _get(f"http://127.0.0.1:{moved}") == (200, "A")
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{wanted}", timeout=5)
    finally:
        a.shutdown()
        a.server_close()


# -- the front's own limits: connections, idle time, a server that dies under a connection -----------

# a server that accepts connections and never answers; with "read", it reads what it is sent first (its
# death then closes the connection with a FIN; unread bytes make it a reset). Prints one line per accept.
SILENT_UPSTREAM = r"""
import socket, sys
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
print(server.getsockname()[1], flush=True)
held = []
while True:
    connection, _ = server.accept()
    if sys.argv[1] == "read":
        connection.recv(65536)
    held.append(connection)
    print("accepted", flush=True)
"""


@contextlib.contextmanager
def _front(target: Path, *options: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """`serving.front` on a free loopback port, forwarding to what `target` names."""
    from lmforge.processes.launch import free_port

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "serving.front", "--listen", f"127.0.0.1:{port}", "--target", str(target), *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        # its line once it listens (a probing connection would be forwarded, and count as one)
        assert process.stdout.readline().startswith("lmforge front on"), f"the front exited with {process.wait()}"
        yield process, port
    finally:
        process.kill()
        process.wait(timeout=10)


def _target(path: Path, port: int) -> Path:
    path.write_text(json.dumps({"host": "127.0.0.1", "port": port, "served_name": "m"}))
    return path


def _answer(connection: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the front sends until it closes the connection (a timeout fails the test)."""
    connection.settimeout(timeout_s)
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def _front_connections(front: subprocess.Popen, port: int) -> list[Any]:
    """The front's TCP connections with clients (any state but LISTEN)."""
    return [c for c in psutil.Process(front.pid).net_connections("tcp") if c.laddr.port == port and c.raddr]


def test_connections_beyond_the_cap_get_a_503_saying_the_front_is_at_capacity(tmp_path: Path) -> None:
    backend, backend_port = _backend("A")
    try:
        with _front(_target(tmp_path / "target.json", backend_port), "--max-connections", "2") as (front, port):
            idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
            deadline = time.monotonic() + 10
            while len(_front_connections(front, port)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            with socket.create_connection(("127.0.0.1", port)) as third:
                answer = _answer(third)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 "), answer
            assert "at capacity" in json.loads(body)["error"]["message"]
            idle[0].close()  # a place frees up: the next connection goes through
            deadline = time.monotonic() + 10
            while _get(f"http://127.0.0.1:{port}")[0] != 200:
                assert time.monotonic() < deadline, "no connection went through after one closed"
                time.sleep(0.1)
            idle[1].close()
    finally:
        backend.shutdown()
        backend.server_close()


def test_a_silent_connection_is_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    backend, backend_port = _backend("A")
    try:
        with _front(_target(tmp_path / "target.json", backend_port), "--idle-timeout-s", "1") as (_, port):
            with socket.create_connection(("127.0.0.1", port)) as silent:
                started = time.monotonic()
                assert _answer(silent) == b""
                assert 0.8 < time.monotonic() - started < 5
            assert _get(f"http://127.0.0.1:{port}") == (200, "A")  # a connection that talks is served
    finally:
        backend.shutdown()
        backend.server_close()


@pytest.mark.parametrize("death", ["reset", "eof"])
def test_a_server_that_dies_under_a_connection_closes_it_promptly_both_ways(tmp_path: Path, death: str) -> None:
    upstream = subprocess.Popen(
        [sys.executable, "-c", SILENT_UPSTREAM, "read" if death == "eof" else "keep"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert upstream.stdout is not None
        upstream_port = int(upstream.stdout.readline())
        with _front(_target(tmp_path / "target.json", upstream_port)) as (front, port):
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            assert upstream.stdout.readline().strip() == "accepted"
            # the request reaches the server before it dies: unread (keep), its death resets the connection;
            # read, it ends with a FIN
            time.sleep(0.3)
            upstream.kill()
            upstream.wait(timeout=10)
            started = time.monotonic()
            assert _answer(client, timeout_s=5) == b""  # EOF, not a client left waiting for an answer
            assert time.monotonic() - started < 3
            deadline = time.monotonic() + 5  # and the front keeps no half of the pipe open
            while _front_connections(front, port):
                assert time.monotonic() < deadline, _front_connections(front, port)
                time.sleep(0.1)
            client.close()
            status, body = _get(f"http://127.0.0.1:{port}")  # the next connection: the server is gone
            assert status == 503 and "does not answer" in json.loads(body)["error"]["message"]
    finally:
        upstream.kill()
        upstream.wait(timeout=10)


def test_after_a_failed_connection_the_front_reads_its_target_again(tmp_path: Path) -> None:
    backend, backend_port = _backend("B")
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        dead_port = gone.getsockname()[1]  # nobody listens there once this closes
    target = _target(tmp_path / "target.json", dead_port)
    try:
        with _front(target) as (_, port):
            assert _get(f"http://127.0.0.1:{port}")[0] == 503
            # rewritten in place within the same timestamp tick (coarse mtimes: ext3, NFS, FAT):
            # the file's inode and mtime say nothing changed
            stamp = target.stat()
            with open(target, "r+") as handle:
                handle.write(json.dumps({"host": "127.0.0.1", "port": backend_port, "served_name": "m"}))
                handle.truncate()
            os.utime(target, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
            assert _get(f"http://127.0.0.1:{port}") == (200, "B")
    finally:
        backend.shutdown()
        backend.server_close()

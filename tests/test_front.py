"""The endpoint's front: one address across promotions, new connections to the current server, a clean
503 when none answers. Backends here are plain HTTP servers; the end-to-end test runs it before vLLM."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.config import ServeConfig


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
    from lmforge.launch import free_port
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

"""The served model's stable address: a TCP front on `serve.host:serve.port` that forwards every new
connection to whichever vLLM server is current.

    python -m serving.front --listen 127.0.0.1:8000 --target <workspace>/serving/front/target.json

Why: a new model is started beside the running one and smoke-tested before it takes over, so the
two need different ports; without a front the endpoint's port changed at every promotion and a
client configured with the documented port broke. With it, vLLM servers listen on loopback ports
of their own (never exposed), and a promotion is one atomic write of `target.json`: connections
opened after it reach the new server, those already open finish on the old one, which is then
stopped. A plain byte pipe, not an HTTP proxy: streaming, keep-alive and the API key check (in
each server's `lmforge.vllm_guard`) pass through unchanged. When no server answers, a new
connection gets `503` with a JSON error, so a client sees why. Standard library only, so it starts
in tens of milliseconds; it runs detached under `lmforge.supervise` like the servers.

Why not nginx/HAProxy/Envoy: none ships in the Python environments lmforge installs, and what is
needed here is a switch between two loopback ports, not routing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

CHUNK = 1 << 16
UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


class Target:
    """The current backend, read again whenever `target.json` changes (it is replaced atomically)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stamp: tuple[int, int] | None = None
        self.address: tuple[str, int] | None = None

    def get(self) -> tuple[str, int] | None:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self.address, self.stamp = None, None
            return None
        stamp = (stat.st_mtime_ns, stat.st_ino)
        if stamp != self.stamp:
            try:
                record = json.loads(self.path.read_text())
                self.address = (str(record["host"]), int(record["port"]))
            except (OSError, ValueError, KeyError, TypeError):
                self.address = None
            self.stamp = stamp
        return self.address


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


async def _unavailable(writer: asyncio.StreamWriter, why: str) -> None:
    body = json.dumps({"error": {"message": f"no model is being served: {why}", "type": "unavailable"}}).encode()
    with contextlib.suppress(ConnectionError, OSError):
        writer.write(UNAVAILABLE % (len(body), body))
        await writer.drain()


async def _handle(target: Target, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    address = target.get()
    try:
        if address is None:
            await _unavailable(writer, "the front has no current server")
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*address)
        except OSError as exc:
            await _unavailable(writer, f"the current server does not answer ({exc.strerror or exc})")
            return
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            upstream_writer.close()
    finally:
        writer.close()


async def serve(host: str, port: int, target: Path) -> None:
    current = Target(target)
    server = await asyncio.start_server(
        lambda r, w: _handle(current, r, w), host=host, port=port, reuse_address=True, backlog=1024
    )
    print(f"lmforge front on {host}:{port} -> {target}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serving.front")
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept clients on")
    parser.add_argument("--target", required=True, type=Path, help="the JSON file naming the current server")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    try:
        asyncio.run(serve(host.strip("[]"), int(port), args.target))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"lmforge front: cannot listen on {args.listen}: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

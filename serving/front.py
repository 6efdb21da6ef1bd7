"""The served model's stable address: a TCP front on `serve.host:serve.port` that forwards every new
connection to whichever vLLM server is current.

    python -m serving.front --listen 127.0.0.1:8000 --target <workspace>/serving/front/target.json \
        [--max-connections 1024] [--idle-timeout-s 600]

Why: a new model is started beside the running one and smoke-tested before it takes over, so the
two need different ports; without a front the endpoint's port changed at every promotion and a
client configured with the documented port broke. With it, vLLM servers listen on loopback ports
of their own (never exposed), and a promotion is one atomic write of `target.json`: connections
opened after it reach the new server, those already open finish on the old one, which is then
stopped. A plain byte pipe, not an HTTP proxy: streaming, keep-alive and the API key check (in
each server's `lmforge.inference.vllm_guard`) pass through unchanged. When no server answers, a new
connection gets `503` with a JSON error, so a client sees why. Standard library only, so it starts
in tens of milliseconds; it runs detached under `lmforge.processes.supervise` like the servers.

Limits, because the front is the one process every client reaches:

- at most `--max-connections` client connections at once (each holds two sockets); one beyond gets
  the 503 answer saying the front is at capacity, so a flood of idle connections cannot exhaust
  the process's file descriptors and lock every client out;
- a connection with no byte in either direction for `--idle-timeout-s` is closed (a streamed answer
  sends bytes all along; a long answer that is not streamed must arrive within that time);
- the server's end of a connection ends the client's: when the server closes it or dies (a FIN or
  a reset), the client gets EOF at once and the connection closes after a short linger in which
  what the client still sends is read and dropped (closing on unread bytes would send a reset that
  can destroy the end of the answer at the client). No half-open pipe is left behind;
- a server that cannot be reached makes the front read `target.json` again at the next connection
  even if its timestamp did not move (coarse mtimes, an inode reused), so a promotion written
  meanwhile is never missed; a connect that hangs is given up after `CONNECT_TIMEOUT_S`.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 1 << 16
CONNECT_TIMEOUT_S = 10.0  # loopback answers at once; a server that does not is as good as down
LINGER_S = 1.0  # after the server's end: read (and drop) what the client still sends, then close
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

    def forget(self) -> None:
        """Read the file again at the next `get`, whatever its timestamp says."""
        self.stamp = None


@dataclass
class Front:
    """What every connection shares: the target, the limits, and how many connections are open."""

    target: Target
    max_connections: int
    idle_timeout_s: float
    open: int = 0


@dataclass
class Activity:
    """When a byte last passed a connection, either way (its idle clock)."""

    at: float


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: Activity) -> bool:
    """Copy until EOF, then pass the EOF on; True if it ended so, False if a side failed (a reset)."""
    loop = asyncio.get_running_loop()
    try:
        while chunk := await reader.read(CHUNK):
            activity.at = loop.time()
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        return True
    except (ConnectionError, OSError):
        return False


async def _idle(activity: Activity, timeout_s: float) -> None:
    """Return once no byte has passed for `timeout_s`."""
    loop = asyncio.get_running_loop()
    while (left := activity.at + timeout_s - loop.time()) > 0:
        await asyncio.sleep(left)


async def _drain(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(CHUNK):
            pass


async def _relay(
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    idle_timeout_s: float,
) -> None:
    """Both directions until the server's side ends, the client's fails, or nothing passes for the idle
    timeout. A client that only half-closes (its request is whole) still gets the whole answer."""
    activity = Activity(asyncio.get_running_loop().time())
    to_server = asyncio.ensure_future(_pipe(client[0], server[1], activity))
    to_client = asyncio.ensure_future(_pipe(server[0], client[1], activity))
    idle = asyncio.ensure_future(_idle(activity, idle_timeout_s))
    pending = {to_server, to_client, idle}
    try:
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if idle in done or (to_server in done and not to_server.result()):
                return
            if to_client in done:
                break
        # the answer is over, or the server died: the client gets its EOF now, then a short linger
        if not to_client.result() and client[1].can_write_eof():
            with contextlib.suppress(ConnectionError, OSError):
                client[1].write_eof()
        to_server.cancel()  # and waited for: one reader has one reading task at a time
        await asyncio.gather(to_server, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_drain(client[0]), LINGER_S)
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _unavailable(writer: asyncio.StreamWriter, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "unavailable"}}).encode()
    with contextlib.suppress(ConnectionError, OSError):
        writer.write(UNAVAILABLE % (len(body), body))
        await writer.drain()


async def _handle(front: Front, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    if front.open >= front.max_connections:
        await _unavailable(
            writer, f"the endpoint's front is at capacity ({front.max_connections} connections); retry later"
        )
        writer.close()
        return
    front.open += 1
    try:
        address = front.target.get()
        if address is None:
            await _unavailable(writer, "no model is being served: the front has no current server")
            return
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection(*address), CONNECT_TIMEOUT_S)
        except OSError as exc:  # TimeoutError (wait_for's) is one too
            front.target.forget()
            why = getattr(exc, "strerror", None) or str(exc) or f"no answer within {CONNECT_TIMEOUT_S:.0f} s"
            await _unavailable(writer, f"no model is being served: the current server does not answer ({why})")
            return
        try:
            await _relay((reader, writer), upstream, front.idle_timeout_s)
        finally:
            upstream[1].close()
    finally:
        front.open -= 1
        writer.close()


async def serve(host: str, port: int, target: Path, max_connections: int = 1024, idle_timeout_s: float = 600.0) -> None:
    front = Front(Target(target), max_connections, idle_timeout_s)
    server = await asyncio.start_server(
        lambda r, w: _handle(front, r, w), host=host, port=port, reuse_address=True, backlog=1024
    )
    print(f"lmforge front on {host}:{port} -> {target}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="serving.front")
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept clients on")
    parser.add_argument("--target", required=True, type=Path, help="the JSON file naming the current server")
    parser.add_argument(
        "--max-connections", type=_positive(int), default=1024, help="client connections at once (503 beyond)"
    )
    parser.add_argument(
        "--idle-timeout-s", type=_positive(float), default=600.0, help="close a connection silent both ways this long"
    )
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    try:
        asyncio.run(serve(host.strip("[]"), int(port), args.target, args.max_connections, args.idle_timeout_s))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"lmforge front: cannot listen on {args.listen}: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value

    return parse


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""The front door of every vLLM server lmforge starts: a key on every path, bounded requests.

vLLM's own key check (VLLM_API_KEY) guards only paths under /v1, /v2, /inference and /cohere:
`POST /invocations`, `/tokenize`, `/detokenize`, `/metrics`, `/version`, `/docs` and
`/openapi.json` answer anyone. It also accepts any `n`/`best_of` and any body size. vLLM takes
extra ASGI middleware by import path (`--middleware lmforge.vllm_guard.Guard`, added outermost),
and this is that middleware; it is written here because no maintained package wraps vLLM's
server this way. Its settings come from the environment `lmforge.vllm_server.server_env` gives
the server (the key never appears on a command line):

- LMFORGE_GUARD_KEY_SHA256: SHA-256 of the bearer key (empty: no key is required, loopback only);
- LMFORGE_GUARD_MAX_BODY: largest request body in bytes (413 beyond, read or declared);
- LMFORGE_GUARD_MAX_N: largest `n` and `best_of` of a JSON request (400 beyond);
- LMFORGE_GUARD_MAX_CONCURRENT: requests in flight per key (429 beyond).

`/health` (and `/ping`, what load balancers and vLLM's own health checks use) stay open, with no
body. Every refusal is a JSON `{"error": ...}` with a 4xx status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health", "/ping")
DRAIN_FACTOR = 64  # a refused body is read up to this many times the limit
KEY_SHA_ENV = "LMFORGE_GUARD_KEY_SHA256"


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def guard_env(api_key: str, max_body: int, max_n: int, max_concurrent: int) -> dict[str, str]:
    """The server's environment for the guard (see the module docstring)."""
    return {
        KEY_SHA_ENV: key_sha256(api_key) if api_key else "",
        "LMFORGE_GUARD_MAX_BODY": str(max_body),
        "LMFORGE_GUARD_MAX_N": str(max_n),
        "LMFORGE_GUARD_MAX_CONCURRENT": str(max_concurrent),
    }


async def _refuse(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """Pure ASGI middleware (vLLM adds it with no arguments: settings come from the environment)."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.key_sha = os.environ.get(KEY_SHA_ENV, "")
        self.max_body = int(os.environ.get("LMFORGE_GUARD_MAX_BODY", str(1 << 20)))
        self.max_n = int(os.environ.get("LMFORGE_GUARD_MAX_N", "4"))
        self.max_concurrent = int(os.environ.get("LMFORGE_GUARD_MAX_CONCURRENT", "64"))
        self.in_flight = 0  # one event loop: no lock needed between awaits

    def _authorized(self, scope: Scope) -> bool:
        if not self.key_sha:
            return True
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        return hmac.compare_digest(key_sha256(token), self.key_sha)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and path in OPEN_PATHS and scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _refuse(send, 401, "a valid `Authorization: Bearer <key>` header is required")
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._drain(receive, int(declared))
            return await _refuse(send, 413, f"the request body is over {self.max_body} bytes")
        if self.in_flight >= self.max_concurrent:
            return await _refuse(send, 429, f"more than {self.max_concurrent} requests in flight for this key")
        self.in_flight += 1
        try:
            body, more = b"", True
            while more:  # read it all (bounded) before vLLM sees it: a JSON body is checked as a whole
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body:
                    if more:
                        await self._drain(receive, DRAIN_FACTOR * self.max_body)
                    return await _refuse(send, 413, f"the request body is over {self.max_body} bytes")
            problem = self._bad_sampling(headers, body)
            if problem:
                return await _refuse(send, 400, problem)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: the disconnect, when it comes

            return await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1

    @staticmethod
    async def _drain(receive: Receive, limit: int) -> None:
        """Read (and drop) a refused body up to `limit` bytes, so the client, still sending, reads the 413
        instead of a reset connection; beyond the limit the connection is closed on it."""
        seen, more = 0, True
        while more and seen <= limit:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)

    def _bad_sampling(self, headers: dict[bytes, bytes], body: bytes) -> str | None:
        if not body or b"json" not in headers.get(b"content-type", b"application/json"):
            return None
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None  # vLLM answers malformed JSON itself, with a 4xx
        if not isinstance(request, dict):
            return None
        for field in ("n", "best_of"):
            value = request.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.max_n:
                return f"{field}={value} is over this server's limit of {self.max_n}"
        return None

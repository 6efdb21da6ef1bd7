"""The front door of every vLLM server lmforge starts: a key on every path, bounded requests.

vLLM's own key check (VLLM_API_KEY) guards only paths under /v1, /v2, /inference and /cohere:
`POST /invocations`, `/tokenize`, `/detokenize`, `/metrics`, `/version`, `/docs` and
`/openapi.json` answer anyone. It also accepts any `n`/`best_of` and any body size. vLLM takes
extra ASGI middleware by import path (`--middleware lmforge.inference.vllm_guard.Guard`, added outermost),
and this is that middleware; it is written here because no maintained package wraps vLLM's
server this way. Its settings come from the environment `lmforge.inference.vllm_server.server_env` gives
the server (the key never appears on a command line):

- LMFORGE_GUARD_KEY_SHA256: SHA-256 of the bearer key (empty: no key is required, loopback only);
- LMFORGE_GUARD_MAX_BODY: largest request body in bytes (413 beyond, read or declared);
- LMFORGE_GUARD_MAX_N: largest `n` and `best_of` of a JSON request (400 beyond);
- LMFORGE_GUARD_MAX_PROMPTS: most prompts one request may carry (`prompt`/`input` lists; 400 beyond);
- LMFORGE_GUARD_MAX_TOKENS: most tokens one request may ask to generate, choices x prompts x
  max_tokens, a missing `max_tokens` counted as the served context (LMFORGE_GUARD_CONTEXT; 400 beyond);
- LMFORGE_GUARD_MAX_CONCURRENT: requests in flight per key (429 beyond);
- LMFORGE_GUARD_ADMIN_KEY_SHA256: SHA-256 of the management key (empty: adapter management is off);
- LMFORGE_GUARD_ADAPTER_ROOTS: the folders (os.pathsep-separated) adapters may be loaded from;
- LMFORGE_GUARD_PATHS: the paths clients may use (os.pathsep-separated; 404 for the others, once the key
  is checked). vLLM also mounts routes lmforge does not serve, some of which change the server
  (`/scale_elastic_ep`, `/v1/responses` keeps responses for anyone with the key to read,
  `/v1/chat/completions/batch` carries many conversations past the per-request bounds);
- LMFORGE_GUARD_DRAIN_FILE: while this file exists the server is being replaced: every response
  carries `Connection: close`, so a client's kept-alive connection (pinned by the front to this
  server) ends after its current request and the next one reaches the new server.

Numbers are read as vLLM's pydantic models read them (lax): `"64"` and `64.0` are 64, so a bound
cannot be walked around with another JSON type.

Adapter management (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`; vLLM registers them with
VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs the management key, which only the release holds: the
client key gets 403 there, as it does on SageMaker's `/adapters` routes, which lmforge does not use
and refuses to every key. A load must name a folder inside the adapter roots (symlinks resolved)
and may not replace the weights behind a served name (`load_inplace`).

`/health` (and `/ping`, what load balancers and vLLM's own health checks use) stay open, with no
body. Every refusal is a JSON `{"error": ...}` with a 4xx status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = ("/health", "/ping")
MANAGEMENT_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
REFUSED_PREFIX = "/adapters"  # SageMaker's adapter routes (vLLM adds them beside its own): never used here
DRAIN_FACTOR = 64  # a refused body is read up to this many times the limit
KEY_SHA_ENV = "LMFORGE_GUARD_KEY_SHA256"
ADMIN_SHA_ENV = "LMFORGE_GUARD_ADMIN_KEY_SHA256"
DRAIN_ENV = "LMFORGE_GUARD_DRAIN_FILE"
PATHS_ENV = "LMFORGE_GUARD_PATHS"
# what lmforge serves: OpenAI's chat and completions, the model list, and the operations paths
CLIENT_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/metrics",
    "/version",
    "/openapi.json",
    "/docs",
    "/health",
    "/ping",
)


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Limits:
    """What one request may cost (see the module docstring)."""

    max_body: int = 1 << 20
    max_n: int = 4
    max_prompts: int = 64
    max_tokens: int = 1 << 17
    context: int = 4096
    max_concurrent: int = 64


def guard_env(
    api_key: str,
    limits: Limits,
    admin_key: str = "",
    adapter_roots: tuple[Path, ...] = (),
    paths: tuple[str, ...] = CLIENT_PATHS,
) -> dict[str, str]:
    """The server's environment for the guard (see the module docstring)."""
    return {
        PATHS_ENV: os.pathsep.join(paths),
        KEY_SHA_ENV: key_sha256(api_key) if api_key else "",
        ADMIN_SHA_ENV: key_sha256(admin_key) if admin_key else "",
        "LMFORGE_GUARD_ADAPTER_ROOTS": os.pathsep.join(str(Path(r).resolve()) for r in adapter_roots),
        "LMFORGE_GUARD_MAX_BODY": str(limits.max_body),
        "LMFORGE_GUARD_MAX_N": str(limits.max_n),
        "LMFORGE_GUARD_MAX_PROMPTS": str(limits.max_prompts),
        "LMFORGE_GUARD_MAX_TOKENS": str(limits.max_tokens),
        "LMFORGE_GUARD_CONTEXT": str(limits.context),
        "LMFORGE_GUARD_MAX_CONCURRENT": str(limits.max_concurrent),
    }


def _lax_int(value: Any) -> int | None:
    """`value` as pydantic's lax int reads it (vLLM's request models): 64, 64.0, "64", " 64 ", True;
    None for what it would refuse (vLLM answers those itself)."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value == int(value) else None
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
        return int(number) if math.isfinite(number) and number == int(number) else None
    return None


def _prompts(value: Any) -> int:
    """Prompts in a `prompt`/`input` field: a text or one list of token ids is one, a list of them many."""
    if not isinstance(value, list) or not value:
        return 1
    return 1 if all(isinstance(v, int) for v in value) else len(value)


def _within(path: str, roots: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root + os.sep) for root in roots)


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
        self.admin_sha = os.environ.get(ADMIN_SHA_ENV, "")
        self.adapter_roots = [r for r in os.environ.get("LMFORGE_GUARD_ADAPTER_ROOTS", "").split(os.pathsep) if r]
        plain = Limits()
        self.limits = Limits(
            **{
                name: int(os.environ.get(f"LMFORGE_GUARD_{name.upper()}", str(getattr(plain, name))))
                for name in plain.__dataclass_fields__
            }
        )
        self.drain_file = os.environ.get(DRAIN_ENV, "")
        self.paths = frozenset(os.environ.get(PATHS_ENV, os.pathsep.join(CLIENT_PATHS)).split(os.pathsep))
        self.in_flight = 0  # one event loop: no lock needed between awaits

    def _closing(self, send: Send) -> Send:
        """`send` that adds `Connection: close` to the response while the server is draining (uvicorn
        then closes the connection after it: the standard way to move kept-alive clients)."""

        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start" and os.path.exists(self.drain_file):
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return closing if self.drain_file else send

    @staticmethod
    def _token(scope: Scope) -> str | None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return token if scheme.lower() == "bearer" and token else None

    @staticmethod
    def _matches(token: str | None, sha: str) -> bool:
        return bool(sha) and token is not None and hmac.compare_digest(key_sha256(token), sha)

    def _access(self, scope: Scope, path: str) -> tuple[int, str] | None:
        """None when the request may go on; else (status, why)."""
        token = self._token(scope)
        if path == REFUSED_PREFIX or path.startswith(REFUSED_PREFIX + "/"):
            return 403, "adapter management goes through /v1/load_lora_adapter with the management key"
        if path in MANAGEMENT_PATHS:
            if not self.admin_sha:
                return 403, "adapter management is off on this server"
            if self._matches(token, self.admin_sha):
                return None
            if not self.key_sha or self._matches(token, self.key_sha):
                return 403, "the client key cannot manage adapters; the release holds the management key"
            return 401, "a valid `Authorization: Bearer <key>` header is required"
        if self.key_sha and not self._matches(token, self.key_sha):
            return 401, "a valid `Authorization: Bearer <key>` header is required"
        if path not in self.paths:
            return 404, f"{path} is not served here (serve.engine.api_paths lists what is)"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http":
            send = self._closing(send)
        if scope["type"] == "http" and path in OPEN_PATHS and scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        refused = self._access(scope, path)
        if refused is not None:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _refuse(send, *refused)
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        if path in MANAGEMENT_PATHS:
            scope = self._as_client(scope)
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        max_body = self.limits.max_body
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            await self._drain(receive, int(declared))
            return await _refuse(send, 413, f"the request body is over {max_body} bytes")
        if self.in_flight >= self.limits.max_concurrent:
            return await _refuse(send, 429, f"more than {self.limits.max_concurrent} requests in flight for this key")
        self.in_flight += 1
        try:
            body, more = b"", True
            while more:  # read it all (bounded) before vLLM sees it: a JSON body is checked as a whole
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > max_body:
                    if more:
                        await self._drain(receive, DRAIN_FACTOR * max_body)
                    return await _refuse(send, 413, f"the request body is over {max_body} bytes")
            problem = self._bad_request(path, body)
            if problem:
                return await _refuse(send, *problem)
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
    def _as_client(scope: Scope) -> Scope:
        """A management request the guard let through, carrying the server's own key: vLLM checks its
        key (VLLM_API_KEY, the clients') on /v1 paths itself, behind the guard."""
        upstream = os.environ.get("VLLM_API_KEY", "")
        if not upstream:
            return scope
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"authorization"]
        return {**scope, "headers": [*headers, (b"authorization", f"Bearer {upstream}".encode("latin-1"))]}

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

    def _bad_request(self, path: str, body: bytes) -> tuple[int, str] | None:
        """Whatever its content type says (vLLM may read it as JSON either way), a JSON object body is
        checked: its cost, and for an adapter load, where the adapter comes from."""
        try:
            request = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            return None  # vLLM answers malformed JSON itself, with a 4xx
        if not isinstance(request, dict):
            return None
        if path == MANAGEMENT_PATHS[0]:
            return self._bad_load(request)
        problem = self._cost(request)
        return (400, problem) if problem else None

    def _cost(self, request: dict[str, Any]) -> str | None:
        limits = self.limits
        choices = 1
        for field in ("n", "best_of"):
            value = _lax_int(request.get(field))
            if value is not None and value > limits.max_n:
                return f"{field}={value} is over this server's limit of {limits.max_n}"
            choices = max(choices, value or 1)
        prompts = max(_prompts(request.get("prompt")), _prompts(request.get("input")))
        if prompts > limits.max_prompts:
            return f"{prompts} prompts in one request is over this server's limit of {limits.max_prompts}"
        wanted = [_lax_int(request.get(f)) for f in ("max_tokens", "max_completion_tokens")]
        per_choice = max((w for w in wanted if w is not None), default=limits.context)
        cost = choices * prompts * max(per_choice, 1)
        if cost > limits.max_tokens:
            return (
                f"the request asks for up to {cost} tokens ({choices} choice(s) x {prompts} prompt(s) x {per_choice} "
                f"max tokens), over this server's limit of {limits.max_tokens}"
            )
        return None

    def _bad_load(self, request: dict[str, Any]) -> tuple[int, str] | None:
        path = request.get("lora_path")
        if not isinstance(path, str) or not path:
            return 400, "lora_path must be a folder path"
        if request.get("load_inplace") not in (None, False):
            return 403, "load_inplace is refused: a served name's weights are never replaced in place"
        if not _within(path, self.adapter_roots):
            return 403, f"lora_path {path!r} is outside the adapter folders this server may load from"
        return None

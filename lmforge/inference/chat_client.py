"""Many chat completions against one OpenAI-compatible endpoint: bounded concurrency, retries with
backoff, one line when the endpoint cannot be reached.

Used by the evaluation stage for the answers a model gives (its own temporary vLLM server) and for
an LLM judge (any OpenAI-compatible endpoint, or a model lmforge serves for the step). The
official `openai` client does the HTTP; what it does not do is the batch around it: a fixed number
of requests in flight, a retry schedule that says what it waited for, and a failure that names the
endpoint and the cause in one line instead of a traceback per thread. The key is never logged:
only its fingerprint (`fingerprint`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import DeterministicError, LmforgeError

log = logging.getLogger(__name__)


class EndpointUnreachable(LmforgeError):
    """The endpoint did not answer (connection refused, timeouts, 5xx, rate limits) after every retry:
    running again later can succeed."""

    retryable = True


class EndpointRefused(DeterministicError):
    """The endpoint answered with an error a retry would repeat (bad key, unknown model, bad request)."""


def fingerprint(key: str) -> str:
    """What logs show instead of a key."""
    return f"sha256:{hashlib.sha256(key.encode()).hexdigest()[:12]}" if key else "(none)"


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    choices: tuple[str, ...] | None = None  # vLLM's structured outputs: the reply is one of these


@dataclass
class ChatEndpoint:
    """An OpenAI-compatible server: `base_url` ends in /v1."""

    base_url: str
    model: str
    api_key: str = field(repr=False, default="")
    what: str = "endpoint"  # how errors name it: "judge endpoint", "answers of the sft model"
    concurrency: int = 4
    retries: int = 3
    backoff_s: float = 1.0
    timeout_s: float = 60.0
    calls: int = 0  # completions requested of the endpoint (a cached rerun makes none)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def describe(self) -> str:
        return f"{self.what} {self.base_url} (model {self.model}, key {fingerprint(self.api_key)})"

    def _client(self) -> Any:
        from openai import OpenAI

        for noisy in ("httpx", "openai"):  # a line per request at INFO: hundreds per step
            logging.getLogger(noisy).setLevel(logging.WARNING)
        # retries are ours (they log what they wait for and end in one line)
        return OpenAI(base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, timeout=self.timeout_s)

    def complete(self, client: Any, request: ChatRequest) -> str:
        import openai

        extra: dict[str, Any] = {}
        if request.choices:
            extra["structured_outputs"] = {"choice": list(request.choices)}
        last: BaseException | None = None
        for attempt in range(self.retries + 1):
            if self._stop.is_set():  # another request already failed: the batch is over
                raise EndpointUnreachable(f"{self.describe()}: batch stopped")
            try:
                self.calls += 1
                response = client.chat.completions.create(
                    model=self.model,
                    messages=request.messages,
                    max_tokens=request.max_tokens,
                    temperature=request.temperature,
                    seed=request.seed,
                    extra_body=extra or None,
                )
                return response.choices[0].message.content or ""
            except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as exc:
                last = exc
                if attempt < self.retries:
                    wait_s = self.backoff_s * 2**attempt
                    log.info("%s: %s; retrying in %.1fs", self.what, _cause(exc), wait_s)
                    self._stop.wait(wait_s)
            except openai.APIStatusError as exc:
                hint = " (is its key set?)" if exc.status_code in (401, 403) else ""
                raise EndpointRefused(
                    f"{self.describe()} refused the request: HTTP {exc.status_code} {_cause(exc)}{hint}"
                ) from None
        assert last is not None
        raise EndpointUnreachable(
            f"{self.describe()} unreachable after {self.retries + 1} tries: {_cause(last)}"
        ) from None

    def complete_all(
        self, requests: Sequence[ChatRequest], done: Callable[[int, str], None] | None = None
    ) -> list[str]:
        """Every request's reply, in order, at most `concurrency` in flight; `done(i, reply)` is called as
        each arrives (callers cache there, so what finished before a failure is kept). The first failure
        stops the rest and is raised."""
        if not requests:
            return []
        client = self._client()
        self._stop.clear()
        replies: list[str | None] = [None] * len(requests)

        def one(index: int) -> None:
            reply = self.complete(client, requests[index])
            replies[index] = reply
            if done is not None:
                done(index, reply)

        with ThreadPoolExecutor(max_workers=max(1, self.concurrency)) as pool:
            futures = [pool.submit(one, i) for i in range(len(requests))]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                self._stop.set()
                for future in futures:
                    future.cancel()
                raise failed.exception()  # type: ignore[misc]
        return [r if r is not None else "" for r in replies]


def _cause(exc: BaseException) -> str:
    message = str(getattr(exc, "message", "") or exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0] if message else ''}".rstrip(": ")

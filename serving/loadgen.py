"""Steady client load on a served model, for proving that a promotion or a rollback drops nothing.

`SteadyLoad` runs N concurrent users through the official `openai` client (no retries: a failed
request is counted, not hidden), each cycling through chat and completions, streamed and not, with
a think time between requests, for as long as it runs (on 2 CPU cores, back-to-back users would
leave no CPU for the candidate server starting beside the served one). Every request is recorded
with its start, its end, the model that answered and its outcome; `summary(start, end)` gives the
requests sent, failed and the latency p50/p99 of those that started in a window, so a switch can
be compared with the minutes before it.

Why not vLLM's `benchmark_serving`: it sends a fixed request count at a rate and reports one total;
here the load has to run across an event (the switch) and be cut into windows around it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

KINDS = ("chat", "chat-stream", "completion", "completion-stream")


@dataclass
class Request:
    kind: str
    started: float
    ended: float
    ok: bool
    model: str = ""
    error: str = ""


@dataclass
class SteadyLoad:
    """`users` clients on `base_url` (the endpoint, through the front) asking for `model` until stopped."""

    base_url: str
    api_key: str
    model: str
    users: int = 16
    max_tokens: int = 8
    pause_s: float = 2.0  # each user's think time between requests (0: back to back)
    kinds: tuple[str, ...] = KINDS  # completions only for a model without a chat template
    records: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SteadyLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Request]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=300)
        return self.records

    async def _run(self) -> None:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, timeout=120) as c:
            await asyncio.gather(*(self._user(c, k) for k in range(self.users)))

    async def _user(self, client: Any, k: int) -> None:
        turn = k
        while not self._stop.is_set():
            kind = self.kinds[turn % len(self.kinds)]
            turn += 1
            started = time.time()
            try:
                model = await self._ask(client, kind, f"What is {k} + {turn % 9}?")
                self.records.append(Request(kind, started, time.time(), True, model))
            except Exception as exc:  # noqa: BLE001 - every failure is the measurement
                self.records.append(Request(kind, started, time.time(), False, error=f"{type(exc).__name__}: {exc}"))
            await asyncio.sleep(self.pause_s)

    async def _ask(self, client: Any, kind: str, question: str) -> str:
        """One request of `kind`, read to its end; the model that answered. A stream must end with a finish reason."""
        common = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0}
        messages = [{"role": "user", "content": question}]
        if kind == "chat":
            reply = await client.chat.completions.create(messages=messages, **common)
            return str(reply.model)
        if kind == "completion":
            reply = await client.completions.create(prompt=question, **common)
            return str(reply.model)
        create = client.chat.completions.create if kind == "chat-stream" else client.completions.create
        stream = await create(
            stream=True, **common, **({"messages": messages} if kind == "chat-stream" else {"prompt": question})
        )
        model, finished = "", False
        async for chunk in stream:
            model = chunk.model or model
            finished = finished or any(choice.finish_reason for choice in chunk.choices)
        if not finished:
            raise RuntimeError("the stream ended without a finish reason")
        return model


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary(records: list[Request], start: float, end: float) -> dict[str, Any]:
    """Requests that started in [start, end): sent, failed, latency p50/p99 (ms), the models that answered."""
    window = [r for r in records if start <= r.started < end]
    latencies = [1000 * (r.ended - r.started) for r in window if r.ok]
    return {
        "sent": len(window),
        "failed": sum(not r.ok for r in window),
        "p50_ms": round(_percentile(latencies, 0.50), 1),
        "p99_ms": round(_percentile(latencies, 0.99), 1),
        "models": sorted({r.model for r in window if r.ok}),
        "errors": sorted({r.error[:160] for r in window if not r.ok})[:5],
    }

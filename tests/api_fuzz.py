"""Schema-driven fuzzing of a served model: schemathesis generates requests from the server's own
OpenAPI schema (`/openapi.json`, fetched with the key) and sends each one twice, without the key and
with it, to a server on 127.0.0.1. Bounded in examples per operation and in total time.

What must hold for every request:
- no 5xx, with or without the key;
- without the key, nothing but the open health checks answers 2xx (the guard's 401);
- with the key, a 2xx completion never carries more than the guard's bounds allow: choices at most
  `max_n` x `max_prompts`, generated tokens at most `max_tokens` (lmforge.inference.vllm_guard.Limits), counted
  from the response, not from the request, so a request the guard misjudged is still caught.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

OPEN = {("GET", "/health"), ("HEAD", "/health"), ("GET", "/ping"), ("HEAD", "/ping")}
GENERATING = ("/v1/completions", "/v1/chat/completions")


@dataclass
class FuzzReport:
    examples: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # "keyed 200", "anonymous 401", ...
    failures: list[str] = field(default_factory=list)
    per_operation: dict[str, int] = field(default_factory=dict)


def _usage_tokens(response: Any) -> tuple[int, int] | None:
    """(choices, completion tokens) of a non-streamed completion; None for anything else."""
    if "json" not in response.headers.get("content-type", ""):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or "choices" not in body:
        return None
    usage = body.get("usage") or {}
    return len(body["choices"]), int(usage.get("completion_tokens") or 0)


def fuzz(base_url: str, key: str, limits: Any, *, examples: int, budget_s: float) -> FuzzReport:
    """Fuzz every operation of the server's schema; `limits` is the server's lmforge.inference.vllm_guard.Limits."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    spec = requests.get(f"{base_url}/openapi.json", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    report = FuzzReport()
    deadline = time.monotonic() + budget_s
    session = requests.Session()
    auth = {"Authorization": f"Bearer {key}"}

    def one(case: Any) -> None:
        if time.monotonic() > deadline:
            return
        report.examples += 1
        label = f"{case.method.upper()} {case.path}"
        report.per_operation[label] = report.per_operation.get(label, 0) + 1
        anonymous = case.call(base_url=base_url, session=session, timeout=60)
        keyed = case.call(base_url=base_url, session=session, headers=auth, timeout=120)
        report.statuses[f"anonymous {anonymous.status_code}"] += 1
        report.statuses[f"keyed {keyed.status_code}"] += 1
        body = json.dumps(case.body, default=str)[:300] if case.body is not None else ""
        if anonymous.status_code >= 500 or keyed.status_code >= 500:
            report.failures.append(f"{label}: 5xx ({anonymous.status_code}/{keyed.status_code}) for {body}")
        if (case.method.upper(), case.path) not in OPEN and anonymous.status_code < 300:
            report.failures.append(f"{label}: {anonymous.status_code} without the key for {body}")
        if case.path in GENERATING and keyed.status_code < 300:
            counted = _usage_tokens(keyed)
            if counted is not None:
                choices, tokens = counted
                if choices > limits.max_n * limits.max_prompts or tokens > limits.max_tokens:
                    report.failures.append(f"{label}: {choices} choices, {tokens} tokens accepted for {body}")

    for result in schema.get_all_operations():
        operation = result.ok()
        run = settings(
            max_examples=examples,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )(given(case=operation.as_strategy())(one))
        run()
        if time.monotonic() > deadline:
            break
    return report

"""lmforge.vllm_guard in front of an ASGI app, as vLLM's server mounts it (`--middleware`).

The end-to-end test (tests/test_cli_end_to_end.py) asserts the same on a real vLLM server."""

from __future__ import annotations

import pytest

from lmforge.vllm_guard import Guard, guard_env

KEY = "sk-test-0123456789abcdef"


@pytest.fixture
def client(monkeypatch):  # type: ignore[no-untyped-def]
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    for name, value in guard_env(KEY, max_body=4096, max_n=4, max_concurrent=2).items():
        monkeypatch.setenv(name, value)

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"path": request.url.path, "bytes": len(body)})

    paths = ["/health", "/v1/models", "/invocations", "/tokenize", "/metrics", "/version", "/docs"]
    app = Starlette(routes=[Route(p, echo, methods=["GET", "POST"]) for p in paths])
    app.add_middleware(Guard)
    return TestClient(app)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_path_but_health_needs_the_key(client) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/version", "/docs"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers=auth("sk-wrong-0123456789abcdef")).status_code == 401, path
        assert client.get(path, headers=auth()).status_code == 200, path
    for path in ("/invocations", "/tokenize"):
        assert client.post(path, json={"prompt": "hi"}).status_code == 401, path
        assert client.post(path, json={"prompt": "hi"}, headers=auth()).json()["bytes"] > 0, path
    assert client.post("/health", json={}).status_code == 401  # only a GET of the health check is open


def test_requests_are_bounded(client) -> None:  # type: ignore[no-untyped-def]
    ok = client.post("/invocations", json={"prompt": "hi", "n": 4}, headers=auth())
    assert ok.status_code == 200 and ok.json()["bytes"] == len(ok.request.content)  # replayed whole
    for field in ("n", "best_of"):
        refused = client.post("/invocations", json={"prompt": "hi", field: 10000}, headers=auth())
        assert refused.status_code == 400 and f"{field}=10000" in refused.text
    big = client.post("/invocations", content=b"x" * 5000, headers={**auth(), "content-type": "application/json"})
    assert big.status_code == 413

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield b"y" * 1000

    streamed = client.post("/invocations", content=chunks(), headers=auth())  # no content-length: counted as read
    assert streamed.status_code == 413
    assert client.post("/invocations", content=b"{not json", headers=auth()).status_code == 200  # vLLM's to answer


def test_concurrent_requests_per_key_are_bounded(client) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/health").status_code == 200  # builds the app's middleware stack
    guard = client.app.middleware_stack
    while not isinstance(guard, Guard):  # the outermost middleware that is ours
        guard = guard.app
    guard.in_flight = 2
    assert client.get("/v1/models", headers=auth()).status_code == 429
    guard.in_flight = 1
    assert client.get("/v1/models", headers=auth()).status_code == 200


def test_an_empty_or_short_key_is_refused(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from lmforge.errors import ConfigError
    from serving.release import api_key

    for bad in ("", "short"):
        monkeypatch.setenv("LMFORGE_API_KEY", bad)
        with pytest.raises(ConfigError, match="at least 16 characters"):
            api_key(tmp_path)
    monkeypatch.delenv("LMFORGE_API_KEY")
    key, where = api_key(tmp_path)  # generated whole, 0600
    assert (
        len(key) >= 16
        and where.endswith("api_key")
        and (tmp_path / "serving" / "api_key").stat().st_mode & 0o777 == 0o600
    )
    (tmp_path / "serving" / "api_key").write_text("\n")  # an empty key file is never "no key"
    with pytest.raises(ConfigError, match="at least 16"):
        api_key(tmp_path)

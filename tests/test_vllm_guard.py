"""lmforge.inference.vllm_guard in front of an ASGI app, as vLLM's server mounts it (`--middleware`).

The end-to-end test (tests/test_cli_end_to_end.py) asserts the same on a real vLLM server."""

from __future__ import annotations

import os

import pytest

from lmforge.inference.vllm_guard import Guard, Limits, guard_env

KEY = "sk-test-0123456789abcdef"
ADMIN = "sk-admin-0123456789abcdef"
LIMITS = Limits(max_body=4096, max_n=4, max_prompts=8, max_tokens=1000, context=256, max_concurrent=2)
PATHS = [
    "/health",
    "/v1/models",
    "/invocations",
    "/tokenize",
    "/metrics",
    "/version",
    "/docs",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/adapters",
    "/adapters/sft",
    "/scale_elastic_ep",
    "/v1/responses",
    "/v1/chat/completions/batch",
]


def _client(monkeypatch, env: dict[str, str]):  # type: ignore[no-untyped-def]
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    for name, value in env.items():
        monkeypatch.setenv(name, value)

    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        if os.environ.get("VLLM_API_KEY") and request.url.path.startswith("/v1") and key != os.environ["VLLM_API_KEY"]:
            return JSONResponse({"error": "vLLM's own check"}, status_code=401)  # as vLLM's middleware does
        return JSONResponse({"path": request.url.path, "bytes": len(body)})

    app = Starlette(routes=[Route(p, echo, methods=["GET", "POST", "DELETE"]) for p in PATHS])
    app.add_middleware(Guard)
    return TestClient(app)


@pytest.fixture
def client(monkeypatch):  # type: ignore[no-untyped-def]
    return _client(monkeypatch, guard_env(KEY, LIMITS))


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
    assert client.post("/tokenize", json={"prompt": "hi"}, headers=auth()).json()["bytes"] > 0
    assert client.post("/health", json={}).status_code == 401  # only a GET of the health check is open


def test_requests_are_bounded(client) -> None:  # type: ignore[no-untyped-def]
    ok = client.post("/v1/completions", json={"prompt": "hi", "n": 4, "max_tokens": 16}, headers=auth())
    assert ok.status_code == 200 and ok.json()["bytes"] == len(ok.request.content)  # replayed whole
    for field in ("n", "best_of"):
        refused = client.post("/v1/completions", json={"prompt": "hi", field: 10000}, headers=auth())
        assert refused.status_code == 400 and f"{field}=10000" in refused.text
    big = client.post("/v1/completions", content=b"x" * 5000, headers={**auth(), "content-type": "application/json"})
    assert big.status_code == 413

    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(10):
            yield b"y" * 1000

    streamed = client.post("/v1/completions", content=chunks(), headers=auth())  # no content-length: counted as read
    assert streamed.status_code == 413
    assert client.post("/v1/completions", content=b"{not json", headers=auth()).status_code == 200  # vLLM's to answer


def test_only_the_paths_lmforge_serves_answer(client) -> None:  # type: ignore[no-untyped-def]
    """vLLM mounts more than lmforge serves: elastic scaling (changes the server), the Responses API
    (keeps responses any key holder can read back), batch chat (many conversations in one request)."""
    for path in ("/scale_elastic_ep", "/v1/responses", "/v1/chat/completions/batch", "/invocations"):
        assert client.post(path, json={}).status_code == 401, path  # the key first: nothing is revealed
        refused = client.post(path, json={}, headers=auth())
        assert refused.status_code == 404 and "not served here" in refused.text, path
    assert client.post("/v1/chat/completions", json={"max_tokens": 1}, headers=auth()).status_code == 200


def test_bounds_hold_whatever_the_json_types(client) -> None:  # type: ignore[no-untyped-def]
    """vLLM's request models read numbers laxly ("64" and 64.0 are 64): so does the guard. Before, only
    a JSON int was checked, and one `prompt` list could carry about 250,000 prompts."""
    for value in ("64", 64.0, " 64 ", "6.4e1"):
        for field in ("n", "best_of"):
            refused = client.post("/v1/completions", json={"prompt": "hi", field: value}, headers=auth())
            assert refused.status_code == 400 and f"{field}=64 " in refused.text, (field, value)
    many = client.post("/v1/completions", json={"prompt": ["a"] * 9, "max_tokens": 1}, headers=auth())
    assert many.status_code == 400 and "9 prompts" in many.text
    ids = client.post("/v1/completions", json={"prompt": list(range(40)), "max_tokens": 4}, headers=auth())
    assert ids.status_code == 200  # one prompt given as token ids
    batch = client.post("/v1/completions", json={"prompt": [[1, 2]] * 8, "max_tokens": 4}, headers=auth())
    assert batch.status_code == 200  # 8 prompts x 4 tokens
    # choices x prompts x max tokens: 4 x 8 x 32 = 1024 > 1000, whatever types carry it
    costly = {"prompt": ["a"] * 8, "n": "4", "max_tokens": "32"}
    refused = client.post("/v1/completions", json=costly, headers=auth())
    assert refused.status_code == 400 and "1024 tokens" in refused.text
    assert client.post("/v1/completions", json={**costly, "max_tokens": 31.0}, headers=auth()).status_code == 200
    # a missing max_tokens is the served context: 4 choices x 256
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 4}
    assert client.post("/v1/chat/completions", json=chat, headers=auth()).status_code == 400
    assert client.post("/v1/chat/completions", json={**chat, "n": 3}, headers=auth()).status_code == 200
    assert (
        client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 250}, headers=auth()).status_code
        == 200
    )
    # the content type does not decide: a JSON body sent as text/plain is checked too
    plain = client.post(
        "/v1/completions", content=b'{"prompt": "hi", "n": 64}', headers={**auth(), "content-type": "text/plain"}
    )
    assert plain.status_code == 400


def test_adapter_management_needs_the_management_key_and_stays_in_the_adapter_folders(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Before, the client key could load any folder on the server as an adapter, replace a served
    name's weights in place (`load_inplace`) or unload production adapters."""
    root = tmp_path / "serve" / "release"
    (root / "key1" / "adapters" / "sft").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "key1" / "escape").symlink_to(tmp_path / "elsewhere")
    # vLLM checks its own key (the clients') on /v1 paths behind the guard: the end-to-end run found
    # that an admitted management request then failed there with 401
    env = {**guard_env(KEY, LIMITS, admin_key=ADMIN, adapter_roots=(root,)), "VLLM_API_KEY": KEY}
    client = _client(monkeypatch, env)
    inside = {"lora_name": "sft2", "lora_path": str(root / "key1" / "adapters" / "sft")}
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    for path, body in ((load, inside), (unload, {"lora_name": "sft"})):
        assert client.post(path, json=body).status_code == 401
        refused = client.post(path, json=body, headers=auth())  # the client key: known, but not allowed here
        assert refused.status_code == 403 and "client key cannot manage" in refused.text
        assert client.post(path, json=body, headers=auth(ADMIN)).status_code == 200
    for outside in ("/etc", str(tmp_path / "elsewhere"), str(root / "key1" / "escape"), str(root / ".." / "x")):
        refused = client.post(load, json={**inside, "lora_path": outside}, headers=auth(ADMIN))
        assert refused.status_code == 403 and "outside the adapter folders" in refused.text, outside
    inplace = client.post(load, json={**inside, "load_inplace": True}, headers=auth(ADMIN))
    assert inplace.status_code == 403 and "load_inplace" in inplace.text
    for method, path in (("POST", "/adapters"), ("DELETE", "/adapters/sft")):  # SageMaker's routes: nobody
        for key in (KEY, ADMIN):
            assert (
                client.request(method, path, json={"name": "x", "src": str(root)}, headers=auth(key)).status_code == 403
            )
    # the management key is for management only
    assert client.get("/v1/models", headers=auth(ADMIN)).status_code == 401


def test_without_a_management_key_adapter_management_is_off(client) -> None:  # type: ignore[no-untyped-def]
    from lmforge.inference.vllm_server import EngineConfig, server_env

    refused = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}, headers=auth())
    assert refused.status_code == 403 and "off on this server" in refused.text
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server_env(EngineConfig(), KEY, context=256)
    managed = server_env(EngineConfig(), KEY, context=256, admin_key=ADMIN)
    assert managed["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and ADMIN not in str(managed)  # only its digest


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


def test_every_vllm_process_asks_for_amx_before_its_kernels_run() -> None:
    """On an AMX host (Intel Sapphire Rapids and later) vLLM's CPU attention uses AMX without asking
    Linux for the tile state, and its worker died of SIGILL at the first request. lmforge's vLLM
    plugin asks in every process vLLM starts (vLLM loads `vllm.general_plugins` in each)."""
    from importlib.metadata import entry_points

    import torch

    from lmforge.inference.vllm_amx import register

    (plugin,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "lmforge_amx"]
    assert plugin.load() is register
    register()  # no AMX here: nothing; with AMX: granted
    if torch.cpu._is_amx_tile_supported():
        assert torch.cpu._init_amx()


def test_a_cpu_server_runs_its_model_in_the_engine_process_unless_asked_for_vllms_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """serve.engine.cpu_executor: uni needs both the flag and VLLM_ENABLE_V1_MULTIPROCESSING=0 (vLLM's
    CPU platform turns uni back into mp otherwise); mp passes neither."""
    import torch

    from lmforge.inference.vllm_server import EngineConfig, server_command, server_env

    if torch.cuda.is_available():
        pytest.skip("the CPU executor setting is for CPU hosts")
    uni, mp = EngineConfig(), EngineConfig(cpu_executor="mp")
    command = server_command(tmp_path, uni, port=8000, served_name="m")
    assert command[command.index("--distributed-executor-backend") + 1] == "uni"
    assert server_env(uni, KEY, context=256)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "--distributed-executor-backend" not in server_command(tmp_path, mp, port=8000, served_name="m")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in server_env(mp, KEY, context=256)


def test_a_server_with_adapters_is_started_with_each_one_named_and_room_for_a_hot_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The adapters a release serves reach vLLM by name; the CPU cache holds at least a batch's worth, so a
    superseded adapter stays loaded beside its successor until evicted."""
    from lmforge.inference.vllm_server import EngineConfig, LoraModules, server_command

    lora = LoraModules({"lmforge-sft@1": "/a/sft", "lmforge-dpo@2": "/a/dpo"}, max_lora_rank=32, max_loras=12)
    command = server_command(tmp_path, EngineConfig(), port=8000, served_name="base", lora=lora)
    assert "--enable-lora" in command and command[command.index("--max-lora-rank") + 1] == "32"
    assert command[command.index("--max-cpu-loras") + 1] == "12"  # never fewer than a batch (8 by default)
    at = command.index("--lora-modules")
    assert command[at + 1 : at + 3] == ["lmforge-sft@1=/a/sft", "lmforge-dpo@2=/a/dpo"]
    assert "--enable-lora" not in server_command(tmp_path, EngineConfig(), port=8000, served_name="base")

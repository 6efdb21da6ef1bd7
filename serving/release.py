"""The managed, long-lived model server (vLLM, llama.cpp: serving.backends): start, smoke test, promote, roll back, status.

State lives in `<workspace>/serving/`:

    api_key            the generated key (0600), when LMFORGE_API_KEY is not set
    current.json       the promoted server: URL, served name, model, lineage, pid file, log file
    history.jsonl      every promotion, in order
    servers/<id>/      one folder per started server: server.pid (pid, command), server.log

    front/             the endpoint's front (serving/front.py): target.json, front.json, pid, log

A server runs detached (its own session, a pid file, `lmforge.processes.supervise` as its parent), so it
outlives the flow run that started it; it is stopped by pid, never by name. Clients use the
endpoint, the front on `serve.host:serve.port`; servers listen on loopback ports of their own.
A new model starts on a fresh port beside the running one, is smoke-tested (and SLO-checked by
`serve/release`), and only then does the front send new connections to it, `current.json`
switch to it and the old server stop. Any failure before that stops the candidate and leaves
the old server serving: a rollback, not an outage, and the endpoint never moves. Promotions
are serialized by a lock on the serving folder; a server whose key or engine settings differ
from the config is replaced the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.errors import DeterministicError
from lmforge.hashing import atomic_write_json
from lmforge.inference.vllm_server import (
    NOISE,
    LoraModules,
    ServerFailed,
    request,
    served_context,
    server_env,
    wait_ready,
)
from lmforge.processes import devices
from lmforge.processes.launch import free_port
from lmforge.processes.launcher import detached_alive, read_pid_file, start_detached, stop_detached, survivors
from serving import backends
from serving.config import ServeConfig

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

log = logging.getLogger(__name__)
KEY_ENV = "LMFORGE_API_KEY"
ADMIN_KEY_ENV = "LMFORGE_ADMIN_KEY"


class SmokeFailed(DeterministicError):
    """The candidate answered wrongly (or not at all): it is not promoted."""


def serving_dir(workspace: str | Path) -> Path:
    return Path(workspace) / "serving"


# -- the API key ------------------------------------------------------------------------------------


def api_key(workspace: str | Path) -> tuple[str, str]:
    """(key, where it came from). LMFORGE_API_KEY wins; else one generated once, stored 0600."""
    return _key(workspace, "api_key", KEY_ENV)


def admin_key(workspace: str | Path) -> tuple[str, str]:
    """The management key (adapter loading into a running server): the release's alone, never given to
    clients; LMFORGE_ADMIN_KEY wins, else one generated once, stored 0600 beside the client key."""
    return _key(workspace, "admin_key", ADMIN_KEY_ENV)


def _key(workspace: str | Path, name: str, env: str) -> tuple[str, str]:
    from lmforge.inference.vllm_server import check_key

    if env in os.environ:  # set, even to "": an empty key is refused, never taken as "no key"
        return check_key(os.environ[env], env), env
    path = serving_dir(workspace) / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # written whole beside it, then linked into place: never a half-written (empty) key file, and
        # link() fails when another process made one first
        tmp = path.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"sk-lmforge-{secrets.token_urlsafe(24)}\n")
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it first
            pass
        finally:
            tmp.unlink()
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
        log.warning("%s was readable by others; its permissions are now 0600", path)
    return check_key(path.read_text(), str(path)), str(path)


def adapter_roots(workspace: str | Path) -> tuple[Path, ...]:
    """Where a running server may load adapters from: the release steps' outputs of this workspace."""
    return (Path(workspace).resolve() / "serve" / "release",)


def fingerprint(key: str) -> str:
    """What logs, artifacts and `serve status` show instead of the key."""
    return f"sha256:{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# -- servers ----------------------------------------------------------------------------------------


def current(workspace: str | Path) -> dict[str, Any] | None:
    path = serving_dir(workspace) / "current.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def alive(record: dict[str, Any] | None) -> bool:
    return bool(record) and detached_alive(read_pid_file(Path(record["pid_file"])))  # type: ignore[index]


def _tail(log_file: Path, lines: int = 8) -> list[str]:
    try:
        with open(log_file, errors="replace") as handle:
            return [
                line.rstrip()
                for line in deque(handle, maxlen=200)
                if line.strip() and not any(n in line for n in NOISE)
            ][-lines:]
    except FileNotFoundError:
        return []


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _port(wanted: int | None, host: str) -> int:
    if wanted:
        with socket.socket() as s:
            try:
                s.bind((host, wanted))
                return wanted
            except OSError:
                log.warning("port %d is taken (the server being replaced?); starting on a free port", wanted)
    return free_port()


def settings(cfg: ServeConfig, workspace: str | Path) -> dict[str, Any]:
    """What a running server was started with, beyond its model: a change to any of it takes a restart.

    The key enters as its fingerprint; the engine as its arguments; the port as configured (a
    server on another port because the configured one was taken is not restarted for that).
    """
    from lmforge.hashing import digest

    key, _ = api_key(workspace)
    engine = cfg.engine.model_dump(mode="json", exclude={"startup_timeout_s"})
    wanted = {
        "key_fingerprint": fingerprint(key) if cfg.require_api_key else "none (serve.require_api_key=false)",
        "engine": digest(json.dumps(engine, sort_keys=True))[:16],
        "inherit_env": sorted(cfg.inherit_env),
        "front": cfg.front,
        "speculative": cfg.speculative.model_dump(mode="json"),
        "backend": cfg.backend,
        "alias": cfg.alias,
        "backend_settings": backends.backend(cfg.backend).settings(cfg),
    }
    if not cfg.front:  # the server itself is the endpoint: its address is a server setting
        wanted |= {"host": cfg.host, "port": cfg.port}
    return wanted


_held: dict[str, int] = {}


@contextlib.contextmanager
def promotion_lock(workspace: str | Path) -> Iterator[None]:
    """One promotion at a time per workspace (two concurrent runs could otherwise each stop the
    other's server or leave one running that no `current.json` names). Re-entrant in this process."""
    import fcntl

    path = serving_dir(workspace) / ".promotion.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    name = str(path.resolve())
    if _held.get(name):
        _held[name] += 1
        try:
            yield
        finally:
            _held[name] -= 1
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another run is promoting a server in %s; waiting for it", path.parent)
            fcntl.flock(handle, fcntl.LOCK_EX)
        _held[name] = 1
        try:
            yield
        finally:
            _held.pop(name, None)
            fcntl.flock(handle, fcntl.LOCK_UN)


def start(
    model_dir: Path,
    served_name: str,
    cfg: ServeConfig,
    workspace: str | Path,
    *,
    port: int | None = None,
    lineage: dict[str, Any] | None = None,
    gpus: list[str] | None = None,
    lora: LoraModules | None = None,
    reservation: str | None = None,
) -> dict[str, Any]:
    """Start a detached server for `model_dir` on `gpus` and wait until it is ready; returns its record.
    With `lora`, the model is a base and its adapters are served too, one name each. `reservation`:
    the `lmforge.processes.devices` entry holding `gpus` for it, handed to the server once it runs.

    With `serve.require_api_key: false` (loopback only) the server takes requests without a key."""
    key, _ = api_key(workspace)
    required = key if cfg.require_api_key else ""
    bind = "127.0.0.1" if cfg.front else cfg.host  # behind the front, a server is never exposed itself
    port = free_port() if cfg.front else _port(port, cfg.host)
    directory = serving_dir(workspace) / "servers" / f"{time.strftime('%Y%m%d-%H%M%S')}-{port}"
    directory.mkdir(parents=True, exist_ok=True)
    server = backends.backend(cfg.backend)  # vLLM on the model's folder, llama.cpp on a GGUF file, ...
    command = server.command(
        model_dir, cfg, port=port, host=bind, served_name=served_name, directory=directory, lora=lora
    )
    host = "127.0.0.1" if bind in ("0.0.0.0", "::") else bind
    record: dict[str, Any] = {
        "served_name": served_name,
        "model_dir": str(model_dir),
        "url": f"http://{_url_host(host)}:{port}",  # the server itself; clients use "endpoint"
        "endpoint": f"http://{_url_host(host)}:{port}",  # the front's, once promoted behind one
        "host": bind,
        "port": port,
        "pid_file": str(directory / "server.pid"),
        "log_file": str(directory / "server.log"),
        "drain_file": str(directory / "draining"),  # while it exists, its responses close their connection
        "key_fingerprint": fingerprint(key),
        "gpus": list(gpus or []),
        "settings": settings(cfg, workspace),
        "lineage": lineage or {},
        "lora": dataclasses.asdict(lora) if lora is not None else None,
    }
    env = server_env(
        cfg.engine,
        required,
        context=served_context(model_dir, cfg.engine),
        # adapters can be loaded into it later: through the management key alone, from this workspace's releases
        admin_key=admin_key(workspace)[0] if lora is not None else "",
        adapter_roots=adapter_roots(workspace) if lora is not None else (),
        drain_file=Path(record["drain_file"]),
    )
    env.update(server.environment())
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    pid = start_detached(
        command,
        Path(record["log_file"]),
        Path(record["pid_file"]),
        env=env,
        meta={"served_name": served_name},
        inherit=cfg.inherit_env,
    )
    # held until it stops (or dies): launches and other servers are placed on the other GPUs
    if reservation is not None:
        devices.transfer(reservation, record["pid_file"], pid, f"served model {served_name}")
    else:
        devices.hold(record["pid_file"], list(gpus or []), pid, f"served model {served_name}")
    log.info(
        "starting %s for %s as %s on %s (pid %d, log %s)",
        server.label,
        model_dir,
        served_name,
        record["url"],
        pid,
        record["log_file"],
    )
    try:
        record["startup_s"] = round(
            wait_ready(
                record["url"],
                key,
                served_name,
                cfg.engine.startup_timeout_s,
                lambda: alive(record),
                lambda: _tail(Path(record["log_file"])),
                pid=pid,  # the supervisor: the server, its child, must be the one listening
            ),
            1,
        )
    except BaseException:
        stop_detached(Path(record["pid_file"]))
        devices.release(record["pid_file"])
        raise
    record["pid"], record["started_at"] = pid, time.time()
    return record


# paths vLLM's own key check leaves open; the smoke test checks each answers 401 without the key
UNGUARDED_BY_VLLM = (
    ("GET", "/v1/models"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/metrics"),
    ("GET", "/version"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
)


def smoke_test(record: dict[str, Any], cfg: ServeConfig, workspace: str | Path) -> dict[str, Any]:
    """Chat through the official `openai` client, non-streaming and streaming; both must end at
    <|im_end|> (finish_reason "stop", the marker not in the text) and agree; no key gets 401."""
    from openai import OpenAI

    key, _ = api_key(workspace)
    client = OpenAI(base_url=f"{record['url']}/v1", api_key=key, max_retries=0, timeout=60.0)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": cfg.smoke_prompt}]
    name = record["served_name"]
    try:
        reply = client.chat.completions.create(
            model=name, messages=messages, max_tokens=cfg.smoke_max_tokens, temperature=0.0
        )
        streamed, finish = [], None
        for chunk in client.chat.completions.create(
            model=name, messages=messages, max_tokens=cfg.smoke_max_tokens, temperature=0.0, stream=True
        ):
            if chunk.choices:
                streamed.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
    except Exception as exc:  # noqa: BLE001 - any client failure is a failed smoke test, in one line
        raise SmokeFailed(f"smoke test of {name}: request failed: {type(exc).__name__}: {str(exc)[:200]}") from None
    answer = reply.choices[0].message.content or ""
    problems = []
    if reply.choices[0].finish_reason != "stop":
        problems.append(
            f"the answer did not end within {cfg.smoke_max_tokens} tokens "
            f"(finish_reason={reply.choices[0].finish_reason})"
        )
    if "<|im_end|>" in answer or "<|im_start|>" in answer:
        problems.append("chat markers leaked into the answer")
    if not answer.strip():
        problems.append("the answer is empty")
    if "".join(streamed) != answer or finish != "stop":
        problems.append(f"the streamed answer differs ({''.join(streamed)[:60]!r}, finish_reason={finish})")
    if cfg.require_api_key:  # every path but /health needs the key (lmforge.inference.vllm_guard), /v1 and beyond
        for method, path in UNGUARDED_BY_VLLM:
            status, _ = request(f"{record['url']}{path}", None, {} if method == "POST" else None)
            if status != 401:
                problems.append(f"{method} {path} without the API key got HTTP {status}, not 401")
    if problems:
        raise SmokeFailed(f"smoke test of {name} failed: {'; '.join(problems)} (answer: {answer[:80]!r})")
    log.info("smoke test of %s passed: %r -> %r", name, cfg.smoke_prompt, answer)
    return {
        "prompt": cfg.smoke_prompt,
        "answer": answer,
        "finish_reason": "stop",
        "streaming_matches": True,
        "unauthorized_status": status,
    }


def smoke_each(record: dict[str, Any], cfg: ServeConfig, workspace: str | Path) -> dict[str, Any]:
    """The smoke test of what a server serves: its model, or (a LoRA base) each adapter by its name,
    the base itself being no chat model."""
    names = list((record.get("lora") or {}).get("adapters", {}))
    if not names:
        return smoke_test(record, cfg, workspace)
    return {name: smoke_test({**record, "served_name": name}, cfg, workspace) for name in names}


def lora_of(record: dict[str, Any] | None) -> LoraModules | None:
    """The adapters a server record (or a release) serves, to start it again with them."""
    spec = (record or {}).get("lora")
    return LoraModules(**spec) if spec else None


def load_adapters(
    workspace: str | Path,
    cfg: ServeConfig,
    record: dict[str, Any],
    adapters: dict[str, str],
    retire: list[str],
    check: Any = None,
) -> dict[str, Any]:
    """Load `adapters` (served name -> directory) into the running LoRA server `record` through vLLM's
    runtime loading, smoke-test each by name, then make them current and unload `retire` (the names
    they supersede). No restart: requests in flight finish, on the old names too (a retired adapter
    stays in vLLM's cache until evicted; unloading removes only its name). A new adapter that fails
    its smoke test (or `check(record)`, the SLO benchmark) is unloaded again and the served names
    stay as they were."""
    key, _ = admin_key(workspace)  # management: the client key gets 403 on these paths
    loaded: list[str] = []
    try:
        for name, path in adapters.items():
            status, body = request(
                f"{record['url']}/v1/load_lora_adapter", key, {"lora_name": name, "lora_path": path}, timeout=120
            )
            if status != 200:
                raise SmokeFailed(f"{name}: the running server did not load {path} (HTTP {status}: {str(body)[:200]})")
            loaded.append(name)
            log.info("loaded adapter %s into the running server %s (no restart)", name, record["served_name"])
        smoke = {name: smoke_test({**record, "served_name": name}, cfg, workspace) for name in adapters}
        if check is not None:
            check(record)
    except BaseException as exc:
        for name in loaded:
            request(f"{record['url']}/v1/unload_lora_adapter", key, {"lora_name": name})
        if isinstance(exc, SmokeFailed):
            raise SmokeFailed(f"{exc}; the server keeps serving {', '.join(record['lora']['adapters'])}") from None
        raise
    lora = dict(record["lora"])
    lora["adapters"] = {n: p for n, p in lora["adapters"].items() if n not in retire} | adapters
    record = {**record, "lora": lora, "smoke": {**(record.get("smoke") or {}), **smoke}}
    for name in retire:
        record["smoke"].pop(name, None)
    directory = serving_dir(workspace)
    atomic_write_json(directory / "current.json", record)
    with open(directory / "history.jsonl", "a") as out:
        out.write(json.dumps({"promoted_at": time.time(), "loaded": adapters, "retired": retire, **record}) + "\n")
    for name in retire:
        status, _ = request(f"{record['url']}/v1/unload_lora_adapter", key, {"lora_name": name})
        log.info("retired adapter %s (HTTP %d)", name, status)
    return record


def promote(workspace: str | Path, record: dict[str, Any], cfg: ServeConfig | None = None) -> dict[str, Any] | None:
    """Make `record` the current server (the front forwards new connections to it), then stop the one
    it replaces; returns the old record."""
    directory = serving_dir(workspace)
    old = current(workspace)
    if cfg is not None and cfg.front:
        record["endpoint"] = point_front(workspace, cfg, record)
    atomic_write_json(directory / "current.json", record)
    with open(directory / "history.jsonl", "a") as out:
        out.write(json.dumps({"promoted_at": time.time(), **record}) + "\n")
    if old and old["pid_file"] != record["pid_file"]:
        if cfg is not None and cfg.front:
            drain(old, cfg.drain_timeout_s)
        if stop_detached(Path(old["pid_file"])):
            log.info("stopped the previous server %s (%s)", old["served_name"], old["url"])
        devices.release(old["pid_file"])
    log.info("serving %s at %s (key %s)", record["served_name"], record["endpoint"], record["key_fingerprint"])
    return old


def drain(record: dict[str, Any], timeout_s: float) -> float:
    """Let the replaced server finish what it has before it is stopped: the front already sends new
    connections to its successor, but kept-alive ones stay pinned to it. From now on each of its
    responses closes its connection (`lmforge.inference.vllm_guard`'s drain file), so a client's next request
    opens a new connection, to the new server; wait until it has no connection left (idle ones end
    at the server's keep-alive timeout), at most `timeout_s`. Returns the seconds it took."""
    from lmforge.processes.launch import open_connections

    started = time.monotonic()
    if not alive(record) or "drain_file" not in record:  # a server started before draining existed
        return 0.0
    Path(record["drain_file"]).touch()
    while time.monotonic() - started < timeout_s:
        left = open_connections(int(record["port"]))
        if not left:
            break
        time.sleep(0.2)
    else:
        log.warning("%s still had connections after %.0fs; stopping it", record["served_name"], timeout_s)
    return time.monotonic() - started


def start_and_promote(
    model_dir: Path,
    served_name: str,
    cfg: ServeConfig,
    workspace: str | Path,
    *,
    lineage: dict[str, Any] | None = None,
    check: Any = None,
    lora: LoraModules | None = None,
) -> dict[str, Any]:
    """Start a candidate beside whatever is serving, smoke-test it (and run `check(record)`), promote it.

    On any failure the candidate is stopped and the current server is left as it was.
    """
    with promotion_lock(workspace):
        return _start_and_promote(model_dir, served_name, cfg, workspace, lineage=lineage, check=check, lora=lora)


def placement(usable: list[str], current: list[str], needed: int) -> tuple[str, list[str]]:
    """Where a candidate server goes: ("cpu", []) on a host without GPUs; ("beside", devices) when enough
    usable GPUs are free of the current server, so both run at once; ("replace", devices) when there is
    room for one only: the current server is stopped first and started again if the candidate fails.

    `usable`: the GPUs no other holder has (`lmforge.processes.devices`); `current`: those the current server holds.
    """
    if not usable and not current:
        return "cpu", []
    spare = [g for g in usable if g not in current]
    if len(spare) >= needed:
        return "beside", spare[:needed]
    pool = [*current, *spare]
    if len(pool) >= needed:
        return "replace", pool[:needed]
    raise ServerFailed(
        f"the server needs {needed} GPU(s) (serve.engine.tensor_parallel_size) and this host has {len(pool)} "
        "not held by another service"
    )


def _start_and_promote(
    model_dir: Path,
    served_name: str,
    cfg: ServeConfig,
    workspace: str | Path,
    *,
    lineage: dict[str, Any] | None,
    check: Any,
    lora: LoraModules | None = None,
) -> dict[str, Any]:
    old = current(workspace)
    running = bool(old) and alive(old)
    mine = old.get("gpus", []) if old and running else []
    strategy, reservation = "cpu", f"reservation:{os.getpid()}:{secrets.token_hex(4)}"

    def choose(usable: list[str]) -> list[str] | None:
        """Where it goes, from the GPUs no other holder has; None (wait) while another service holds them."""
        nonlocal strategy
        if not devices.visible_gpus():
            return []
        if not usable and not mine:  # a GPU host whose GPUs other services hold (placement reads it as CPU)
            return None
        try:
            strategy, chosen = placement(usable, mine, cfg.engine.tensor_parallel_size)
        except ServerFailed:
            return None
        return chosen

    try:  # chosen and held in one step under the host-wide lock, before the server starts
        gpus = devices.reserve(
            reservation,
            choose,
            f"served model {served_name}",
            exclude=old["pid_file"] if old else None,
            wait_s=cfg.gpu_wait_s,
        )
    except devices.NoFreeGpu as exc:
        raise SmokeFailed(f"{served_name} not promoted: {exc}") from None
    if strategy == "replace" and running:
        assert old is not None
        log.warning(
            "no room for two servers on GPU %s: stopping %s before starting %s (it is started again if %s fails)",
            ",".join(gpus),
            old["served_name"],
            served_name,
            served_name,
        )
        stop_detached(Path(old["pid_file"]))
        devices.release(old["pid_file"])
    port = cfg.port if not running else None
    try:
        record = start(
            model_dir,
            served_name,
            cfg,
            workspace,
            port=port,
            lineage=lineage,
            gpus=gpus,
            lora=lora,
            reservation=reservation,
        )
    except BaseException as exc:
        devices.release(reservation)  # a server that started holds its GPUs under its own pid file now
        if not isinstance(exc, ServerFailed):
            raise
        raise SmokeFailed(
            f"{served_name} not promoted: {exc}{_fallback(old, running, strategy, cfg, workspace)}"
        ) from None
    try:
        record["smoke"] = smoke_each(record, cfg, workspace)
        if check is not None:
            check(record)
    except BaseException as exc:
        stop_detached(Path(record["pid_file"]))
        devices.release(record["pid_file"])
        keeps = _fallback(old, running, strategy, cfg, workspace)
        if isinstance(exc, (ServerFailed, SmokeFailed)):
            raise SmokeFailed(f"{served_name} not promoted: {exc}{keeps}") from None
        if keeps:
            log.error("%s was not promoted%s", served_name, keeps)
        raise
    promote(workspace, record, cfg)
    return record


def _fallback(
    old: dict[str, Any] | None, was_running: bool, strategy: str, cfg: ServeConfig, workspace: str | Path
) -> str:
    """After a failed candidate: what keeps serving. A server stopped to make room is started again
    (health-checked and smoke-tested) on its devices; the front still points at it."""
    if not old or not was_running:
        return ""
    if strategy != "replace":
        return f"; {old['served_name']} keeps serving at {old.get('endpoint', old['url'])}" if alive(old) else ""
    try:
        again = start(
            Path(old["model_dir"]),
            old["served_name"],
            cfg,
            workspace,
            lineage=old.get("lineage"),
            gpus=old.get("gpus"),
            lora=lora_of(old),
        )
        again["smoke"] = smoke_each(again, cfg, workspace)
    except Exception as exc:  # noqa: BLE001 - reported in the one line, with the candidate's failure
        return f"; {old['served_name']}, stopped to make room, did not start again either ({str(exc)[:200]})"
    promote(workspace, again, cfg)
    return f"; {old['served_name']} was started again and serves at {again['endpoint']}"


def stop(workspace: str | Path) -> bool:
    """Stop the served model and its front; False when neither was running."""
    record = current(workspace)
    stopped = bool(record) and stop_detached(Path(record["pid_file"]))  # type: ignore[index]
    if record:
        devices.release(record["pid_file"])
    return stop_detached(front_dir(workspace) / "front.pid", wait_s=10) or stopped


# -- the front: the stable endpoint (serving/front.py) ---------------------------------------------


def front_dir(workspace: str | Path) -> Path:
    return serving_dir(workspace) / "front"


def _front_address(workspace: str | Path, cfg: ServeConfig) -> tuple[str, int]:
    """Where the front listens: serve.host and serve.port, or the port it had (chosen once when unset)."""
    if cfg.port:
        return cfg.host, cfg.port
    try:
        previous = json.loads((front_dir(workspace) / "front.json").read_text())
        if previous["host"] == cfg.host:
            return cfg.host, int(previous["port"])
    except (OSError, ValueError, KeyError):
        pass
    return cfg.host, free_port()


def ensure_front(workspace: str | Path, cfg: ServeConfig) -> str:
    """Start the front (or restart it on a new address); returns the endpoint URL clients use."""
    directory = front_dir(workspace)
    host, port = _front_address(workspace, cfg)
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    endpoint = f"http://{_url_host(client_host)}:{port}"
    pid_file = directory / "front.pid"
    try:
        running = json.loads((directory / "front.json").read_text())
    except (OSError, ValueError):
        running = {}
    if detached_alive(read_pid_file(pid_file)):
        if running.get("host") == host and running.get("port") == port:
            return endpoint
        log.warning(
            "the endpoint moves from %s:%s to %s:%s (serve.host/serve.port changed)",
            running.get("host"),
            running.get("port"),
            host,
            port,
        )
        stop_detached(pid_file, wait_s=10)
    command = [
        sys.executable,
        "-m",
        "serving.front",
        "--listen",
        f"{host}:{port}",
        "--target",
        str(directory / "target.json"),
    ]
    start_detached(command, directory / "front.log", pid_file, meta={"front": f"{host}:{port}"})
    atomic_write_json(directory / "front.json", {"host": host, "port": port})
    deadline = time.time() + 15
    while time.time() < deadline:
        if not detached_alive(read_pid_file(pid_file)):
            raise ServerFailed(
                f"the endpoint's front could not listen on {host}:{port}: {' | '.join(_tail(directory / 'front.log', 3))}"
            )
        with contextlib.suppress(OSError), socket.create_connection((client_host, port), timeout=1):
            return endpoint
        time.sleep(0.05)
    raise ServerFailed(f"the endpoint's front did not start listening on {host}:{port} within 15 s")


def point_front(workspace: str | Path, cfg: ServeConfig, record: dict[str, Any]) -> str:
    """Send new connections of the endpoint to `record`'s server (one atomic write); returns the endpoint."""
    directory = front_dir(workspace)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        directory / "target.json",
        {"host": record["host"], "port": record["port"], "served_name": record["served_name"]},
    )
    return ensure_front(workspace, cfg)


def status_lines(workspace: str | Path) -> tuple[bool, list[str]]:
    record = current(workspace)
    if record is None:
        return False, [
            "no model has been served from this workspace yet (`lmforge run`, or `lmforge serve start --model DIR`)"
        ]
    running = alive(record)
    pid_record = read_pid_file(Path(record["pid_file"]))
    pid = (pid_record or {}).get("pid", record.get("pid"))
    left = [] if running else survivors(pid_record)
    if running:
        state = f"running, pid {pid}, up {_uptime(time.time() - record.get('started_at', time.time()))}"
    elif left:
        state = (
            f"UNSUPERVISED: its supervisor (pid {pid}) was killed, but pid(s) {', '.join(map(str, left))} of "
            "the server are still running; `lmforge serve stop` ends them"
        )
    else:
        state = "NOT RUNNING (the process died or was stopped); `lmforge serve start` brings the promoted model back"
    lines = [
        f"model:   {record['served_name']}  ({record['model_dir']})",
        f"url:     {record.get('endpoint', record['url'])}/v1  (OpenAI-compatible; Authorization: Bearer "
        f"<key {record['key_fingerprint']}>)",
        f"state:   {state}",
        f"logs:    {record['log_file']}",
    ]
    if record.get("endpoint", record["url"]) != record["url"]:
        front = "running" if detached_alive(read_pid_file(front_dir(workspace) / "front.pid")) else "NOT RUNNING"
        lines.insert(2, f"server:  {record['url']} (behind the endpoint's front: {front})")
    return running, lines


def _uptime(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Speculating:
    """The serve config (a model or a step's view of it) with another `speculative` section: the one
    the release decided on (speculation off where it was slower, a distilled draft's directory)."""

    def __init__(self, cfg: Any, speculative: Any) -> None:
        self._cfg, self.speculative = cfg, speculative

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def ensure_running(workspace: str | Path, cfg: ServeConfig, want: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Make the server described by `want` (served_name, model_dir, lineage) the running current one.

    ("kept", record) when it already is, with the settings it was started with; else ("started",
    record): it is started, smoke-tested and promoted, and the old server stopped. A server whose key,
    host, port or engine settings differ from `cfg` is replaced so, with one line saying what changed.
    """
    released = want.get("speculative_config") or want.get("settings", {}).get("speculative")
    if released is not None:  # as the release decided, not as configured (serve.speculative is its key)
        from lmforge.inference.vllm_server import SpeculativeConfig

        cfg = Speculating(cfg, SpeculativeConfig(**released))  # type: ignore[assignment]
    with promotion_lock(workspace):
        record = current(workspace)
        if record and record["served_name"] == want["served_name"] and alive(record):
            wanted = settings(cfg, workspace)
            changed = [name for name, value in wanted.items() if record.get("settings", {}).get(name) != value]
            wanted_lora, running_lora = want.get("lora") or {}, record.get("lora") or {}
            if not changed and wanted_lora.get("adapters", {}).keys() - running_lora.get("adapters", {}).keys():
                record = _sync_adapters(workspace, cfg, record, wanted_lora)
            if not changed:
                if cfg.front:  # the front may have died, or serve.host/port changed: the server stays
                    endpoint = point_front(workspace, cfg, record)
                    if endpoint != record.get("endpoint"):
                        record["endpoint"] = endpoint
                        atomic_write_json(serving_dir(workspace) / "current.json", record)
                return "kept", record
            log.warning(
                "%s is running with other settings (%s changed): starting it with the new ones, then stopping the old",
                record["served_name"],
                ", ".join(changed),
            )
        elif record and record["served_name"] == want["served_name"]:
            log.warning("the promoted server %s is not running; starting it again", record["served_name"])
        return "started", start_and_promote(
            Path(want["model_dir"]),
            want["served_name"],
            cfg,
            workspace,
            lineage=want.get("lineage"),
            lora=lora_of(want),
        )


def _sync_adapters(
    workspace: str | Path, cfg: ServeConfig, record: dict[str, Any], wanted: dict[str, Any]
) -> dict[str, Any]:
    """Load the adapters `wanted` names that the running server lacks, retiring those it does not name."""
    have = record["lora"]["adapters"]
    new = {n: p for n, p in wanted["adapters"].items() if n not in have}
    return load_adapters(workspace, cfg, record, new, [n for n in have if n not in wanted["adapters"]])

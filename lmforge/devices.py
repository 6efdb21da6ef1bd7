"""GPUs of this host that long-lived services hold (the served model), kept out of every launch.

A served model keeps its GPUs after the flow that started it has ended, and with it any `gpu`
concurrency slot it held; without a record, the next training job, vLLM evaluation or promotion
would be placed on the same devices and collide with it (vLLM asks for 90% of GPU memory).
Services record the devices they hold here, host-wide (two workspaces share the GPUs too), with
the pid that holds them: an entry whose holder is gone is dropped, so a killed server frees its
devices without anyone cleaning up. Launches (`lmforge.launch.run_entry`) get
`CUDA_VISIBLE_DEVICES` set to what is left, unless the user set it.

    $LMFORGE_HOME/gpus.json   {holder: {"gpus": ["0"], "pid": 1234, "what": "served model ..."}}
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.errors import DeterministicError
from lmforge.supervise import pid_alive


class NoFreeGpu(DeterministicError):
    """Every GPU of the host is held by a long-lived service: a retry would meet the same."""


def _file() -> Path:
    return Path(os.environ.get("LMFORGE_HOME", Path.home() / ".lmforge")) / "gpus.json"


def visible_gpus(env: dict[str, str] | None = None) -> list[str]:
    """The GPUs a process started here would see: CUDA_VISIBLE_DEVICES when set, else the NVIDIA device
    nodes (no torch import: this runs on every launch)."""
    chosen = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if chosen is not None:
        return [d.strip() for d in chosen.split(",") if d.strip() and d.strip() != "-1"]
    nodes = [p.name for p in Path("/dev").glob("nvidia*")] if Path("/dev").is_dir() else []
    return sorted((m.group(1) for n in nodes if (m := re.fullmatch(r"nvidia(\d+)", n))), key=int)


@contextlib.contextmanager
def _locked() -> Iterator[dict[str, Any]]:
    path = _file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {}
        state = {k: v for k, v in state.items() if int(v.get("pid", 0)) > 0 and pid_alive(int(v["pid"]))}  # dead: freed
        yield state
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)


def held() -> dict[str, dict[str, Any]]:
    """{holder: {"gpus", "pid", "what"}} of the living holders."""
    with _locked() as state:
        return dict(state)


def hold(holder: str, gpus: list[str], pid: int, what: str) -> None:
    if not gpus:
        return
    with _locked() as state:
        state[holder] = {"gpus": list(gpus), "pid": pid, "what": what}


def release(holder: str) -> None:
    with _locked() as state:
        state.pop(holder, None)


def free(exclude: str | None = None, env: dict[str, str] | None = None) -> list[str]:
    """Visible GPUs no living holder (other than `exclude`) has."""
    taken = {g for holder, entry in held().items() if holder != exclude for g in entry["gpus"]}
    return [g for g in visible_gpus(env) if g not in taken]


def launch_env(env: dict[str, str] | None) -> tuple[dict[str, str], str | None]:
    """The environment of a launch, with the held GPUs left out; and one line saying so (None when nothing is held).

    A user's own CUDA_VISIBLE_DEVICES is kept as it is: they chose the devices."""
    merged = {**os.environ, **(env or {})}
    if "CUDA_VISIBLE_DEVICES" in merged or not visible_gpus(merged):
        return dict(env or {}), None
    holders = held()
    if not holders:
        return dict(env or {}), None
    left = free(env=merged)
    taken = ", ".join(f"GPU {','.join(e['gpus'])} by {e['what']} (pid {e['pid']})" for e in holders.values())
    if not left:
        raise NoFreeGpu(
            f"every GPU of this host is held ({taken}): stop it (`lmforge serve stop`) or set CUDA_VISIBLE_DEVICES"
        )
    return {**(env or {}), "CUDA_VISIBLE_DEVICES": ",".join(left)}, f"launching on GPU {','.join(left)} ({taken})"

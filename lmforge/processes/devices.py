"""GPUs of this host that long-lived services hold (the served model), kept out of every launch.

A served model keeps its GPUs after the flow that started it has ended, and with it any `gpu`
concurrency slot it held; without a record, the next training job, vLLM evaluation or promotion
would be placed on the same devices and collide with it (vLLM asks for 90% of GPU memory).

The record is **host-wide**: one registry for every user and workspace of the machine (GPUs are
the host's, not a user's), under one lock (`flock`). Choosing GPUs and holding them is one step
under that lock (`reserve`), taken *before* the service starts, on behalf of the process that will
start it; once the service runs, `transfer` hands the entry to the service's own process. An entry
lives as long as its holder: a process identified by its pid *and* its start time (and the boot),
so a pid the kernel reuses for another process does not keep GPUs held. Nobody has to clean up
after a killed server or a release that died half-way.

    $LMFORGE_DEVICE_REGISTRY (default /tmp/lmforge-devices)/gpus.json
        {holder: {"gpus": ["0"], "pid": 1234, "start": 98765, "boot": "...", "what": "served model ..."}}

The folder is world-writable with the sticky bit and the files are shared by every user (the same
trust as the GPUs themselves: any local user can start a process on them). Launches
(`lmforge.processes.launch.run_entry`) get `CUDA_VISIBLE_DEVICES` set to what is left, unless the user set it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lmforge.errors import DeterministicError
from lmforge.processes.supervise import pid_alive

REGISTRY_ENV = "LMFORGE_DEVICE_REGISTRY"
POLL_S = 0.5


class NoFreeGpu(DeterministicError):
    """Every GPU of the host is held by a long-lived service: a retry would meet the same."""


def _folder() -> Path:
    folder = Path(os.environ.get(REGISTRY_ENV, "/tmp/lmforge-devices"))
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(PermissionError):  # made by another user first: theirs to set
            os.chmod(folder, 0o1777)
    return folder


def _file() -> Path:
    return _folder() / "gpus.json"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc/PID/stat; None without it."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return stat[1] if stat else None


def identity(pid: int) -> dict[str, Any]:
    """What names a process beyond its pid: its start time and the boot it started in."""
    return {"pid": pid, "start": _start_time(pid), "boot": _boot_id()}


def holder_alive(entry: dict[str, Any]) -> bool:
    """The entry's process still runs: its pid lives, and it is the same process (start time, boot)."""
    pid = int(entry.get("pid", 0))
    if pid <= 0 or not pid_alive(pid):
        return False
    if entry.get("boot") and entry["boot"] != _boot_id():
        return False
    stat = _stat(pid)
    if stat is None:  # no /proc: the pid is all there is
        return True
    state, start = stat
    # a zombie has exited (its parent has not reaped it yet); another start time is another process
    return state != "Z" and entry.get("start") in (None, start)


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
    lock_path = path.with_suffix(".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    with os.fdopen(fd, "a") as lock:
        with contextlib.suppress(PermissionError):  # shared by every user of the host
            os.fchmod(fd, 0o666)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {}
        state = {k: v for k, v in state.items() if isinstance(v, dict) and holder_alive(v)}  # dead: freed
        yield state
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(state, indent=1))
        with contextlib.suppress(PermissionError):
            os.chmod(tmp, 0o666)
        os.replace(tmp, path)


def held() -> dict[str, dict[str, Any]]:
    """{holder: {"gpus", "pid", "start", "boot", "what"}} of the living holders."""
    with _locked() as state:
        return dict(state)


def hold(holder: str, gpus: list[str], pid: int, what: str) -> None:
    """Record that process `pid` holds `gpus` (until it dies or `release`)."""
    if not gpus:
        return
    with _locked() as state:
        state[holder] = {"gpus": list(gpus), **identity(pid), "what": what}


def reserve(
    holder: str,
    choose: Callable[[list[str]], list[str] | None],
    what: str,
    *,
    exclude: str | None = None,
    wait_s: float = 0.0,
) -> list[str]:
    """Choose GPUs and hold them, in one step under the host-wide lock, for this process (which starts
    the service and then `transfer`s the entry to it). `choose(usable)` gets the visible GPUs no living
    holder but `exclude` has and returns those to hold, or None when they are not enough: then this
    waits for holders to go, up to `wait_s`, and raises NoFreeGpu."""
    deadline = time.monotonic() + wait_s
    while True:
        with _locked() as state:
            taken = {g for name, entry in state.items() if name != exclude for g in entry["gpus"]}
            usable = [g for g in visible_gpus() if g not in taken]
            chosen = choose(usable)
            if chosen is not None:
                if chosen:
                    state[holder] = {"gpus": list(chosen), **identity(os.getpid()), "what": f"{what} (starting)"}
                return list(chosen)
            holders = ", ".join(f"GPU {','.join(e['gpus'])} by {e['what']} (pid {e['pid']})" for e in state.values())
        if time.monotonic() >= deadline:
            raise NoFreeGpu(
                f"{what}: not enough free GPUs on this host after {wait_s:.0f}s (held: {holders or 'none'})"
            )
        time.sleep(POLL_S)


def transfer(holder: str, new_holder: str, pid: int, what: str) -> None:
    """Hand `holder`'s GPUs to the running service `pid` under `new_holder` (its pid file)."""
    with _locked() as state:
        entry = state.pop(holder, None)
        if entry is not None:
            state[new_holder] = {"gpus": entry["gpus"], **identity(pid), "what": what}


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

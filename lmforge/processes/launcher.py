"""One launcher for every long subprocess: training ranks, TRL, lm-eval, the quantizer, vLLM.

`run()` starts a command under `lmforge.processes.supervise` (own process group, stopped with this
process, step lock held until the whole tree is gone, the step's time limit), streams its
output line by line into a logger (which reaches the Prefect run log), and returns the exit
code with the last lines of output for a one-line failure message. The caller classifies
the exit (retryable or not) with what it knows of its own command.

`stop_all()` stops every command this process launched and waits until they are gone:
Ctrl-C, SIGTERM (SLURM, systemd, Kubernetes eviction), and Prefect's cancellation and
crash hooks all come through it. A launch that was stopped raises `RunStopped`.

`start_detached()` is for a service that must outlive the flow (the vLLM server): it runs
under the same supervisor but is not watched, writes a pid file, and is stopped by pid
(`stop_detached`), never by name.

The step being computed sets a `StepScope` (lock fd, deadline) around its work; launches
inside it inherit both without every domain function passing them along.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import RunStopped, StepTimeout

REPO_ROOT = Path(__file__).resolve().parents[2]
QUIET_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
TIMED_OUT = 124  # lmforge.processes.supervise's exit code when the deadline passed
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepScope:
    step: str
    lock_fd: int | None = None
    deadline: float | None = None  # epoch seconds


_scope: contextvars.ContextVar[StepScope | None] = contextvars.ContextVar("lmforge_step_scope", default=None)


@contextlib.contextmanager
def step_scope(step: str, lock_fd: int | None, timeout_s: float | None) -> Iterator[StepScope]:
    scope = StepScope(step, lock_fd, time.time() + timeout_s if timeout_s else None)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def current_scope() -> StepScope | None:
    return _scope.get()


class _Live:
    """Supervisors of running launches, and which of them were asked to stop."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.processes: dict[int, subprocess.Popen] = {}
        self.stopped: set[int] = set()


_live = _Live()


def _start(
    full: list[str], env: dict[str, str] | None, cwd: str | Path | None, fds: tuple[int, ...]
) -> subprocess.Popen[str]:
    """The supervised command, its output merged into one line-buffered pipe, in a session of its own.

    A thread waits for the supervisor: were it killed (it then stopped nothing), what is left of
    its session is stopped within seconds, which also closes the pipe a reader may be blocked on.
    """
    process = subprocess.Popen(
        full,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=child_env(env),
        cwd=cwd,
        start_new_session=True,
        pass_fds=fds,
    )
    threading.Thread(target=_clean_after, args=(process,), name=f"lmforge-watch-{process.pid}", daemon=True).start()
    return process


def _clean_after(process: subprocess.Popen) -> None:
    from lmforge.processes.supervise import stop_session

    code = process.wait()
    if left := stop_session(process.pid, grace=5.0):
        _log.warning(
            "the supervisor of %s ended (exit %s) leaving %d process(es) of its tree; they were stopped",
            " ".join(str(a) for a in process.args[-3:]),  # type: ignore[index]
            code,
            len(left),
        )


# what a long-lived service (the served model) inherits: it answers clients, so it gets what it runs
# on and nothing else (no cloud credentials, no tokens: HF_TOKEN is left out although HF_ is kept)
SERVICE_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV",
    "PYTHONPATH", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "XDG_CACHE_HOME", "OMP_NUM_THREADS",
)  # fmt: skip
SERVICE_ENV_PREFIXES = (
    "LC_", "CUDA_", "NVIDIA_", "ROCR_", "HIP_", "HF_", "TRANSFORMERS_", "VLLM_", "TORCH", "TRITON_",
    "NCCL_", "MKL_", "KMP_", "LMFORGE_LOG", "LMFORGE_VLLM_",
)  # fmt: skip
SERVICE_ENV_SECRETS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY")


def service_env(inherit: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """The allow-listed part of this process's environment, plus the names in `inherit`."""
    return {
        name: value
        for name, value in os.environ.items()
        if name in inherit
        or (name not in SERVICE_ENV_SECRETS and (name in SERVICE_ENV or name.startswith(SERVICE_ENV_PREFIXES)))
    }


def child_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched command: ours (or `base`), quiet Hugging Face settings, the repo on the path."""
    env = {**(os.environ if base is None else base), **QUIET_ENV, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _supervised(
    command: list[str], watch: bool, scope: StepScope | None, grace: float
) -> tuple[list[str], tuple[int, ...]]:
    shim = [sys.executable, "-m", "lmforge.processes.supervise", "--grace", str(grace)]
    if watch:
        shim += ["--watch", str(os.getpid())]
    fds: tuple[int, ...] = ()
    if scope is not None and scope.lock_fd is not None:
        shim += ["--hold-fd", str(scope.lock_fd)]
        fds = (scope.lock_fd,)
    if scope is not None and scope.deadline is not None:
        shim += ["--deadline", str(scope.deadline)]
    return [*shim, "--", *command], fds


def run(
    command: list[str],
    log: logging.Logger,
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    noise: tuple[str, ...] = (),
    tail_lines: int = 3,
    grace: float = 20.0,
    what: str = "",
) -> tuple[int, str]:
    """Run `command` supervised, streaming its output into `log`; returns (exit code, last lines).

    Raises `RunStopped` if `stop_all` stopped it and `StepTimeout` if the step's time ran out.
    """
    scope = current_scope()
    full, fds = _supervised(command, watch=True, scope=scope, grace=grace)
    log.info("launching: %s", " ".join(command))
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    process = _start(full, env, cwd, fds)
    with _live.lock:
        _live.processes[process.pid] = process
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip()
            if line and not any(n in line for n in noise):
                log.info("%s", line)
                tail.append(line)
        returncode = process.wait()
    except BaseException:  # Ctrl-C or an error in this process: the command goes with it
        _stop(process, grace)
        raise
    finally:
        with _live.lock:
            _live.processes.pop(process.pid, None)
            stopped = process.pid in _live.stopped
            _live.stopped.discard(process.pid)
    name = what or os.path.basename(command[0])
    if stopped:
        raise RunStopped(
            f"{name} was stopped (cancelled or terminated); completed work is kept and the next run resumes from it"
        )
    if returncode == TIMED_OUT and scope is not None and scope.deadline is not None and time.time() >= scope.deadline:
        raise StepTimeout(
            f"{scope.step}: {name} ran past its time limit (runtime.step_timeout_s) and was stopped; "
            "completed work is kept"
        )
    return returncode, " | ".join(tail)


def _stop(process: subprocess.Popen, grace: float) -> None:
    """Ask the supervisor to stop its tree and wait until it (and so the tree) is gone."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace + 60)
    except subprocess.TimeoutExpired:  # the supervisor itself is stuck: take it and its whole tree down hard
        from lmforge.processes.supervise import kill_from_outside

        kill_from_outside(process.pid)
        process.wait()


def stop_all(grace: float = 20.0) -> int:
    """Stop every command launched from this process; returns how many were running.

    Returns only once they are gone, so a step lock released after this is never released
    while one of its processes still runs.
    """
    with _live.lock:
        running = list(_live.processes.values())
        _live.stopped.update(p.pid for p in running)
    threads = [threading.Thread(target=_stop, args=(p, grace)) for p in running]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(running)


_cancelling = threading.Event()


def mark_cancelling() -> None:
    """The SIGTERM this process is about to send itself hands a cancellation from the UI/API to the
    engine: the CLI reports a cancelled run (130), not a terminated one (143)."""
    _cancelling.set()


def cancelling() -> bool:
    return _cancelling.is_set()


def running() -> int:
    with _live.lock:
        return len(_live.processes)


# -- services used while a step runs (a temporary vLLM server) -----------------------------------


class Service:
    """A supervised command running beside the step's own work, its output streamed into `log`.

    It is watched like `run` (stops with this process, counted by `stop_all`); `stop()` ends it
    and waits until its tree is gone. `tail` keeps its last lines for error messages.
    """

    def __init__(
        self,
        command: list[str],
        log: logging.Logger,
        *,
        cwd: Path | str | None = None,
        env: dict[str, str] | None = None,
        tail_lines: int = 20,
        noise: tuple[str, ...] = (),
    ) -> None:
        full, fds = _supervised(command, watch=True, scope=None, grace=20.0)
        log.info("starting: %s", " ".join(command))
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.process = _start(full, env, cwd, fds)
        with _live.lock:
            _live.processes[self.process.pid] = self.process
        self._reader = threading.Thread(target=self._stream, args=(log, noise), daemon=True)
        self._reader.start()

    def _stream(self, log: logging.Logger, noise: tuple[str, ...]) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip()
            if line and not any(n in line for n in noise):
                log.debug("%s", line)
                self.tail.append(line)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        if self.alive():
            _stop(self.process, grace)
        with _live.lock:
            _live.processes.pop(self.process.pid, None)
            _live.stopped.discard(self.process.pid)
        self._reader.join(timeout=5)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- services that outlive the flow (the vLLM server) ------------------------------------------


def start_detached(
    command: list[str],
    log_file: Path,
    pid_file: Path,
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    meta: dict | None = None,
    inherit: list[str] | None = None,
) -> int:
    """Start `command` supervised but unwatched, output to `log_file`; returns the supervisor's pid.

    The pid file records the pid, the command and `meta`, so `stop_detached` can make sure the
    pid still belongs to this service before signalling it. It inherits only the allow-listed part
    of this environment (`service_env`) and the names in `inherit`, then `env`.
    """
    full, _ = _supervised(command, watch=False, scope=None, grace=20.0)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            full,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(env, base=service_env(inherit or [])),
            cwd=cwd,
            start_new_session=True,
        )
    record = {"pid": process.pid, "command": command, "started_at": time.time(), **(meta or {})}
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = pid_file.with_name(f".{pid_file.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, pid_file)
    return process.pid


def read_pid_file(pid_file: Path) -> dict | None:
    try:
        return json.loads(pid_file.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def detached_alive(record: dict | None) -> bool:
    """Whether the pid in `record` is still the supervisor of that command (pids get reused)."""
    if not record:
        return False
    pid = record["pid"]
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that exited: reap it
            return False
    cmdline = process_arguments(pid)
    return (
        cmdline is not None and b"lmforge.processes.supervise" in cmdline and record["command"][-1].encode() in cmdline
    )


def process_arguments(pid: int, settle_s: float = 2.0) -> list[bytes] | None:
    """The arguments of a live process, None if there is none. Right after `Popen` returns, the new
    process's /proc cmdline can still read empty for a moment (seen in about 1 of 5 starts here):
    read again until it settles rather than call a starting server dead."""
    deadline = time.time() + settle_s
    while True:
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if raw or time.time() > deadline:
            return raw.split(b"\0")
        time.sleep(0.01)


def survivors(record: dict | None) -> list[int]:
    """Processes of a detached service whose supervisor is gone (SIGKILLed, so it stopped nothing).

    They are found by the supervisor's session. A session id is not handed to a new process while
    the session has members, so a pid that is alive again belongs to someone else, and then the
    service's session had emptied before: nothing survives.
    """
    if not record or detached_alive(record):
        return []
    try:
        os.kill(record["pid"], 0)
        return []
    except ProcessLookupError:
        pass
    except PermissionError:
        return []
    from lmforge.processes.supervise import session_members

    return session_members(record["pid"])


def stop_detached(pid_file: Path, wait_s: float = 90.0) -> bool:
    """Stop the service of `pid_file` by pid; False if it was not running. Idempotent.

    A service whose supervisor was killed is stopped too: what is left of its session."""
    record = read_pid_file(pid_file)
    if not detached_alive(record):
        left = survivors(record)
        if left:
            from lmforge.processes.supervise import stop_session

            stop_session(record["pid"], grace=min(wait_s, 20.0))  # type: ignore[index]
        pid_file.unlink(missing_ok=True)
        return bool(left)
    pid = record["pid"]  # type: ignore[index]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.time() + wait_s
    while detached_alive(record) and time.time() < deadline:
        time.sleep(0.2)
    if detached_alive(record):
        from lmforge.processes.supervise import kill_from_outside

        kill_from_outside(pid)
    pid_file.unlink(missing_ok=True)
    return True

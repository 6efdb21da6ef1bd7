"""The one way a step launches an entry module: `run_entry(module, spec, out_dir, launch, policy)`.

Every long computation that runs in its own processes (DeepSpeed pretraining, TRL alignment,
lm-eval, the quantizer) is an entry module whose `main` is `lmforge.processes.entry.main(work)`. A step
hands this module the entry's name and a JSON spec; `run_entry` then

1. opens the next `logs/attempt-N/` of the step's output folder and writes the spec there (and
   beside the output as `spec_name`, the latest one) with the exact launch command;
2. builds the command for the chosen launcher: plain `python -m`, `torchrun`, `accelerate
   launch`, or DeepSpeed's runner (with a hostfile across nodes);
3. runs it supervised through `lmforge.processes.launcher.run` (own process group, output streamed into
   the step's logger, stopped on cancel/SIGTERM/the flow's death, the step's time limit);
4. classifies the ending by a named `ExitPolicy` from the exit records each process writes
   (`lmforge.processes.entry`), raising the error whose class says whether a retry can help.

A new training method or evaluator adds an entry module and calls `run_entry`; it writes no
launch code of its own.

Ports: `free_port` finds one for a rendezvous or a server; `owns_port` tells whether the socket
listening on it belongs to the process tree we started (from /proc/net/tcp{,6} and the tree's
open sockets), so a client checks that before it sends a server its key.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lmforge.errors import (
    PROGRAMMING_ERRORS,
    ConfigError,
    DeterministicError,
    ParityError,
    RetryableError,
    TrainingDiverged,
    TrainingInterrupted,
)
from lmforge.hashing import atomic_write_json
from lmforge.processes import devices, launcher
from lmforge.processes.entry import EXIT_RECORD, FAULT_RECORD, STARTED_MARK

log = logging.getLogger(__name__)
Launcher = Literal["python", "torchrun", "accelerate", "deepspeed"]
# launcher chatter that says nothing to a person reading the run log
NOISE = ("Setting accelerator to CPU", "get learning rate from scheduler before it has started", "it/s]")
NON_RETRYABLE = {
    "config_error": ConfigError,
    "diverged": TrainingDiverged,
    "parity_failed": ParityError,
    "deterministic": DeterministicError,
}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a rendezvous or a temporary server).

    Only right now: the socket is closed before the server binds its own, so on a shared host
    another process can take the port meanwhile. A client that sends a secret there first checks
    `owns_port` (vLLM binds its socket itself: a port cannot be handed over open)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6}: hex of 32-bit words, each in the host's byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _tcp_sockets() -> list[list[str]] | None:
    """The fields of every TCP socket of /proc/net/tcp and tcp6; None without them (not Linux)."""
    rows: list[list[str]] | None = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        rows = (rows or []) + [line.split() for line in lines]
    return rows


def listening_sockets(port: int, host: str = "127.0.0.1") -> set[int] | None:
    """Inodes of the TCP sockets listening where a connection to `host:port` can land: on that
    address, or on a wildcard one (IPv4's, IPv6's, or IPv4 mapped into IPv6). None without
    /proc/net/tcp (not Linux): who listens cannot be told there."""
    sockets = _tcp_sockets()
    if sockets is None:
        return None
    accepts = {host, "0.0.0.0", "::", f"::ffff:{host}"}
    found: set[int] = set()
    for fields in sockets:
        address, _, hex_port = fields[1].partition(":")
        if fields[3] == "0A" and int(hex_port, 16) == port and _proc_address(address) in accepts:  # 0A: LISTEN
            found.add(int(fields[9]))
    return found


def open_connections(port: int) -> int | None:
    """TCP connections established to local port `port` (a server's clients); None without /proc."""
    sockets = _tcp_sockets()
    if sockets is None:
        return None
    return sum(1 for f in sockets if f[3] == "01" and int(f[1].rpartition(":")[2], 16) == port)  # 01: ESTABLISHED


def socket_inodes(pids: set[int]) -> dict[int, int]:
    """The sockets the processes `pids` hold open: inode -> pid (those this user may look into)."""
    held: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile (the listing's own descriptor, for one)
                continue
            if link.startswith("socket:["):
                held[int(link[8:-1])] = pid
    return held


def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (a supervisor's server, the server's workers)."""
    import psutil

    try:
        return {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return set()


def owns_port(pid: int, port: int, host: str = "127.0.0.1") -> bool:
    """Whether a socket listens for `host:port` and every one that does belongs to `pid` or its
    descendants. True where /proc cannot tell (not Linux)."""
    listening = listening_sockets(port, host)
    if listening is None:
        return True
    return bool(listening) and listening <= socket_inodes(process_tree(pid)).keys()


def listening_pids(port: int, host: str = "127.0.0.1") -> set[int]:
    """The processes listening for `host:port`, of those this user may look into (all, as root)."""
    listening = listening_sockets(port, host) or set()
    if not listening:
        return set()
    every = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()}
    return {pid for inode, pid in socket_inodes(every).items() if inode in listening}


@dataclass(frozen=True)
class Launch:
    """How to start an entry module: which launcher, how many ranks on how many nodes.

    How is not what: none of this is part of a step's cache key.
    """

    launcher: Launcher = "python"
    num_ranks: int = 1  # processes per node
    num_nodes: int = 1
    hostfile: str | None = None  # DeepSpeed's runner across nodes
    node_launcher: str = "pdsh"
    master_port: int | None = None  # None: a free port of this machine
    python: str = field(default_factory=lambda: sys.executable)  # another environment's interpreter (the quantizer)

    @property
    def world_size(self) -> int:
        return self.num_ranks * self.num_nodes


@dataclass(frozen=True)
class ExitPolicy:
    """How the end of a launch is judged.

    `interrupted` is raised when a process ended without an exit record (killed by a signal, the
    OOM killer, a preempted node) or crashed with an error from the outside world: both worth a
    retry, which resumes from what the step had completed.
    """

    name: str
    interrupted: type[RetryableError]
    what: str


# distributed training: one exit record per rank; a lost rank means resume from the last checkpoint
RANKS = ExitPolicy("ranks", TrainingInterrupted, "training")
# one process (lm-eval, the quantizer): killed by a signal or an outside error = retryable
SINGLE = ExitPolicy("single", RetryableError, "the process")


def build_command(module: str, spec_path: Path, launch: Launch, master_port: int) -> list[str]:
    """The command line that starts `module --spec SPEC` under `launch.launcher`."""
    entry = [module, "--spec", str(spec_path)]
    if launch.launcher == "python":
        if launch.world_size != 1:
            raise ConfigError(f"launcher python starts one process, not {launch.world_size}")
        return [launch.python, "-m", *entry]
    if launch.launcher == "torchrun":
        command = [
            launch.python,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={launch.num_ranks}",
            f"--master_port={master_port}",
        ]
        if launch.num_nodes > 1:
            command.append(f"--nnodes={launch.num_nodes}")
        return [*command, "-m", *entry]
    if launch.launcher == "deepspeed":
        command = [launch.python, "-m", "deepspeed.launcher.runner", "--master_port", str(master_port)]
        if launch.hostfile:
            command += [
                "--hostfile",
                launch.hostfile,
                "--num_nodes",
                str(launch.num_nodes),
                "--launcher",
                launch.node_launcher,
            ]
        return [*command, "--num_gpus", str(launch.num_ranks), "--module", *entry]
    if launch.launcher == "accelerate":
        # on a CPU-only machine accelerate needs --multi_gpu to start more than one process (--cpu
        # starts one unless MPI is installed); the Trainer then runs on the CPU with gloo
        command = [
            launch.python,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            str(launch.num_ranks),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(master_port),
        ]
        if launch.num_ranks > 1:
            command.append("--multi_gpu")
        return [*command, "-m", *entry]
    raise ConfigError(f"unknown launcher {launch.launcher!r} (python, torchrun, accelerate, deepspeed)")


def next_attempt(out_dir: Path) -> int:
    """The number of the attempt about to start in `out_dir` (1 for the first)."""
    logs = out_dir / "logs"
    return len(list(logs.glob("attempt-*"))) + 1 if logs.exists() else 1


def attempt_dir(out_dir: Path, attempt: int) -> Path:
    return out_dir / "logs" / f"attempt-{attempt}"


def exit_records(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob(EXIT_RECORD.format(rank="*")))]


def processes_started(directory: Path) -> int:
    return len(list(directory.glob(STARTED_MARK.format(rank="*"))))


def fatal_signals(directory: Path) -> list[str]:
    """One line per process that died of a fatal signal: faulthandler's verdict and where the process
    was ("rank 0: Fatal Python error: Aborted in measure at training/align/entry.py:560, see ...")."""
    lines = []
    for path in sorted(directory.glob(FAULT_RECORD.format(rank="*"))):
        text = path.read_text(errors="replace").splitlines()
        if not text:
            continue
        verdict = text[0].strip()
        where = ""
        current = [i for i, line in enumerate(text) if line.startswith("Current thread")]
        frames = text[current[0] + 1 :] if current else text[1:]
        for frame in frames:  # '  File "/x/training/align/entry.py", line 560 in measure'
            parts = frame.strip().split('"')
            if frame.strip().startswith("File") and len(parts) >= 3:
                line_no, _, function = parts[2].replace(", line ", "").strip().partition(" in ")
                where = f" in {function} at {_short(parts[1])}:{line_no}"
                break
        rank = path.stem.rsplit("rank", 1)[-1]
        lines.append(f"rank {rank}: {verdict}{where}, see logs/{directory.name}/{path.name}")
    return lines


def _short(path: str) -> str:
    """A source path from the repository or site-packages on ('training/align/entry.py'), or as it is."""
    source = Path(path)
    if source.is_relative_to(launcher.REPO_ROOT):
        return str(source.relative_to(launcher.REPO_ROOT))
    parts = source.parts
    return "/".join(parts[parts.index("site-packages") + 1 :]) if "site-packages" in parts else path


@dataclass(frozen=True)
class Attempt:
    number: int
    directory: Path
    spec: dict[str, Any]


def run_entry(
    module: str,
    spec: dict[str, Any],
    out_dir: Path,
    *,
    launch: Launch = Launch(),
    policy: ExitPolicy = SINGLE,
    spec_name: str = "run_spec.json",
    logger: logging.Logger | None = None,
    env: dict[str, str] | None = None,
    what: str = "",
    tail_lines: int = 3,
    noise: tuple[str, ...] = NOISE,
) -> Attempt:
    """Launch `module` on `spec`, supervised; returns the attempt on success, raises by `policy` otherwise.

    The entry finds `out_dir`, `attempt`, `attempt_dir` and `world_size` in its spec.
    """
    number = next_attempt(out_dir)
    directory = attempt_dir(out_dir, number)
    directory.mkdir(parents=True, exist_ok=True)
    spec = {
        **spec,
        "out_dir": str(spec.get("out_dir", out_dir)),
        "attempt": number,
        "attempt_dir": str(directory),
        "world_size": launch.world_size,
    }
    spec_path = out_dir / spec_name
    atomic_write_json(spec_path, spec)
    atomic_write_json(directory / "spec.json", spec)
    command = build_command(module, spec_path, launch, launch.master_port or free_port())
    atomic_write_json(
        directory / "launch.json",
        {"command": command, "launcher": launch.launcher, "world_size": launch.world_size, "policy": policy.name},
    )
    name = what or policy.what
    env, placement = devices.launch_env(env)  # GPUs a served model holds are left out
    if placement:
        (logger or logging.getLogger(module)).info("%s", placement)
    returncode, tail = launcher.run(
        command,
        logger or logging.getLogger(module),
        cwd=out_dir,
        env=env,
        noise=noise,
        what=name,
        tail_lines=tail_lines,
    )
    records, started, faults = exit_records(directory), processes_started(directory), fatal_signals(directory)
    classify(policy, returncode, records, launch.world_size, started, tail, name, faults)
    return Attempt(number, directory, spec)


def _would_repeat(message: str) -> bool:
    """A crash record ("IndexError: ...") names a programming error, or running out of device memory."""
    name = message.split(":", 1)[0].strip()
    cls = getattr(builtins, name, None)
    return name == "OutOfMemoryError" or (isinstance(cls, type) and issubclass(cls, PROGRAMMING_ERRORS))


def classify(
    policy: ExitPolicy,
    returncode: int,
    records: list[dict[str, Any]],
    world_size: int,
    started: int | None = None,
    output_tail: str = "",
    what: str = "",
    faults: list[str] | None = None,
) -> None:
    """Raise the error that matches how the launch ended (nothing on success).

    `started` counts processes that got as far as running lmforge code. A launcher that exits
    before any did may have met a busy port or an unreachable node (worth a retry: it costs
    seconds) or a bad hostfile; either way the message carries its last output. `faults` (from
    `fatal_signals`) says where a process that died of a fatal signal was.
    """
    what = what or policy.what
    many = world_size > 1
    statuses = {r["status"] for r in records}
    if statuses == {"ok"} and len(records) == world_size:
        if returncode != 0:  # every process finished and recorded it; only the teardown failed
            log.warning(
                "%s: every process reported success but the launcher exited with %d; keeping the result",
                what,
                returncode,
            )
        return
    for record in records:
        if record["status"] in NON_RETRYABLE:
            where = f"rank {record['rank']}: " if many else ""
            raise NON_RETRYABLE[record["status"]](f"{where}{record['message']}")
    repeating = [r for r in records if r["status"] == "crash" and _would_repeat(r["message"])]
    if len(records) == world_size and repeating:  # nothing was lost: the crash is not a dead peer's fault
        first = repeating[0]
        where = f"rank {first['rank']} " if many else f"{what} "
        raise DeterministicError(f"{where}crashed with {first['message']} (a retry would repeat it; see logs/)")
    tail = f"; its last output: {output_tail}" if output_tail else ""
    if started == 0:
        raise policy.interrupted(f"{what}: the launcher exited with code {returncode} before any process started{tail}")
    missing = world_size - len(records)
    if missing <= 0:  # every process recorded a crash from the outside world (I/O, a peer, the network)
        raise policy.interrupted(
            f"{what} crashed with {records[0]['message']}; the next attempt resumes from what was completed"
        )
    died = f" ({'; '.join(faults)})" if faults else ""
    if not many:
        raise policy.interrupted(
            f"{what} ended with exit code {returncode} without finishing (killed?){died}{tail}; "
            "the next attempt resumes from what was completed"
        )
    raise policy.interrupted(
        f"{what} exited with code {returncode}; {missing} rank(s) died without a record{died}"
        + (f", others reported {sorted(statuses)}" if statuses else "")
        + "; the next attempt resumes from the latest verified checkpoint"
    )

"""Start distributed training as a subprocess and turn its ending into the right error.

The command is explicit (`deepspeed --num_gpus N [--hostfile F --num_nodes K] --module
training.train_entry --spec SPEC`, or torchrun). It runs in its own process group, so
cancelling the stage stops every rank (the deepspeed launcher alone leaves orphans on
SIGTERM). Rank-0 output is streamed line by line into the `training.launcher` logger,
which reaches the Prefect run log.

After exit, the per-rank exit records decide what happened: a deterministic failure
(config error, divergence, parity) is non-retryable; a rank that died without a record
(SIGKILL, OOM killer, preemption) or a communication error caused by a dead peer is a
`TrainingInterrupted`, which the Prefect retry turns into a resume from the last checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from lmforge.errors import PROGRAMMING_ERRORS, ConfigError, DeterministicError, ParityError, RunStopped, TrainingDiverged, TrainingInterrupted

log = logging.getLogger(__name__)
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
NOISE = ("Setting accelerator to CPU", "get learning rate from scheduler before it has started")
NON_RETRYABLE = {"config_error": ConfigError, "diverged": TrainingDiverged, "parity_failed": ParityError,
                 "deterministic": DeterministicError}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(launcher: str, num_ranks: int, spec_path: Path, master_port: int,
                  hostfile: str | None = None, num_nodes: int = 1) -> list[str]:
    module = ["training.train_entry", "--spec", str(spec_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={num_ranks}",
                f"--master_port={master_port}", "-m", *module]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(master_port)]
    if hostfile:
        command += ["--hostfile", hostfile, "--num_nodes", str(num_nodes)]
    return command + ["--num_gpus", str(num_ranks), "--module", *module]


def exit_records(out_dir: Path, attempt: int) -> list[dict[str, Any]]:
    records = []
    for path in sorted((out_dir / "logs" / f"attempt-{attempt}").glob("exit-rank*.json")):
        records.append(json.loads(path.read_text()))
    return records


def _would_repeat(message: str) -> bool:
    """A rank's crash record ("IndexError: ...") names a programming error, or running out of device memory."""
    import builtins

    name = message.split(":", 1)[0].strip()
    cls = getattr(builtins, name, None)
    return name == "OutOfMemoryError" or (isinstance(cls, type) and issubclass(cls, PROGRAMMING_ERRORS))


def ranks_started(out_dir: Path, attempt: int) -> int:
    return len(list((out_dir / "logs" / f"attempt-{attempt}").glob("started-rank*")))


def classify(returncode: int, records: list[dict[str, Any]], world_size: int,
             started: int | None = None, output_tail: str = "") -> None:
    """Raise the error that matches how the run ended (nothing on success).

    `started` counts ranks that got as far as running lmforge code. A launcher that exits
    before any did may have met a busy port or an unreachable node (worth a retry: it costs
    seconds, no training) or a bad hostfile; either way the message carries its last output.
    """
    statuses = {r["status"] for r in records}
    if statuses == {"ok"} and len(records) == world_size:
        if returncode != 0:  # every rank finished and recorded it; only the teardown failed
            log.warning("all ranks reported success but the launcher exited with %d; keeping the result", returncode)
        return
    for record in records:
        if record["status"] in NON_RETRYABLE:
            raise NON_RETRYABLE[record["status"]](f"rank {record['rank']}: {record['message']}")
    repeating = [r for r in records if r["status"] == "crash" and _would_repeat(r["message"])]
    if len(records) == world_size and repeating:  # no rank was lost: the crash is not a dead peer's fault
        first = repeating[0]
        raise DeterministicError(f"rank {first['rank']} crashed with {first['message']} "
                                 "(a retry would repeat it; see logs/rank-*.log)")
    if started == 0:
        raise TrainingInterrupted(f"the launcher exited with code {returncode} before any rank started"
                                  + (f"; its last output: {output_tail}" if output_tail else ""))
    missing = world_size - len(records)
    raise TrainingInterrupted(
        f"training exited with code {returncode}; {missing} rank(s) died without a record"
        + (f", others reported {sorted(statuses)}" if statuses else "")
        + "; the next attempt resumes from the latest verified checkpoint"
    )


_live: set[int] = set()  # process groups of running launches, for `stop_all`
_stopped = False


def stop_all() -> None:
    """Stop every training launched from this process (Ctrl-C, cancellation); they will not be retried."""
    global _stopped
    _stopped = True
    for group in list(_live):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)


def launch(command: list[str], out_dir: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the launcher in its own process group, streaming its output into our log.

    Returns the exit code and the last lines of output (for a one-line failure message)."""
    log.info("launching: %s", " ".join(command))
    repo_root = str(Path(__file__).resolve().parent.parent)
    full_env = {**os.environ, **QUIET_ENV, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, full_env.get("PYTHONPATH", "")) if p)
    tail: collections.deque[str] = collections.deque(maxlen=3)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                               env=full_env, cwd=out_dir, start_new_session=True)
    _live.add(process.pid)
    try:
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip()
            if line and not any(noise in line for noise in NOISE):
                log.info("%s", line)
                tail.append(line)
        returncode = process.wait()
    except BaseException:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        raise
    finally:
        _live.discard(process.pid)
    if _stopped:
        raise RunStopped("training was stopped by the user; the next run resumes from the latest checkpoint")
    return returncode, " | ".join(tail)

"""Start distributed training as a subprocess and turn its ending into the right error.

The command is explicit (`deepspeed --num_gpus N [--hostfile F --num_nodes K] --module
training.train_entry --spec SPEC`, or torchrun). It goes through lmforge's one launcher
(`lmforge.launcher`): own process group under a supervisor, so cancelling the stage, a
SIGTERM, or the death of the flow process stops every rank (the deepspeed launcher alone
leaves orphans on SIGTERM). Rank-0 output is streamed line by line into the
`training.launcher` logger, which reaches the Prefect run log.

After exit, the per-rank exit records decide what happened: a deterministic failure
(config error, divergence, parity) is non-retryable; a rank that died without a record
(SIGKILL, OOM killer, preemption) or a communication error caused by a dead peer is a
`TrainingInterrupted`, which the Prefect retry turns into a resume from the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from lmforge import launcher
from lmforge.errors import PROGRAMMING_ERRORS, ConfigError, DeterministicError, ParityError, TrainingDiverged, TrainingInterrupted

log = logging.getLogger(__name__)
NOISE = ("Setting accelerator to CPU", "get learning rate from scheduler before it has started")
NON_RETRYABLE = {"config_error": ConfigError, "diverged": TrainingDiverged, "parity_failed": ParityError,
                 "deterministic": DeterministicError}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(launcher: str, num_ranks: int, spec_path: Path, master_port: int,
                  hostfile: str | None = None, num_nodes: int = 1, node_launcher: str = "pdsh") -> list[str]:
    module = ["training.train_entry", "--spec", str(spec_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={num_ranks}",
                f"--master_port={master_port}", "-m", *module]
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(master_port)]
    if hostfile:
        command += ["--hostfile", hostfile, "--num_nodes", str(num_nodes), "--launcher", node_launcher]
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


def launch(command: list[str], out_dir: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run the training launcher supervised, streaming its output into our log.

    Returns the exit code and the last lines of output (for a one-line failure message)."""
    return launcher.run(command, log, cwd=out_dir, env=env, noise=NOISE, what="training")

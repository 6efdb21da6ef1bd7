"""What every launched entry module shares: `main(work)`, run inside each launched process.

    python -m training.train_entry --spec <out>/run_spec.json     (under deepspeed, torchrun,
    accelerate, or plain python: the same shape for every entry module)

`main` reads the spec `lmforge.processes.launch.run_entry` wrote, marks that this process started (so the
launcher can tell "the launcher failed" from "a process died"), logs to `logs/rank-<R>.log`
(rank 0 also to stdout, which the launcher streams into the step's log), runs `work(spec,
rank)`, and records how it ended in `logs/attempt-<N>/exit-rank<R>.json`: `ok`,
`config_error`, `diverged`, `parity_failed`, `deterministic` or `crash`. The launching step's
`ExitPolicy` turns those records into a retryable or a final error.

Only the standard library and `lmforge.errors` are imported here: entry modules also run in
other environments (the quantizer's).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_CODES = {"ok": 0, "crash": 1, "config_error": 2, "diverged": 3, "parity_failed": 4, "deterministic": 5}
EXIT_RECORD = "exit-rank{rank}.json"
STARTED_MARK = "started-rank{rank}"
FAULT_RECORD = "fault-rank{rank}.txt"
DOMAIN_LOGGERS = ("lmforge", "training", "data_prep", "evaluation", "serving")

Work = Callable[[dict[str, Any], int], Any]


def setup_logging(out_dir: Path, rank: int, quiet: Sequence[str] = ()) -> None:
    """rank-<R>.log for every rank; rank 0 also on stdout, which the launcher streams into the step's log."""
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(logs / f"rank-{rank}.log")]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    logging.basicConfig(
        level=logging.WARNING, handlers=handlers, force=True, format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s"
    )
    level = os.environ.get("LMFORGE_LOG_LEVEL", "INFO")  # runtime.log_level, passed by the launcher
    for ours in DOMAIN_LOGGERS:
        logging.getLogger(ours).setLevel(level)
    for noisy in quiet:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _outcome(work: Work, spec: dict[str, Any], rank: int) -> tuple[str, str]:
    from lmforge.errors import ConfigError, DeterministicError, ParityError, TrainingDiverged

    try:
        work(spec, rank)
    except TrainingDiverged as exc:
        return "diverged", str(exc)
    except ParityError as exc:
        return "parity_failed", str(exc)
    except DeterministicError as exc:
        return "deterministic", str(exc)
    except ConfigError as exc:  # its message names the field already
        return "config_error", str(exc)
    except ValueError as exc:
        return "config_error", f"ValueError: {exc}"
    except Exception as exc:  # noqa: BLE001 - classified for the launcher, traceback logged
        logging.getLogger("lmforge.processes.entry").exception("rank %d crashed", rank)
        return "crash", f"{type(exc).__name__}: {exc}"
    return "ok", ""


def run_recorded(work: Work, spec_path: str, quiet: Sequence[str] = ()) -> int:
    """Run `work(spec, rank)` as one process of the launch and record its outcome; returns the exit code."""
    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    attempt_dir = Path(spec.get("attempt_dir") or out_dir / "logs" / f"attempt-{spec.get('attempt', 0)}")
    attempt_dir.mkdir(parents=True, exist_ok=True)
    (attempt_dir / STARTED_MARK.format(rank=rank)).touch()  # the launcher did its part; what follows is ours
    setup_logging(out_dir, rank, quiet)
    fault = attempt_dir / FAULT_RECORD.format(rank=rank)
    with open(fault, "w") as fault_file:
        # a process killed by a fatal signal (SIGABRT from a C++ library, SIGSEGV, SIGBUS) records no
        # outcome; faulthandler leaves where every thread was, which the launching step names (lmforge.processes.launch)
        faulthandler.enable(file=fault_file, all_threads=True)
        try:
            status, message = _outcome(work, spec, rank)
        finally:
            faulthandler.disable()
    if not fault.stat().st_size:
        fault.unlink()
    record = {"rank": rank, "status": status, "message": message, "attempt": spec.get("attempt"), "at": time.time()}
    path = attempt_dir / EXIT_RECORD.format(rank=rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # a record is whole or absent (absent = the process died)
    if status != "ok":
        logging.getLogger("lmforge.processes.entry").error("rank %d: %s: %s", rank, status, message)
    shutdown_distributed()
    return EXIT_CODES[status]


def shutdown_distributed() -> None:
    """Tear the process group down explicitly: left to interpreter exit, gloo's threads can abort."""
    if "torch" not in sys.modules:
        return
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - peers may already be gone; the outcome is recorded
        pass


def main(work: Work, argv: Sequence[str] | None = None, quiet: Sequence[str] = ()) -> int:
    """The `main` of every entry module: `sys.exit(main(work))`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="the JSON spec lmforge.processes.launch.run_entry wrote")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help="set by some launchers; unused")
    args = parser.parse_args(argv)
    code = run_recorded(work, args.spec, quiet)
    if argv is None:  # the process's own entry point, not a test calling it
        exit_now(code)
    return code


def exit_now(code: int) -> NoReturn:
    """End the process once its outcome is recorded and its process group destroyed, without the
    interpreter's finalization: C++ threads left by the libraries a rank ran (gloo's, a trainer's
    helpers) can meet a half-finalized interpreter there and abort ("terminate called without an
    active exception", SIGABRT). A rank that ended first while rank 0 still exported did exactly that,
    and the launcher then killed rank 0 mid-export and the step retried. Logs and stdio are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)

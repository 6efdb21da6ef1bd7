"""What every training rank does around its work, whatever trains (DeepSpeed pretraining, TRL).

A rank marks that it started (so the launcher can tell "the launcher failed" from "a rank
died"), logs to `logs/rank-<R>.log` (rank 0 also to stdout, which the launcher streams into
the Prefect run log), and records how it ended in `logs/attempt-<N>/exit-rank<R>.json`:
`ok`, `config_error`, `diverged`, `parity_failed`, `deterministic` or `crash`.
`training.launcher.classify` turns those records into a retryable or a final error.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

EXIT_CODES = {"ok": 0, "crash": 1, "config_error": 2, "diverged": 3, "parity_failed": 4, "deterministic": 5}


def setup_logging(out_dir: Path, rank: int) -> None:
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(logs / f"rank-{rank}.log")]
    if rank == 0:  # only rank 0 talks to the launcher's stdout, which streams into the Prefect log
        handlers.append(logging.StreamHandler(sys.stdout))
    logging.basicConfig(level=logging.WARNING, handlers=handlers, force=True,
                        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s")
    level = os.environ.get("LMFORGE_LOG_LEVEL", "INFO")  # runtime.log_level, passed by the launcher
    for ours in ("training", "data_prep", "lmforge", "evaluation"):
        logging.getLogger(ours).setLevel(level)


def disable_shm_comm_op() -> None:
    """On CPU, DeepSpeed would JIT-build its shared-memory all-reduce (inference only, 40-90 s)."""
    import torch

    if not torch.cuda.is_available():
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def run_rank(work: Callable[[dict[str, Any], int], Any], spec_path: str) -> int:
    """Run `work(spec, rank)` as one rank and record its outcome; returns the process exit code."""
    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    attempt_dir = out_dir / "logs" / f"attempt-{spec.get('attempt', 0)}"
    attempt_dir.mkdir(parents=True, exist_ok=True)
    (attempt_dir / f"started-rank{rank}").touch()  # the launcher did its part; what follows is ours
    setup_logging(out_dir, rank)
    from lmforge.errors import ConfigError, DeterministicError, ParityError, TrainingDiverged

    status, message = "ok", ""
    try:
        work(spec, rank)
    except TrainingDiverged as exc:
        status, message = "diverged", str(exc)
    except ParityError as exc:
        status, message = "parity_failed", str(exc)
    except DeterministicError as exc:
        status, message = "deterministic", str(exc)
    except (ConfigError, ValueError) as exc:
        status, message = "config_error", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - classified for the launcher, traceback logged
        logging.getLogger("training").exception("rank %d crashed", rank)
        status, message = "crash", f"{type(exc).__name__}: {exc}"
    record = {"rank": rank, "status": status, "message": message, "attempt": spec.get("attempt"), "at": time.time()}
    (attempt_dir / f"exit-rank{rank}.json").write_text(json.dumps(record))
    if status != "ok":
        logging.getLogger("training").error("rank %d: %s: %s", rank, status, message)
    shutdown_distributed()
    return EXIT_CODES[status]


def shutdown_distributed() -> None:
    """Tear the process group down explicitly: left to interpreter exit, gloo's threads can abort."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - peers may already be gone; the outcome is recorded
        pass

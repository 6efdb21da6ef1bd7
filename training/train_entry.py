"""Entry point of every training rank (started by the deepspeed or torchrun launcher).

    deepspeed --num_gpus N training/train_entry.py --spec <out>/run_spec.json

It reads the run spec written by `training.launcher`, trains with `training.loop.Trainer`,
exports the Hugging Face model with a parity check, and records its outcome in
`logs/exit-rank<R>.json` so the launcher can tell retryable from deterministic failures.
Exit codes: 0 ok, 2 configuration error, 3 divergence, 4 parity failure, 5 another failure that
would repeat (e.g. only damaged checkpoints), 1 other crash.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

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
    for ours in ("training", "data_prep", "lmforge"):
        logging.getLogger(ours).setLevel(level)


def init_distributed() -> tuple[int, int]:
    import deepspeed
    import torch

    if not torch.cuda.is_available():
        # The shared-memory all-reduce op is only used for inference, and building it costs
        # ~40 s on a fresh machine; training communicates over gloo without it.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        per_rank = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        torch.set_num_threads(per_rank)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def run(spec: dict, rank: int, world: int) -> dict:
    import torch

    from lmforge.errors import ParityError
    from training.config import PretrainConfig
    from training.export import consolidated_state, parity_gap, save_hf
    from training.loop import Trainer
    from training.planner import Plan

    cfg = PretrainConfig.model_validate(spec["config"])
    plan = Plan(**spec["plan"])
    out_dir, pack_dir = Path(spec["out_dir"]), Path(spec["pack_dir"])
    torch.use_deterministic_algorithms(True, warn_only=True)
    trainer = Trainer(cfg, plan, pack_dir, out_dir, spec["special"], rank, world, spec.get("peak_tflops"))
    summary = trainer.run()
    state = consolidated_state(trainer.engine, plan.zero_stage)
    hf_dir = out_dir / "hf"
    if rank == 0:
        save_hf(state, cfg, trainer.vocab_size, spec["special"], Path(spec["tokenizer_dir"]), hf_dir)
    trainer._barrier()
    windows = list(range(min(4, len(trainer.val_data) or 1)))
    data = trainer.val_data if len(trainer.val_data) else trainer.train_data
    batch = torch.from_numpy(data.batch(windows))[:, :-1].to(trainer.device)
    gap = trainer._broadcast(parity_gap(trainer.engine, hf_dir, batch))
    summary["parity_max_abs_logit_diff"] = gap
    if rank == 0:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "anomalies.json").write_text(json.dumps(trainer.anomalies, indent=2))
    if gap > cfg.parity_tolerance:
        raise ParityError(f"exported model's logits differ from the engine's by {gap:.3g} "
                          f"(tolerance {cfg.parity_tolerance})")
    logging.getLogger("training").info("export parity ok: max |logit diff| %.3g; model at %s", gap, hf_dir)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    out_dir = Path(spec["out_dir"])
    rank = int(os.environ.get("RANK", "0"))
    attempt_dir = out_dir / "logs" / f"attempt-{spec.get('attempt', 0)}"
    attempt_dir.mkdir(parents=True, exist_ok=True)
    (attempt_dir / f"started-rank{rank}").touch()  # the launcher did its part; what follows is ours
    setup_logging(out_dir, rank)
    from lmforge.errors import ConfigError, DeterministicError, ParityError, TrainingDiverged

    status, message = "ok", ""
    try:
        rank, world = init_distributed()
        run(spec, rank, world)
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
    _shutdown_distributed()
    return EXIT_CODES[status]


def _shutdown_distributed() -> None:
    """Tear the process group down explicitly: left to interpreter exit, gloo's threads can abort."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - peers may already be gone; the outcome is recorded
        pass


if __name__ == "__main__":
    sys.exit(main())

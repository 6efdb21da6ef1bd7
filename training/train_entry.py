"""Entry point of every training rank (started by the deepspeed or torchrun launcher).

    torchrun --nproc_per_node N -m training.train_entry --spec <out>/run_spec.json
    deepspeed --num_gpus N --module training.train_entry --spec <out>/run_spec.json   (DeepSpeed's runner)

The engine (`training.parallel`) named by the plan joins the process group and wraps the model.

It reads the run spec written by `training.steps`, trains with `training.loop.Trainer`,
exports the Hugging Face model with a parity check, and records its outcome through
`lmforge.processes.entry.main` so the launching step can tell retryable from deterministic failures.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from lmforge.processes.entry import main
from training.device_setup import preload_libraries, safe_attention_kernels


def init_distributed(backend: str) -> tuple[int, int]:
    """Thread count or GPU for this rank, then the engine's process group: (rank, world size)."""
    import torch
    import torch.distributed as dist

    from training.parallel import engine

    if not torch.cuda.is_available():
        per_rank = max(
            1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        )
        torch.set_num_threads(per_rank)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        safe_attention_kernels()
    engine(backend).init_process_group()
    return dist.get_rank(), dist.get_world_size()


def run(spec: dict, rank: int, world: int) -> dict:
    import torch

    from lmforge.errors import ParityError
    from training.config import PretrainConfig
    from training.export import parity_gap, save_hf
    from training.loop import Trainer
    from training.parallel import engine
    from training.planner import Plan

    cfg = PretrainConfig.model_validate(spec["config"])
    plan = Plan(**spec["plan"])
    out_dir, pack_dir = Path(spec["out_dir"]), Path(spec["pack_dir"])
    torch.use_deterministic_algorithms(True, warn_only=True)
    trainer = Trainer(
        cfg,
        plan,
        pack_dir,
        out_dir,
        spec["special"],
        rank,
        world,
        spec.get("peak_tflops"),
        tuple(spec["debug"]["nan_at_batches"]),
        Path(spec["base_dir"]) if spec.get("base_dir") else None,
        tuple(spec["debug"]["nan_grad_at_batches"]),
        spec["debug"].get("step_delay_s", 0.0),
        spec.get("rope"),
        spec.get("document_mask", False),
    )
    summary = trainer.run()
    state = engine(plan.backend).consolidated_state(trainer.engine, plan)
    hf_dir = out_dir / "hf"
    if rank == 0:
        if state is None:
            raise RuntimeError("rank 0 holds no consolidated model state to export")
        base = Path(spec["base_dir"]) if spec.get("base_dir") else None
        save_hf(
            state, cfg, trainer.vocab_size, spec["special"], Path(spec["tokenizer_dir"]), hf_dir, base, spec.get("rope")
        )
    trainer._barrier()
    data = trainer.val_data if len(trainer.val_data) else trainer.train_data
    # pipeline stages run the training's micro-batch shapes: one data rank's step of them
    rows = plan.grad_accum * cfg.distributed.micro_batch_size if "pp" in plan.degrees else min(4, len(data) or 1)
    windows = [i % max(1, len(data)) for i in range(rows)]
    batch = torch.from_numpy(data.batch(windows))[:, :-1].to(trainer.device)
    gap = trainer._broadcast(parity_gap(trainer.engine, hf_dir, batch, trainer.forward_logits))
    summary["parity_max_abs_logit_diff"] = gap
    if rank == 0:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (out_dir / "anomalies.json").write_text(json.dumps(trainer.anomalies, indent=2))
    if not gap <= cfg.parity_tolerance:  # NaN is no pass
        raise ParityError(
            f"exported model's logits differ from the engine's by {gap:.3g} (tolerance {cfg.parity_tolerance})"
        )
    logging.getLogger("training").info("export parity ok: max |logit diff| %.3g; model at %s", gap, hf_dir)
    return summary


def work(spec: dict, rank: int) -> None:
    rank, world = init_distributed(spec["plan"]["backend"])
    run(spec, rank, world)


if __name__ == "__main__":
    preload_libraries()
    sys.exit(main(work))

"""Entry point of every alignment rank, whatever the method, started by accelerate, torchrun or deepspeed.

    accelerate launch --multi_gpu --num_processes N -m training.align.entry --spec <out>/run_spec.json

The spec (written by `training.align.steps`) says what to train (`kind`: a registered method,
`training.align.methods`), from which model, on which data, and how. The rank trains with the
method's TRL trainer,
checkpoints every `save_steps` (model, optimizer, scheduler, every rank's RNG, data position:
the HF Trainer's own checkpoints), and on a retry resumes from the newest *complete*
checkpoint -- never from step 0 into a directory holding progress. Rank 0 then writes `hf/`
(for LoRA: `adapter/` plus the merged model, checked against the PEFT model's logits), and
measures the held-out split (`training.align.heldout`) for the model it started from and the
one it made, so the step's summary can say what alignment changed. Outcomes are recorded by
`lmforge.processes.entry.main` for the launching step's retry decision.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.processes.entry import main
from training.align.kit import METRICS, barrier, load_model, sharded, tensor_parallel
from training.device_setup import disable_shm_comm_op, imports_without, preload_libraries, safe_attention_kernels

if TYPE_CHECKING:
    from transformers import Trainer

    from training.align.methods import AlignMethod

log = logging.getLogger("training.align")


def newest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint that verifies against the checksums `SealCheckpoints` wrote once every
    rank had finished writing it. One without them (a kill mid-save) or with a file that differs (a
    truncated rank file) is set aside under a unique name, never resumed from; the previous one is."""
    from training.checkpoint import set_aside, verify

    if not root.exists():
        return None
    found = sorted(
        (p for p in root.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
        reverse=True,
    )
    for candidate in found:
        problem = verify(candidate)
        if problem is None:
            return candidate
        set_aside(candidate, "incomplete: " + problem if problem.startswith("no ") else problem)
    return None


def resume_point(out_dir: Path) -> Path | None:
    from lmforge.errors import DeterministicError

    checkpoint = newest_checkpoint(out_dir / "checkpoints")
    metrics = out_dir / METRICS
    if checkpoint is None and metrics.exists() and metrics.stat().st_size:
        raise DeterministicError(
            f"{out_dir}: {METRICS} records training progress but no complete checkpoint is left; "
            "refusing to restart from step 0 over it (delete the output folder to start over)"
        )
    return checkpoint


def _callbacks(method: AlignMethod, spec: dict[str, Any], trainer_holder: dict[str, Any]) -> list[Any]:
    from transformers import TrainerCallback

    out_dir = Path(spec["out_dir"])
    heldout = spec.get("heldout_generation") or []

    class JsonlMetrics(TrainerCallback):
        """Rank 0: one JSON line per logged step, with tokens/s from TRL's `num_tokens`."""

        def __init__(self) -> None:
            self.last: tuple[float, float] | None = None

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            counted = trainer_holder.get("tokens")
            if counted is not None and logs is not None and "train_runtime" not in logs:  # every rank: a collective
                logs.setdefault("num_tokens", counted.total(trainer_holder["trainer"]))
            if not state.is_world_process_zero or not logs or "train_runtime" in logs:
                return
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
            now, tokens = time.time(), float(logs.get("num_tokens", 0.0))
            if self.last is not None and tokens > self.last[1]:
                row["tokens_per_s"] = (tokens - self.last[1]) / max(now - self.last[0], 1e-9)
            self.last = (now, tokens)
            if "rewards/chosen" in row and spec["config"].get("beta"):
                row["kl_chosen"] = row["rewards/chosen"] / spec["config"]["beta"]  # log pi/pi_ref of chosen
            with open(out_dir / METRICS, "a") as handle:
                handle.write(json.dumps(row) + "\n")
            if state.global_step % spec["config"]["log_every"] == 0 and "loss" in row:
                extra = "".join(f" {k} {row[k]:.3f}" for k in ("rewards/accuracies", "rewards/margins") if k in row)
                log.info(
                    "%s step %d/%d loss %.4f%s%s",
                    spec["kind"],
                    state.global_step,
                    state.max_steps,
                    row["loss"],
                    extra,
                    f" {row['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in row else "",
                )

    class HeldoutGeneration(TrainerCallback):
        """Rank 0, every `eval_every` steps: exact match of greedy answers on held-out verifiable items."""

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            every = spec["eval_every"]
            if not heldout or state.global_step % every or not state.is_world_process_zero or sharded(spec):
                return
            if not method.generates:  # a classifier does not generate; RL's watch measures this
                return
            from training.align.heldout import exact_match

            model = trainer_holder["trainer"].accelerator.unwrap_model(trainer_holder["trainer"].model)
            was_training = model.training
            score = exact_match(model, trainer_holder["tokenizer"], heldout)["exact_match"]
            model.train(was_training)
            with open(out_dir / METRICS, "a") as handle:
                handle.write(json.dumps({"step": state.global_step, "heldout_exact_match": score}) + "\n")
            log.info("step %d: held-out exact match %.3f", state.global_step, score)

    class SealCheckpoints(TrainerCallback):
        """After the Trainer saved `checkpoint-N` on every rank: wait for all of them (each writes its own
        RNG state, DeepSpeed its shards), then rank 0 writes the checksums that make it complete."""

        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            from training.checkpoint import seal

            barrier()
            if state.is_world_process_zero:
                seal(Path(args.output_dir) / f"checkpoint-{state.global_step}")
            barrier()

    return [JsonlMetrics(), HeldoutGeneration(), SealCheckpoints(), *method.callbacks(spec, trainer_holder)]


class TokenCount:
    """The tokens of the batches every rank trains on, for trainers that log no `num_tokens`: the
    non-padding positions of the batch's `keys` (attention masks), counted as TRL counts its own
    trainers' (`num_tokens`: every token the forward pass sees, summed over ranks)."""

    def __init__(self, trainer: Any, keys: tuple[str, ...]) -> None:
        self.local: Any = 0  # a tensor on the batch's device once counting starts: no host sync per step
        step = trainer.training_step

        def training_step(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            for key in keys:
                if key in inputs:
                    self.local = self.local + inputs[key].detach().sum()
            return step(model, inputs, *args, **kwargs)

        trainer.training_step = training_step

    def total(self, trainer: Any) -> float:
        """Summed over ranks (a collective: every rank calls it at the same logged steps)."""
        import torch

        local = torch.as_tensor(self.local, dtype=torch.float64).reshape(1).to(trainer.accelerator.device)
        return float(trainer.accelerator.reduce(local, reduction="sum").item())


def stop_at_max_steps(trainer: Any) -> None:
    """Make a resume from the final checkpoint train nothing more.

    transformers' loop (5.x `Trainer._inner_training_loop`) takes an optimizer step before it first
    checks `max_steps`, so a retry resumed from `checkpoint-<max_steps>` (a rank that died after the
    last save, in the export or at exit) trained step max_steps+1 and exported a model the config does
    not describe. Every epoch is skipped once `global_step` has reached `max_steps`; the checkpoint's
    weights are still loaded (by the Trainer, DeepSpeed's or FSDP's path alike) and exported."""
    run_epoch = getattr(trainer, "_run_epoch", None)
    if run_epoch is None:
        raise RuntimeError("transformers' Trainer has no _run_epoch: check training.align.entry.stop_at_max_steps")

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if trainer.state.global_step >= trainer.state.max_steps > 0:
            trainer.control.should_training_stop = True
            return None
        return run_epoch(*args, **kwargs)

    trainer._run_epoch = guarded


def logged_train_loss(metrics: Path, final_step: int, fallback: float) -> float:
    """The mean training loss over steps 1..final_step, from the per-step rows (the last row of a step
    logged twice, by an attempt and its resume). transformers' own figure counts the resumed attempt's
    losses only, divided by every step."""
    losses: dict[int, float] = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "loss" in row and 0 < row["step"] <= final_step:
                losses[row["step"]] = float(row["loss"])
    return sum(losses.values()) / len(losses) if losses else fallback


def train(spec: dict[str, Any], rank: int) -> None:
    """One rank: the method's TRL trainer on the start model, resumed from the newest complete
    checkpoint; rank 0 exports and measures the result (`finish`)."""
    from training.align.methods import method as registered

    method = registered(spec["kind"])
    if not spec.get("quantized_base"):
        # Only QLoRA quantizes with bitsandbytes; peft, TRL and transformers import it because it is
        # installed (1.4 s of CPU per rank on 2 cores, and a warning about its CPU kernels in every log).
        # The rank's libraries are imported here without it: they record it as absent for this process.
        with imports_without("bitsandbytes"):
            import peft  # noqa: F401
            import transformers.trainer  # noqa: F401
            import trl  # noqa: F401
    out_dir = Path(spec["out_dir"])
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(out_dir / "tensorboard")  # transformers 5 has no logging_dir
    disable_shm_comm_op()
    safe_attention_kernels()
    degree = tensor_parallel(spec)
    if degree > 1:
        import torch

        if not torch.cuda.is_available():
            from training.parallel.dims.tensor import allow_on_cpu

            allow_on_cpu()
    if spec["zero_stage"]:
        import deepspeed
        import torch

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")  # before ZeRO-3 loads
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["base_dir"])
    holder: dict[str, Any] = {"tokenizer": tokenizer}
    resume = resume_point(out_dir)
    if resume is not None:
        log.info("resuming from %s", resume.name)
    model: Any = None
    if not method.loads_policy:
        pass
    elif spec.get("quantized_base"):
        from training.align.qlora import four_bit_layers, load_4bit

        model = load_4bit(spec["base_dir"], spec["precision"])
        log.info("QLoRA: %d linear layers in 4-bit NF4 (double quantization)", four_bit_layers(model))
    else:
        model = load_model(spec["base_dir"], spec["precision"], degree)
    trainer: Trainer = method.trainer(spec, model, tokenizer, _callbacks(method, spec, holder))
    holder["trainer"] = trainer
    if degree > 1:
        from training.align import tp_checkpoint

        tp_checkpoint.install(trainer)
    if method.token_keys:  # a trainer that counts no tokens itself (TRL's experimental ORPO and CPO)
        holder["tokens"] = TokenCount(trainer, method.token_keys)
    if spec.get("quantized_base"):
        from training.align.qlora import adapters_in_fp32

        adapters_in_fp32(trainer.model)
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for noisy in (PrinterCallback, ProgressCallback):  # a dict or a progress bar per step; JsonlMetrics logs instead
        trainer.remove_callback(noisy)
    if rank == 0:
        log.info(
            "distributed: %s over %d rank(s)%s",
            trainer.accelerator.distributed_type,
            trainer.accelerator.num_processes,
            f", tensor parallel {degree} (transformers' plan)" if degree > 1 else "",
        )
    stop_at_max_steps(trainer)
    started = time.time()
    result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    seconds = time.time() - started
    target = out_dir / ("adapter" if spec.get("lora") else "hf")
    trainer.save_model(str(target))  # collective under ZeRO-3 and tensor parallelism; written by rank 0
    if rank == 0 and degree > 1:
        from training.align.tp_checkpoint import tidy_export

        tidy_export(target)
    if rank == 0:
        finish(method, spec, trainer, tokenizer, result, seconds)


def finish(
    method: AlignMethod, spec: dict[str, Any], trainer: Any, tokenizer: Any, result: Any, seconds: float
) -> None:
    """Rank 0: the method's export of `hf/`, its held-out figures and warnings, summary.json."""
    out_dir = Path(spec["out_dir"])
    hf = out_dir / "hf"
    for export in (hf, out_dir / "adapter"):  # a pickle has no place next to the weights it describes
        (export / "training_args.bin").unlink(missing_ok=True)
    summary: dict[str, Any] = {
        "final_step": trainer.state.global_step,
        "train_loss": logged_train_loss(out_dir / METRICS, trainer.state.global_step, result.training_loss),
        "train_seconds": round(seconds, 2),
    }
    summary.update(method.export(spec, tokenizer, hf))
    summary.update(method.measure(spec, tokenizer, hf))
    summary["warnings"] = method.warnings(spec, summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    preload_libraries()
    sys.exit(main(train))

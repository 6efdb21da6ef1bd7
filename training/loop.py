"""The training loop that runs inside every training rank, whatever the engine (`training.parallel`).

One optimizer step = `grad_accum` micro-batches on every rank. Each micro-batch loss is
averaged over ranks before its backward pass, so every rank takes the same decision:
a non-finite loss, or a step loss that the spike detector flags, triggers a rollback to
the last verified checkpoint with the offending micro-batches added to the skip set (and
optionally a lower learning rate). The rollback rebuilds the engine before loading, so no
half-accumulated gradient or DeepSpeed counter survives from the aborted step.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import DeterministicError, TrainingDiverged
from lmforge.hashing import atomic_write_json
from training import checkpoint, float8
from training.config import PretrainConfig
from training.guardrails import SpikeDetector
from training.metrics import METRICS_FILE, MetricsWriter, flops_per_token, memory_mb, peak_memory_mb
from training.model import build_model, load_base
from training.parallel import all_dimensions, engine, mesh
from training.planner import Plan
from training.reader import BatchSchedule, TokenWindows
from training.router import RouterStats

log = logging.getLogger(__name__)


def token_loss(logits: Any, targets: Any) -> Any:
    """Mean next-token cross-entropy in fp32 (whole or vocabulary-split logits alike)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass
class Anomaly:
    kind: str
    step: int
    batches: list[int]  # start positions (in windows) of the offending global micro-batches
    loss: float
    window_mean: float | None


class Trainer:
    """Owns the engine, data schedule, guardrails and checkpoints of one rank."""

    def __init__(
        self,
        cfg: PretrainConfig,
        plan: Plan,
        pack_dir: Path,
        out_dir: Path,
        special: dict[str, int],
        rank: int,
        world: int,
        peak_tflops: float | None,
        nan_at_batches: tuple[int, ...] = (),
        base_dir: Path | None = None,
        nan_grad_at_batches: tuple[int, ...] = (),
        step_delay_s: float = 0.0,
        rope: dict[str, Any] | None = None,
        document_mask: bool = False,
    ):
        import torch

        self.step_delay_s = step_delay_s  # debug.pretrain: a tiny run as slow as a real one

        self.nan_at_batches = set(nan_at_batches)  # debug.pretrain: a reproducible divergence
        self.nan_grad_at_batches = set(nan_grad_at_batches)  # ... and a finite loss with NaN gradients

        self.cfg, self.plan, self.rank, self.world = cfg, plan, rank, world
        self.out_dir, self.special, self.base_dir = out_dir, special, base_dir
        self.rope = rope  # the base's rotary positions stretched to seq_len (context extension), or None
        self.document_mask = document_mask  # attention within each packed document (TokenWindows.positions)
        self.train_data = TokenWindows(pack_dir, "train", cfg.seq_len)
        self.val_data = TokenWindows(pack_dir, "val", cfg.seq_len)
        self.vocab_size = self.train_data.vocab_size
        if base_dir is not None:  # the base's embedding rows (Qwen-style bases have more than the tokenizer)
            self.vocab_size = json.loads((base_dir / "config.json").read_text())["vocab_size"]
        micro = cfg.distributed.micro_batch_size
        # ranks of one model-parallel group read the same batch: the schedule is over data-parallel ranks
        self.data_world, self.data_rank = plan.data_parallel, mesh.data_rank(plan, rank)
        self.schedule = BatchSchedule(len(self.train_data), micro, self.data_world, self.data_rank, cfg.seed)
        self.val_schedule = self._validation_schedule(micro)
        self.detector = SpikeDetector(cfg.guardrails)
        self.ckpt_root = out_dir / "checkpoints"
        self.step, self.tokens, self.lr_scale, self.grad_norm = 0, 0, 1.0, float("nan")
        # survives checkpoints, so a run resumed at its last step still reports its figures
        self.progress: dict[str, Any] = {"last_val": None, "tps_sum": 0.0, "tps_count": 0, "wall_s": 0.0}
        self.anomalies: list[dict[str, Any]] = []
        self.params = 0
        self.float8_layers: list[str] = []  # the linear layers torchao trains in float8 (pretrain.float8)
        experts = cfg.model.experts
        self.router = (  # a mixture of experts: its routing, watched (training/router.py)
            RouterStats(experts.top_k, cfg.guardrails.router_collapse_share, cfg.guardrails.router_collapse_steps)
            if experts.enabled
            else None
        )
        self.router_values: dict[str, float] = {}
        self.pipeline: Any = None  # the pipeline schedule (pretrain.distributed.pipeline_parallel > 1)
        self._pipeline_starts: list[int] = []  # the micro-batches the schedule is running (the NaN test hook)
        self._pipeline_micro = 0
        self.mem_before_engine_mb = memory_mb()  # the baseline the planner's per-rank figures add to
        self.engine = self._build_engine()
        self.flops_per_token = flops_per_token(self.params, cfg.model, cfg.seq_len, self.vocab_size)
        self.peak_flops = (peak_tflops or 0.0) * 1e12
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )

    def _validation_schedule(self, micro: int) -> BatchSchedule | None:
        """A small validation split is still used: fewer windows per rank rather than none."""
        windows = len(self.val_data)
        if windows < self.data_world:
            log.warning(
                "validation split has %d window(s) of %d tokens, fewer than the %d data-parallel ranks: "
                "no validation loss",
                windows,
                self.cfg.seq_len,
                self.data_world,
            )
            return None
        return BatchSchedule(
            windows, min(micro, windows // self.data_world), self.data_world, self.data_rank, self.cfg.seed + 1
        )

    # -- engine ----------------------------------------------------------------------------

    def _build_engine(self) -> Any:
        if self.base_dir is not None:
            model = load_base(self.base_dir, self.rope, self.cfg.seq_len)
        else:
            model = build_model(self.cfg.model, self.vocab_size, self.cfg.seq_len, self.special, self.cfg.seed)
        if self.plan.float8 != "off":
            # before checkpointing, compile and the engine wrap the layers: they then see Float8Linear
            # (an nn.Linear with the same parameters) where nn.Linear was
            first = not self.float8_layers
            self.float8_layers = float8.convert(model, self.plan.float8)
            if first and self.rank == 0:
                log.info(
                    "float8 (%s): %d linear layers converted by torchao (%s, ...); the output projection and "
                    "embeddings stay in %s",
                    self.plan.float8,
                    len(self.float8_layers),
                    ", ".join(self.float8_layers[:3]),
                    self.plan.precision,
                )
        self.params = sum(p.numel() for p in model.parameters())  # whole, before any of it is split
        if self.plan.degrees:  # tensor parallel first, then checkpointing, compile and the engine's sharding
            whole = mesh.get(self.plan)
            for dim in all_dimensions():  # pipeline stages first: the other dimensions split a stage
                if dim.name in self.plan.degrees:
                    model = dim.apply(model, whole[dim.name], self.plan)
        if self.cfg.distributed.activation_checkpointing:
            # recompute each decoder layer in backward instead of keeping its activations
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.plan.compile:
            from training.parallel.engines.fsdp2 import decoder_layers

            # per block: one graph reused by every layer compiles far faster than the whole model,
            # and the engine's hooks stay outside the compiled regions
            for layer in decoder_layers(model):
                layer.compile()
        built = engine(self.plan.backend).build(model, self.cfg, self.plan)
        self._apply_lr_scale(built)
        if "pp" in self.plan.degrees:  # rebuilt with the engine (a rollback): the stage it drives is new
            from training.parallel.dims import pipeline

            self.pipeline = pipeline.schedule(
                built.module,
                mesh.get(self.plan)["pp"],
                self.plan.grad_accum,
                self._pipeline_loss,
                self.cfg.distributed.pipeline_schedule,
            )
        return built

    def _apply_lr_scale(self, engine: Any) -> None:
        """Scale the schedule's peak LR, and the LR of the very next step (loaded from the checkpoint)."""
        scheduler = engine.lr_scheduler
        if scheduler is not None and hasattr(scheduler, "org_lrs"):
            scheduler.org_lrs = [self.cfg.optim.lr * self.lr_scale for _ in scheduler.org_lrs]
            if scheduler.last_batch_iteration >= 0:
                for group, lr in zip(engine.optimizer.param_groups, scheduler.get_lr()):
                    group["lr"] = lr

    def _barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def _mean_over_ranks(self, value: Any) -> float:
        import torch.distributed as dist

        if hasattr(value, "full_tensor"):  # a loss computed from split logits (loss parallel): replicated
            value = value.full_tensor()
        tensor = value.detach().float().reshape(1).clone()
        dist.all_reduce(tensor)
        return float(tensor.item()) / self.world

    # -- state -----------------------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "lr_scale": self.lr_scale,
            "detector": self.detector.state_dict(),
            "anomalies": self.anomalies,
            "layout": {
                "world_size": self.world,
                "zero_stage": self.plan.zero_stage,
                "backend": self.plan.backend,
                "mesh": mesh.shape(self.plan),
            },
            "progress": self.progress,
        }

    def save_checkpoint(self) -> Path:
        rank_state = {"rng": checkpoint.rng_state(), "schedule": self.schedule.state_dict()}
        path = checkpoint.save(
            self.engine,
            self.ckpt_root,
            self.step,
            self.trainer_state(),
            rank_state,
            self.rank,
            self.cfg.checkpoint.keep_last,
            self._barrier,
            extra_files={METRICS_FILE: self.out_dir / METRICS_FILE},
        )
        log.info("checkpoint step %d saved and verified: %s", self.step, path)
        return path

    def restore(self, directory: Path, after_anomaly: bool = False) -> None:
        self._check_layout(directory)
        trainer, own = checkpoint.load(self.engine, directory, self.rank)
        skipped = list(self.schedule.skipped)
        self.step, self.tokens = trainer["step"], trainer["tokens"]
        self.detector.load_state_dict(trainer["detector"], keep_anomaly_count=after_anomaly)
        self.schedule.load_state_dict(own["schedule"])
        checkpoint.set_rng_state(own["rng"])
        if after_anomaly:
            self.schedule.skipped += [r for r in skipped if r not in self.schedule.skipped]
        else:
            self.lr_scale = trainer["lr_scale"]
            self.anomalies = trainer["anomalies"]
            self.progress = trainer.get("progress", self.progress)
        self._apply_lr_scale(self.engine)

    def _check_layout(self, directory: Path) -> None:
        """A checkpoint resumes only into the engine that wrote it, and only where that engine can
        reload its layout (ZeRO: the same stage and world size; FSDP2's DCP reshards to any mesh)."""
        from lmforge.errors import ConfigError

        saved = checkpoint.read_trainer_state(directory).get("layout", {})
        backend = saved.get("backend", self.plan.backend)
        if backend != self.plan.backend:
            raise ConfigError(
                f"{directory.name} was written by {backend}; this run uses {self.plan.backend}. Set "
                f"pretrain.distributed.backend={backend}, or pretrain.resume=never to start over"
            )
        problem = engine(backend).resume_problem(saved, self.plan, self.world)
        if problem:
            raise ConfigError(f"{directory.name} was {problem}, or pretrain.resume=never to start over")

    # -- one step --------------------------------------------------------------------------

    def micro_loss(self, windows: list[int], data: TokenWindows, train: bool = True) -> Any:
        """The LM loss of `windows`; in training a mixture of experts adds its load-balancing loss and
        counts its routing (validation reports the LM loss alone, comparable with a dense model's)."""
        import torch

        batch = torch.from_numpy(data.batch(windows)).to(self.device)
        inputs: dict[str, Any] = {"input_ids": batch[:, :-1]}
        if self.document_mask:
            # no cache: transformers reads packed sequences from position ids only without one
            inputs.update(position_ids=torch.from_numpy(data.positions(windows)).to(self.device), use_cache=False)
        if self.router is None or not train:
            logits = self.engine(**inputs).logits
            with self.loss_context():
                return token_loss(logits, batch[:, 1:])
        out = self.engine(**inputs, output_router_logits=True)
        with self.loss_context():
            loss = token_loss(out.logits, batch[:, 1:])
        self.router.add(out.router_logits, out.aux_loss)
        return loss + self.cfg.model.experts.router_aux_loss_coef * out.aux_loss

    def loss_context(self) -> Any:
        """Where the loss and its backward run: loss parallel under tensor parallelism (split logits)."""
        import contextlib

        stack = contextlib.ExitStack()
        for dim in all_dimensions():
            if dim.name in self.plan.degrees and dim.loss_context is not None:
                stack.enter_context(dim.loss_context())
        return stack

    # -- pipeline parallel: the schedule runs every micro-batch's forward and backward in one call --

    def _pipeline_loss(self, logits: Any, target: Any) -> Any:
        """The last stage's loss of one micro-batch (the schedule divides the gradients by the number of
        micro-batches itself, `scale_grads`, as the engine's backward does)."""
        loss = token_loss(logits, target)
        micro, self._pipeline_micro = self._pipeline_micro, self._pipeline_micro + 1
        if (
            micro < len(self._pipeline_starts)
            and self.schedule.index_of(self._pipeline_starts[micro]) in self.nan_at_batches
        ):
            loss = loss * float("nan")  # test hook: a batch that produces NaN
        return loss

    def _stages(self) -> tuple[Any, int, int]:
        """(the pipeline's sub-mesh, this rank's stage, the last stage)."""
        stages = mesh.get(self.plan)["pp"]
        return stages, stages.get_local_rank(), stages.size() - 1

    def _pipeline_run(self, batch: Any, starts: list[int], train: bool) -> list[float]:
        """Run the schedule on this data rank's micro-batches; every rank gets the per-micro-batch losses
        (the last stage's, broadcast over the pipeline, then averaged over the data-parallel ranks)."""
        import torch
        import torch.distributed as dist

        stages, stage, last = self._stages()
        self._pipeline_starts, self._pipeline_micro = starts, 0
        losses: list[Any] = []
        run = self.pipeline.step if train else self.pipeline.eval
        args = (batch[:, :-1],) if stage == 0 else ()
        kwargs = {"target": batch[:, 1:], "losses": losses} if stage == last else {}
        with self.loss_context():  # the last stage's loss and its backward run inside the schedule
            run(*args, **kwargs)
        values = torch.zeros(self.plan.grad_accum, dtype=torch.float64, device=self.device)
        if stage == last:
            values = torch.stack([_whole(loss).detach().double() for loss in losses])
        dist.broadcast(values, src=dist.get_global_rank(stages.get_group(), last), group=stages.get_group())
        # every rank now holds its data rank's values, each data rank's (world / data ranks) times over
        dist.all_reduce(values)
        return [float(v) / self.world for v in values]

    def _pipeline_step(self) -> Anomaly | float:
        import torch

        starts, windows = [], []
        for _ in range(self.plan.grad_accum):
            start, own = self.schedule.next()
            starts.append(start)
            windows += own
        batch = torch.from_numpy(self.train_data.batch(windows)).to(self.device)
        losses = self._pipeline_run(batch, starts, train=True)
        step_loss = sum(losses) / len(losses)
        bad = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
        anomaly = None
        if bad is not None:
            anomaly = Anomaly("non_finite", self.step + 1, [starts[bad]], losses[bad], self._window_mean())
        elif self.detector.judge(step_loss) == "spike":
            anomaly = Anomaly("spike", self.step + 1, starts, step_loss, self._window_mean())
        if anomaly is not None:  # the backward already ran: its gradients are dropped, not applied
            self.engine.optimizer.zero_grad(set_to_none=True)
            return anomaly
        skipped = self.engine.skipped_steps
        self.engine.micro = self.plan.grad_accum  # the schedule ran every micro-batch's backward
        self.engine.step()
        if self.engine.skipped_steps > skipped:
            return Anomaly("non_finite_grad", self.step + 1, starts, step_loss, self._window_mean())
        self.grad_norm = _float(self.engine.get_global_grad_norm())
        self.detector.accept(step_loss)
        self.step += 1
        self.tokens += self.cfg.global_batch_size * self.cfg.seq_len
        return step_loss

    def forward_logits(self, batch: Any) -> Any:
        """The whole model's logits of `batch` on rank 0 (the parity check's reference)."""
        if "pp" not in self.plan.degrees:
            return self.engine(input_ids=batch).logits
        import torch
        import torch.distributed as dist

        stages, stage, last = self._stages()
        self._pipeline_starts, self._pipeline_micro = [], 0
        with self.loss_context():
            if stage == 0:
                out = self.pipeline.eval(batch)
            elif stage == last:  # the schedule computes its loss on the last stage: targets it ignores here
                target = torch.zeros(batch.shape, dtype=torch.long, device=self.device)
                out = self.pipeline.eval(target=target, losses=[])
            else:
                out = self.pipeline.eval()
        shape = (batch.shape[0], batch.shape[1], self.vocab_size)
        logits = _whole(out).float() if stage == last else torch.zeros(shape, device=self.device)
        dist.broadcast(logits, src=dist.get_global_rank(stages.get_group(), last), group=stages.get_group())
        return logits

    def train_step(self) -> Anomaly | float:
        """Run one optimizer step; return its loss, or the anomaly that stopped it."""
        if "pp" in self.plan.degrees:
            return self._pipeline_step()
        if self.router is not None:
            self.router.discard()  # what a rolled-back step counted
        losses: list[float] = []
        indices: list[int] = []
        for micro in range(self.plan.grad_accum):
            start, windows = self.schedule.next()
            indices.append(start)
            loss = self.micro_loss(windows, self.train_data)
            if self.schedule.index_of(start) in self.nan_at_batches:
                loss = loss * float("nan")  # test hook: a batch that produces NaN
            losses.append(self._mean_over_ranks(loss))
            if not math.isfinite(losses[-1]):
                return Anomaly("non_finite", self.step + 1, [start], losses[-1], self._window_mean())
            if micro == self.plan.grad_accum - 1:
                step_loss = sum(losses) / len(losses)
                if self.detector.judge(step_loss) == "spike":
                    return Anomaly("spike", self.step + 1, indices, step_loss, self._window_mean())
            if self.schedule.index_of(start) in self.nan_grad_at_batches:
                loss = _poison_gradient(loss)  # test hook: a finite loss whose gradients are NaN
            with self.loss_context():
                self.engine.backward(loss)
            last = micro == self.plan.grad_accum - 1
            if last and engine(self.plan.backend).norm_unreported(self.plan):
                self.grad_norm = self._replicated_grad_norm()
                if not math.isfinite(self.grad_norm):  # DeepSpeed would apply it (fp32) or skip it (bf16) silently
                    return Anomaly("non_finite_grad", self.step + 1, indices, sum(losses) / len(losses),
                                   self._window_mean())  # fmt: skip
            skipped = getattr(self.engine, "skipped_steps", 0)
            self.engine.step()
        if self.plan.zero_stage > 0:
            self.grad_norm = _float(self.engine.get_global_grad_norm())
        step_loss = sum(losses) / len(losses)
        # A finite loss with non-finite gradients: DeepSpeed skips such a step without failing and
        # FSDP2's engine skips it too, so a run whose every backward is broken (a bad attention
        # kernel, or data that overflows bf16 gradients: docs/how-to/gpus.md) would "train" without learning.
        # It is an anomaly like a NaN loss: rolled back, batches skipped, stopped when it repeats.
        if getattr(self.engine, "skipped_steps", 0) > skipped:
            return Anomaly("non_finite_grad", self.step + 1, indices, step_loss, self._window_mean())
        self.detector.accept(step_loss)
        self.step += 1
        self.tokens += self.cfg.global_batch_size * self.cfg.seq_len
        if self.router is not None:
            self._close_router_step(step_loss)
        return step_loss

    def _close_router_step(self, step_loss: float) -> None:
        """The step's routing over every rank: its curves for `_log_step`, a collapsed expert a finding."""
        import torch.distributed as dist

        def summed(tensor: Any) -> Any:
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor)
            return tensor.cpu()

        assert self.router is not None
        self.router_values, collapsed = self.router.close_step(summed)
        for finding in collapsed:
            g = self.cfg.guardrails
            action = (
                f"recorded: expert {finding['expert']} of layer {finding['layer']} received under "
                f"{g.router_collapse_share:.0%} of its tokens for {g.router_collapse_steps} steps in a row "
                f"({finding['share']:.2%} in the last)"
            )
            log.warning("step %d: collapsed router: %s", self.step, action)
            self.anomalies.append(
                {
                    "step": self.step,
                    "kind": "router_collapse",
                    "loss": step_loss,
                    "window_mean": self._window_mean(),
                    "loss_after": None,
                    "grad_norm_before": self.grad_norm,
                    "micro_batches": [],
                    "window_positions": [],
                    "samples": [],
                    "action": action,
                    "consecutive": 0,
                    **finding,
                }
            )
            self.write_anomalies()

    def _replicated_grad_norm(self) -> float:
        """Pre-clipping gradient norm under ZeRO-0, where DeepSpeed clips without reporting it.

        Gradients are already averaged over ranks at the accumulation boundary, so the local
        norm is the global one.
        """
        import torch

        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else float("nan")

    def _window_mean(self) -> float | None:
        history = list(self.detector.history)
        return sum(history) / len(history) if history else None

    def handle_anomaly(self, anomaly: Anomaly) -> None:
        """Record, roll back to the last verified checkpoint, skip the batches, maybe lower the LR."""
        count = self.detector.record_anomaly(anomaly.step)
        latest = checkpoint.latest_verified(self.ckpt_root) if self.rank == 0 else None
        latest = self._broadcast(latest)
        stopping = count >= self.cfg.guardrails.max_consecutive_spikes
        action = (
            f"stopped: {count} anomalies in a row"
            if stopping
            else f"rolled back to {latest.name if latest else 'initialisation'}, skipped "
            f"{len(anomaly.batches)} micro-batch(es), lr x{self.cfg.guardrails.lr_scale_on_spike}"
        )
        record = {
            "step": anomaly.step,
            "kind": anomaly.kind,
            "loss": anomaly.loss,
            "window_mean": anomaly.window_mean,
            "loss_after": None,
            "grad_norm_before": self.grad_norm,
            "micro_batches": [self.schedule.index_of(b) for b in anomaly.batches],
            "window_positions": anomaly.batches,
            "samples": self._describe(anomaly.batches),
            "action": action,
            "consecutive": count,
        }
        self.anomalies.append(record)
        self.write_anomalies()  # before a possible stop: the report matters most when the run diverges
        log.warning(
            "step %d: %s loss %.4g (recent mean %s); %s",
            anomaly.step,
            anomaly.kind,
            anomaly.loss,
            f"{anomaly.window_mean:.4g}" if anomaly.window_mean else "n/a",
            record["action"],
        )
        if stopping:
            hint = (
                " (a finite loss with non-finite gradients: a kernel, not the data; README Troubleshooting)"
                if anomaly.kind == "non_finite_grad"
                else ""
            )
            raise TrainingDiverged(
                f"{count} anomalies in a row (last at step {anomaly.step}: {anomaly.kind}{hint}); "
                f"stopping; report: {self.anomalies_path}"
            )
        for start in anomaly.batches:
            self.schedule.skip(start)
        self.lr_scale *= self.cfg.guardrails.lr_scale_on_spike
        del self.engine
        self.engine = self._build_engine()
        if latest is None:
            raise TrainingDiverged("anomaly before the first checkpoint was written")
        self.restore(latest, after_anomaly=True)

    @property
    def anomalies_path(self) -> Path:
        return self.out_dir / "anomalies.json"

    def write_anomalies(self) -> None:
        if self.rank == 0:
            atomic_write_json(self.anomalies_path, self.anomalies)

    def note_loss_after(self, loss: float) -> None:
        """The loss of a step that was rolled back, once it has been replayed without the skipped batches."""
        changed = False
        for record in self.anomalies:
            if record["step"] == self.step and record.get("loss_after") is None:
                record["loss_after"] = loss
                changed = True
        if changed:
            self.write_anomalies()

    def _broadcast(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _describe(self, starts: list[int]) -> list[dict[str, Any]]:
        """Every window of the given global micro-batches, on all ranks, with shard and document ids."""
        return [
            self.train_data.describe(window)
            for start in starts
            for rank in range(self.world)
            for window in self.schedule.windows(start, rank)
        ]

    # -- evaluation ------------------------------------------------------------------------

    def evaluate(self) -> float | None:
        import torch

        if self.val_schedule is None:
            return None
        self.engine.eval()
        total = 0.0
        with torch.no_grad():
            if "pp" in self.plan.degrees:  # the schedule's micro-batches: eval_batches rounded up to them
                ga = self.plan.grad_accum
                rounds = -(-self.cfg.eval_batches // ga)
                for index in range(rounds):
                    starts = [(index * ga + i) * self.val_schedule.span for i in range(ga)]
                    windows = [w for start in starts for w in self.val_schedule.windows(start)]
                    batch = torch.from_numpy(self.val_data.batch(windows)).to(self.device)
                    total += sum(self._pipeline_run(batch, [], train=False))
                self.engine.train()
                return total / (rounds * ga)
            for index in range(self.cfg.eval_batches):
                windows = self.val_schedule.windows(index * self.val_schedule.span)
                total += self._mean_over_ranks(self.micro_loss(windows, self.val_data, train=False))
        self.engine.train()
        return total / self.cfg.eval_batches

    # -- the run ---------------------------------------------------------------------------

    def _find_resume_point(self) -> Path | None:
        """Rank 0 verifies the checkpoints once; every rank gets its verdict (or the same error)."""
        verdict: Path | str | None = None
        if self.rank == 0:
            verdict = checkpoint.latest_verified(self.ckpt_root)
            existing = self.ckpt_root.exists() and any(
                p.name.startswith(("step-", ".corrupt-")) for p in self.ckpt_root.iterdir()
            )
            metrics = self.out_dir / METRICS_FILE
            if verdict is None and existing:
                verdict = (
                    f"{self.ckpt_root}: checkpoints exist but none verifies; refusing to restart from "
                    "step 0 over earlier progress (set pretrain.resume=never to start over)"
                )
            elif verdict is None and metrics.exists() and metrics.stat().st_size:
                verdict = (
                    f"{self.out_dir}: {METRICS_FILE} records training progress but no checkpoint is left; "
                    "refusing to restart from step 0 over it (set pretrain.resume=never to start over)"
                )
        verdict = self._broadcast(verdict)
        if isinstance(verdict, str):
            raise DeterministicError(verdict)
        return verdict

    def run(self) -> dict[str, Any]:
        resume = self._find_resume_point()
        if resume is not None:
            self.restore(resume)
            log.info("resumed from %s (step %d)", resume.name, self.step)
        else:
            if self.base_dir is not None:  # where continued pretraining starts from
                self.progress["base_val_loss"] = self.evaluate()
            self.save_checkpoint()
        metrics = MetricsWriter(
            self.out_dir,
            self.step,
            enabled=self.rank == 0,
            history=resume / METRICS_FILE if resume is not None else None,
        )
        started_step = self.step
        while self.step < self.cfg.max_steps:
            t0 = time.perf_counter()
            outcome = self.train_step()
            if isinstance(outcome, Anomaly):
                self.handle_anomaly(outcome)
                metrics.rewind(self.step)
                continue
            seconds = time.perf_counter() - t0
            self.progress["wall_s"] += seconds
            tokens_per_s = self.cfg.global_batch_size * self.cfg.seq_len / seconds
            if self.step == started_step + 1:  # includes torch.compile's compilation when it is on
                self.progress["first_step_s"] = round(seconds, 3)
            if self.step > started_step + 2:  # the first steps of a process include warm-up
                self.progress["tps_sum"] += tokens_per_s
                self.progress["tps_count"] += 1
            self._log_step(metrics, outcome, tokens_per_s)
            self.note_loss_after(outcome)
            if self.step % self.cfg.checkpoint.every_steps == 0 or self.step == self.cfg.max_steps:
                self.save_checkpoint()
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
        metrics.close()
        count = self.progress["tps_count"]
        mean_tps = self.progress["tps_sum"] / count if count else None
        first = self.progress.get("first_step_s")
        steady = self.cfg.global_batch_size * self.cfg.seq_len / mean_tps if mean_tps else None
        return {
            "first_step_s": first,
            # what the first step cost beyond a steady one: compilation, when compile is on
            "compile_s": round(first - steady, 3) if self.plan.compile and first and steady else None,
            "final_step": self.step,
            "tokens": self.tokens,
            "final_val_loss": self.progress["last_val"],
            "base_val_loss": self.progress.get("base_val_loss"),
            "tokens_per_s": mean_tps,
            "train_seconds": round(self.progress["wall_s"], 2),
            "mfu": self.flops_per_token * mean_tps / self.peak_flops if mean_tps and self.peak_flops else None,
            "params": self.params,
            "float8": self.plan.float8,
            "float8_layers": self.float8_layers,
            "anomalies": len(self.anomalies),
            **self._router_summary(),
            # every token of both splits is in some window except these (the end of each stream)
            "train_windows": len(self.train_data),
            "val_windows": len(self.val_data),
            "dropped_tokens_train": self.train_data.dropped_tokens,
            "dropped_tokens_val": self.val_data.dropped_tokens,
            "mem_before_engine_mb": round(self.mem_before_engine_mb, 1),
            "mem_peak_mb": round(peak_memory_mb(), 1),
        }

    def _router_summary(self) -> dict[str, Any]:
        """A mixture of experts' routing over the run: each layer's share per expert and the smallest."""
        if self.router is None:
            return {}
        shares = self.router.shares()
        return {
            "expert_shares": [[round(v, 4) for v in row] for row in shares],
            "expert_share_min": min((v for row in shares for v in row), default=None),
            "router_aux_loss": self.router_values.get("router_aux_loss"),
        }

    def _log_step(self, metrics: MetricsWriter, loss: float, tokens_per_s: float) -> None:
        values = {
            "loss": loss,
            "lr": _float(self.engine.get_lr()[0]),
            "tokens_per_s": tokens_per_s,
            "grad_norm": self.grad_norm,
            "mem_mb": memory_mb(),
            "tokens": self.tokens,
        }
        if self.peak_flops:
            values["mfu"] = self.flops_per_token * tokens_per_s / self.peak_flops
        values.update(self.router_values)  # a mixture of experts: each expert's share of its layer's tokens
        if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.max_steps:
            val = self.evaluate()
            if val is not None:
                self.progress["last_val"] = val
                values.update({"val_loss": val, "val_ppl": math.exp(min(val, 50))})
        metrics.log(self.step, values)
        if self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps:
            log.info(
                "step %d/%d loss %.4f%s lr %.2e %.0f tok/s%s",
                self.step,
                self.cfg.max_steps,
                loss,
                f" val {values['val_loss']:.4f}" if "val_loss" in values else "",
                values["lr"],
                tokens_per_s,
                f" mfu {values['mfu']:.2%}" if "mfu" in values else "",
            )


def _whole(value: Any) -> Any:
    """A tensor whole on this rank: a DTensor (split logits, a loss-parallel loss) gathered."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _poison_gradient(loss: Any) -> Any:
    """`loss` unchanged in the forward pass, with NaN gradients in the backward one (debug.pretrain)."""
    import torch

    class PoisonGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad * float("nan")

    return PoisonGradient.apply(loss)


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")

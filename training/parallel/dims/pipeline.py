"""Pipeline parallelism with `torch.distributed.pipelining`: the decoder's layers split into
consecutive stages, one per pipeline rank, micro-batches flowing through them (GPipe or 1F1B).

Each stage is a `StageModule` that keeps the parameter names of the whole model
(`model.embed_tokens`, `model.layers.<i>`, `model.norm`, `lm_head`): a stage's state dict is a
slice of the full one, so DCP checkpoints move between pipeline and non-pipeline layouts, and
the export merges the stages' slices without renaming. The first stage embeds, the last
normalizes and projects; every stage recomputes the rotary embedding for its positions.

Hand-written because no maintained library splits a Hugging Face decoder into stages that keep
its names: torchtitan prunes its own model (whose forward tolerates missing modules), and
`torch.distributed.pipelining.pipeline` traces the model into a graph, which renames the
parameters and does not trace Hugging Face's masking code.

A tied output head (`tie_word_embeddings`) would need its gradient summed across the first and
last stage; that is refused in one line instead.

With tensor parallelism (applied to each stage after it is cut) the residual stream leaves a stage
split along the sequence (sequence parallelism): each tensor-parallel rank sends its own slice to
the same rank of the next stage, and the stage computes the rotary positions of the whole sequence.
"""

from __future__ import annotations

from typing import Any

from training.parallel import Dimension, moe_problem

SCHEDULES = ("gpipe", "1f1b")


def bounds(num_layers: int, stage: int, stages: int) -> tuple[int, int]:
    """The layers [lo, hi) of `stage`: as even as possible, earlier stages one more where uneven
    (the last stage also holds the norm, the head and the loss)."""
    base, extra = divmod(num_layers, stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


def stage_module(model: Any, stage: int, stages: int) -> Any:
    import torch
    from torch import nn

    class StageModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            inner = model.model
            self.config = model.config
            self.first, self.last = stage == 0, stage == stages - 1
            # under sequence parallelism a later stage receives its rank's slice of the sequence
            self.sequence_split = 1
            self.model: Any = nn.Module()  # named as the whole model: model.embed_tokens, model.layers.<i>, ...
            if self.first:
                self.model.embed_tokens = inner.embed_tokens
            lo, hi = bounds(len(inner.layers), stage, stages)
            self.model.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})
            self.model.rotary_emb = inner.rotary_emb  # buffers only (inv_freq): nothing in the state dict
            if self.last:
                self.model.norm = inner.norm
                self.lm_head: Any = model.lm_head

        def forward(self, hidden: Any) -> Any:
            if self.first:
                hidden = self.model.embed_tokens(hidden)
            length = hidden.shape[1] * (1 if self.first else self.sequence_split)
            positions = torch.arange(length, device=hidden.device).unsqueeze(0)
            rotary = self.model.rotary_emb(hidden, position_ids=positions)
            for layer in self.model.layers.values():
                # no mask: SDPA's causal path, as the whole model takes it for unpadded windows
                hidden = layer(hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)
            if self.last:
                hidden = self.lm_head(self.model.norm(hidden))
            return hidden

    return StageModule()


def apply(model: Any, pp_mesh: Any, run_plan: Any) -> Any:
    """This rank's stage of the model (the engine wraps it; the loop drives it with `schedule`)."""
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            "pipeline parallelism needs untied embeddings (the head and the embedding sit on different "
            "stages); set pretrain.model.tie_embeddings=false, or pipeline_parallel=1"
        )
    return stage_module(model, pp_mesh.get_local_rank(), pp_mesh.size())


def schedule(stage: Any, pp_mesh: Any, micro_batches: int, loss_fn: Any, kind: str) -> Any:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    device = next(stage.parameters()).device if any(True for _ in stage.parameters()) else torch.device("cpu")
    pipe = PipelineStage(stage, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group())
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
    return cls(pipe, n_microbatches=micro_batches, loss_fn=loss_fn)


def shape_problem(shape: dict[str, Any], degree: int) -> str | None:
    if degree > 1 and (shape.get("experts") or {}).get("num"):
        return moe_problem("pipeline_parallel", degree)
    if shape["num_layers"] < degree:
        return f"pipeline_parallel {degree} exceeds num_layers {shape['num_layers']} (a stage needs a layer)"
    if shape.get("tie_embeddings"):
        return f"pipeline_parallel {degree} needs tie_embeddings false (the embedding and head sit on different stages)"
    return None


def in_flight(degree: int, micro_batches: int, schedule_name: str) -> int:
    """Micro-batches whose activations the first stage holds at once: GPipe all of them (every forward
    before any backward), 1F1B at most one per stage."""
    return micro_batches if schedule_name == "gpipe" else min(degree, micro_batches)


def memory_factors(degree: int, micro_batches: int, cfg: Any) -> dict[str, float]:
    """A stage holds 1/degree of the layers' activations, for every micro-batch in flight."""
    return {"activations": in_flight(degree, micro_batches, cfg.distributed.pipeline_schedule) / degree}


def step_problem(degree: int, micro_batches: int, cfg: Any) -> str | None:
    if cfg.distributed.pipeline_schedule == "1f1b" and micro_batches < degree:
        return (
            f"pipeline_parallel {degree} with 1F1B needs at least {degree} micro-batches per step "
            f"(global batch / (micro-batch x data-parallel ranks) = {micro_batches})"
        )
    return None


DIMENSION = Dimension(
    name="pp",
    field="pipeline_parallel",
    title="pipeline parallel",
    apply=apply,
    shape_problem=shape_problem,
    divides=("weights", "gradients", "optimizer", "optimizer_step", "gathered"),
    traffic_note=lambda degree: f"one activation send per micro-batch between {degree} stages",
    outer=True,
    memory_factors=memory_factors,
    step_problem=step_problem,
)

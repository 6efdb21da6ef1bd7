"""Typed configuration of the quantization stage (`quantize:` in a preset).

What the checkpoint is (model, scheme, group size, calibration samples, the quantizer's
settings) is cache identity of each scheme's step; the gate's limits are identity of the gate.
Where the quantizer's environment lives is not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.configbase import StrictModel, runtime_field
from lmforge.engine.registry import check_roles
from serving.quantize.schemes import SCHEMES

NOT_SIGNIFICANTLY_WORSE = "not_significantly_worse"
# the registry's schemes (one module each in serving/quantize/schemes/), spelled for pydantic and the reference
if TYPE_CHECKING:
    SchemeName = str
else:
    SchemeName = Literal[tuple(SCHEMES)]
MaxDrop = float | dict[str, float | Literal["not_significantly_worse"]]


def _default_max_drop() -> MaxDrop:
    return {"*": 0.05}


class CalibrationConfig(StrictModel):
    """Calibration samples drawn from the lineage: curated pretraining documents and SFT chats."""

    enabled: bool = Field(
        True,
        description="Calibrated schemes (SmoothQuant + GPTQ via llmcompressor); "
        "false: round-to-nearest with compressed-tensors, no data.",
    )
    num_samples: int = Field(64, ge=1, description="Calibration samples (the seeds: a few hundred on real models).")
    sft_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Share drawn from the SFT data (chat-formatted) "
        "when the model is a chat model; the rest are documents.",
    )
    max_seq_len: int = Field(256, ge=16, description="Tokens per sample at most.")
    max_chars: int = Field(4000, ge=100, description="Characters kept of each document before tokenizing.")
    seed: int = 0
    smoothing_strength: float = Field(0.8, gt=0, lt=1, description="SmoothQuant's alpha (W8A8 only).")
    dampening_frac: float = Field(0.01, gt=0, lt=1, description="GPTQ's Hessian dampening.")


class GateConfig(StrictModel):
    """When a quantized checkpoint may ship: its evaluation against the unquantized model's, both on vLLM."""

    enabled: bool = Field(
        True, description="Evaluate every checkpoint and gate it (false: all are eligible, unmeasured)."
    )
    tasks: list[str] | None = Field(None, description="Evaluation tasks the gate runs (default: evaluate.tasks).")
    max_drop: MaxDrop = Field(
        default_factory=_default_max_drop,
        description="Largest allowed drop of a higher-is-better metric (absolute), one number for all or "
        "{metric: limit} ('*' for the rest); 'not_significantly_worse' instead fails a metric whose "
        "paired bootstrap interval lies wholly below zero.",
    )
    max_perplexity_ratio: float = Field(
        1.1, ge=1, description="Largest allowed quantized/unquantized perplexity ratio."
    )

    choose: Literal["smallest", "fastest"] = Field(
        "smallest",
        description="Which eligible checkpoint ships: smallest (bytes on disk) or fastest (vLLM output tokens/s, "
        "measured when speed_requests > 0).",
    )
    speed_requests: int = Field(
        0,
        ge=0,
        description="Streaming completions (32 tokens, 4 clients) that measure each servable checkpoint's and the "
        "unquantized model's vLLM output tokens/s for the report (0: not measured; choose=fastest needs it).",
    )

    @model_validator(mode="after")
    def _speed_for_fastest(self) -> GateConfig:
        if self.choose == "fastest" and not self.speed_requests:
            raise ValueError("choose=fastest needs speed_requests > 0 (the gate measures tokens/s only then)")
        return self

    @field_validator("max_drop")
    @classmethod
    def _non_negative(cls, value: float | dict[str, float | str]) -> float | dict[str, float | str]:
        values = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, (int, float)) and v < 0 for v in values):
            raise ValueError("max_drop limits must be >= 0")
        return value

    def limit(self, metric: str) -> float | str | None:
        if not isinstance(self.max_drop, dict):
            return self.max_drop
        return self.max_drop.get(metric, self.max_drop.get("*"))


GgufType = Literal["Q8_0", "Q4_K_M", "Q5_K_M", "Q4_0"]


def _default_gguf_types() -> list[GgufType]:
    return ["Q8_0", "Q4_K_M"]


class GgufConfig(StrictModel):
    """GGUF files for llama.cpp (`quantize/gguf`, serving/quantize/gguf.py): converted and quantized by llama.cpp,
    gated in llama.cpp against the bf16 conversion with `quantize.gate`'s limits."""

    enabled: bool = runtime_field(
        False,
        description="Write and gate GGUF files (needs the llama.cpp environment: LMFORGE_LLAMACPP_ENV=1 "
        "bash scripts/setup.sh); serve.engine.name: llamacpp serves the one that ships.",
    )
    types: list[GgufType] = Field(
        default_factory=_default_gguf_types,
        description="llama.cpp quantization types; the smallest that passes the gate ships (else the bf16 file).",
    )
    max_documents: int = Field(64, ge=1, description="Held-out documents (the evaluation stage's) for perplexity.")
    max_items: int = Field(200, ge=1, description="Held-out verifiable items (the evaluation stage's) for exact match.")
    max_conversion_drift: float = Field(
        0.02,
        ge=0,
        description="Largest relative difference between the bf16 file's held-out perplexity in llama.cpp and the "
        "model's in transformers: beyond it the conversion is wrong and nothing ships.",
    )
    python: str | None = runtime_field(
        None, description="Python of the llama.cpp environment; default: .venv-llamacpp/bin/python beside the project."
    )

    @field_validator("types")
    @classmethod
    def _once(cls, value: list[GgufType]) -> list[GgufType]:
        if len(set(value)) != len(value):
            raise ValueError(f"quantize.gguf.types {value} lists one twice")
        return value


class QuantizeFaultConfig(StrictModel):
    """Test hooks that make failures reproducible (`debug.quantize:`; never in a normal run's key)."""

    break_scale_factor: float | None = Field(
        None,
        gt=0,
        description="Multiply every quantized projection's weight scales by this after quantizing (a broken checkpoint).",
    )


class QuantizeConfig(StrictModel):
    enabled: bool = runtime_field(True, description="Run this stage in `lmforge run`.")
    model: str = Field(
        "auto",
        description="The model to quantize. auto: RL, else DPO, else SFT, else the pretrained model, else the base.",
    )

    @field_validator("model")
    @classmethod
    def _known_model(cls, model: str) -> str:
        """auto, or a model role of the lineage (lmforge.engine.registry.roles)."""
        return model if model in ("auto",) else check_roles([model])[0]

    # which scheme steps run (like `stages`); the gate's key follows them through its upstream
    schemes: list[SchemeName] = runtime_field(
        default_factory=lambda: ["w8a8-int8", "w4a16"],
        description="Schemes to write; the gate picks the smallest that passes.",
    )
    group_size: int = Field(
        128,
        ge=2,
        description="Input columns per weight scale of 4-bit schemes (must divide every "
        "layer's width; vLLM's CPU kernel needs widths in multiples of 32).",
    )
    calibration: CalibrationConfig = CalibrationConfig()
    gate: GateConfig = GateConfig()
    gguf: GgufConfig = GgufConfig()
    python: str | None = runtime_field(
        None,
        description="Python of the quantization environment (llmcompressor) for calibrated schemes; "
        "default: .venv-quant/bin/python beside the project (scripts/setup.sh makes it).",
    )

    @model_validator(mode="after")
    def _schemes_known(self) -> QuantizeConfig:
        if len(set(self.schemes)) != len(self.schemes):
            raise ValueError(f"schemes {self.schemes} lists one twice")
        if not self.calibration.enabled:
            needs = [s for s in self.schemes if SCHEMES[s].method == "awq"]
            if needs:
                raise ValueError(
                    f"schemes: {needs[0]} is calibrated by definition (AWQ scales channels by their activations), "
                    "and quantize.calibration.enabled is false"
                )
        return self


def cpu_refusal(schemes: list[str]) -> str | None:
    """Why a configured scheme cannot run here (no GPU), or None."""
    for name in schemes:
        if not SCHEMES[name].cpu_ok:
            return f"quantize.schemes: {name} is refused on CPU: {SCHEMES[name].why_not_cpu}"
    return None

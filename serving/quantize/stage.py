"""The quantization stage's registration: the aligned model as INT8, FP8 and 4-bit (GPTQ, AWQ) checkpoints,
gated on quality; the rule that picks the one to ship is `quantize.gate.choose`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.engine.stage import ArtifactSpec, Resources, Stage
from serving.quantize.config import QuantizeConfig, QuantizeFaultConfig


def _steps() -> list[Any]:
    from serving.quantize.steps import QUANTIZE_STEPS

    return QUANTIZE_STEPS


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def report_rows(verdict: dict[str, Any], reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per scheme and gated metric: size, error, calibration time, where it was measured, the eval
    delta, serving tokens/s (where it was served and speed was measured) and the verdict."""
    rows = []
    for scheme, outcome in verdict["schemes"].items():
        rep = reports[scheme]
        common = {
            "scheme": scheme,
            "method": rep["method"],
            "bytes": rep["bytes"],
            "x_of_bf16": rep["compression_ratio"],
            "bits_per_param": rep["bits_per_parameter"],
            "mean_layer_error": rep["mean_layer_error"],
            "max_layer_error": rep["max_layer_error"],
            "quantize_s": rep["quantize_seconds"],
            "calibration_samples": rep["calibration_samples"],
            "measured_on": outcome.get("measured_on") or "",
            "servable_here": "yes" if outcome.get("servable_here", True) else "no",
            "tokens_per_s": outcome.get("tokens_per_s"),
            "speedup": outcome.get("speedup"),
            "eligible": "yes" if outcome["eligible"] else "NO",
            "chosen": "yes" if verdict["chosen"] == scheme else "",
        }
        for row in outcome["comparisons"] or [{}]:
            rows.append(
                {
                    **common,
                    "task": row.get("task", ""),
                    "metric": row.get("metric", ""),
                    "unquantized": _round(row.get("unquantized")),
                    "quantized": _round(row.get("quantized")),
                    "delta": _round(row.get("delta")),
                    "delta_95ci": f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]" if row else "",
                    "ppl_ratio": _round(row.get("ratio")),
                }
            )
    return rows


def _artifacts(
    manifests: dict[str, dict[str, Any]], status: dict[str, str], error: BaseException | None
) -> list[ArtifactSpec]:
    gate = manifests.get("quantize/gate")
    if gate is None:
        return []
    data = json.loads((Path(gate["dir"]) / "report.json").read_text())
    verdict = data["verdict"]
    return [
        ArtifactSpec("quantization-report", "table", report_rows(verdict, data["checkpoints"]), verdict["decision"])
    ]


def _summary(manifests: dict[str, dict[str, Any]]) -> list[str]:
    gate = manifests.get("quantize/gate")
    return [f"quant:   {gate['extra']['decision']}"] if gate else []


STAGE = Stage(
    name="quantize",
    description="Quantization: INT8, FP8 and 4-bit (GPTQ, AWQ) compressed-tensors checkpoints, calibrated on the "
    "lineage, gated on evals against the unquantized model.",
    config_model=QuantizeConfig,
    debug_model=QuantizeFaultConfig,
    steps=_steps,
    after=("evaluate",),
    artifacts=_artifacts,
    resources=Resources(pool="gpu", gpus=1),
    packages=("serving",),
    summary=_summary,
)

